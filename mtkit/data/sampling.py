"""Batches drawn from several corpora, reproducibly from a position that a checkpoint can hold.

Each corpus is cut into token-bucketed batches as a single corpus is (``token_batches``), one epoch
at a time, seeded by the run's seed, the corpus and its epoch. Each batch of training comes from one
corpus, drawn with probability p_i proportional to (weight_i * pairs_i) ** (1 / temperature), as
fairseq's and eole's multilingual training sample their corpora: temperature 1 follows the corpora's
sizes, a larger one flattens the shares towards uniform, so a small direction is seen more often.
The n-th draw depends only on the seed and n, so the position to resume from is the number of draws
and each corpus's (epoch, batch): no random state to store, and every rank draws alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mtkit.data.token_store import TokenStore


def corpus_probabilities(pairs: Sequence[int], weights: Sequence[float], temperature: float) -> np.ndarray:
    """p_i proportional to (weight_i * pairs_i) ** (1 / temperature), summing to 1, for pairs_i >= 1 and finite
    weights > 0 (the config refuses any other number) at any temperature > 0.

    Computed in log space, as a softmax of the log sizes over the temperature, the largest subtracted first: a
    large weight times a large corpus cannot overflow, nor can every power underflow to 0 at a small temperature
    (0 / 0), since the largest corpus's term is exp(0) = 1. Towards temperature 0 the draws go to the largest
    corpus (the largest ones in equal shares); towards infinity, to uniform.
    """
    log_sizes = np.log(np.asarray(weights, dtype=np.float64)) + np.log(np.asarray(pairs, dtype=np.float64))
    with np.errstate(over="ignore", under="ignore"):  # -inf and 0 are the right limits at a small temperature
        shares = np.exp((log_sizes - log_sizes.max()) / temperature)
    return shares / shares.sum()


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence(list(parts)).generate_state(1, dtype=np.uint64)[0])


class CorpusMix:
    """The batches of several token stores, drawn by corpus probabilities; positions are kept by the caller.

    ``position`` is ``[draws, epoch_0, batch_0, epoch_1, batch_1, ...]``: batches drawn so far, then for
    each corpus the epoch it is in and the batches of that epoch it has given.
    """

    def __init__(
        self, stores: Sequence[TokenStore], probabilities: np.ndarray, batch_tokens: int, seed: int, multiple: int = 1
    ) -> None:
        self.stores, self.batch_tokens, self.seed, self.multiple = list(stores), batch_tokens, seed, multiple
        self.cumulative = np.cumsum(probabilities)
        self._epochs: dict[int, tuple[int, list[np.ndarray]]] = {}

    def start(self) -> list[int]:
        """The position before the first batch."""
        return [0] + [1, 0] * len(self.stores)

    def corpus_of(self, draw: int) -> int:
        """The corpus the ``draw``-th batch comes from."""
        u = np.random.default_rng(_seed(self.seed, draw)).random()
        return min(int(np.searchsorted(self.cumulative, u * self.cumulative[-1], side="right")), len(self.stores) - 1)

    def epoch_batches(self, corpus: int, epoch: int) -> list[np.ndarray]:
        held = self._epochs.get(corpus)
        if held is None or held[0] != epoch:
            batches = self.stores[corpus].batch_indices(
                self.batch_tokens, _seed(self.seed, corpus, epoch), self.multiple
            )
            self._epochs[corpus] = held = (epoch, batches)
        return held[1]

    def next(self, position: list[int]) -> tuple[int, np.ndarray]:
        """The next batch (its corpus, and the pair indices in that corpus), advancing ``position`` in place."""
        corpus = self.corpus_of(position[0])
        position[0] += 1
        epoch, batch = position[1 + 2 * corpus], position[2 + 2 * corpus]
        batches = self.epoch_batches(corpus, epoch)
        if batch >= len(batches):
            epoch, batch = epoch + 1, 0
            batches = self.epoch_batches(corpus, epoch)
        position[1 + 2 * corpus], position[2 + 2 * corpus] = epoch, batch + 1
        return corpus, batches[batch]
