"""Which batches make each update: one corpus walked epoch by epoch in a seeded shuffle, or each batch drawn
from one of several corpora (CorpusMix), and each rank's share of every update.

Every rank walks the same batches in the same order (the shuffle and the draws are seeded), so a
group's tokens and its position after it are the same on every rank, and only its share differs.
"""

from __future__ import annotations

from collections.abc import Generator

import numpy as np

from mtkit.config import TrainConfig
from mtkit.data.parallel import ShapeBuckets
from mtkit.data.sampling import CorpusMix
from mtkit.data.token_store import TokenStore
from mtkit.training.feeding import Group
from mtkit.training.resume import Progress


class DataWalk:
    """The groups of batches of the updates from a run's position on, endlessly; ``rank`` of ``world`` takes every
    ``world``-th batch of each group of ``accum * world`` batches."""

    def __init__(
        self,
        stores: list[TokenStore],
        mix: CorpusMix | None,
        buckets: ShapeBuckets,
        tc: TrainConfig,
        rank: int,
        world: int,
    ) -> None:
        self.stores, self.mix, self.buckets = stores, mix, buckets
        self.tc, self.rank, self.world = tc, rank, world
        self._epoch_indices: tuple[int, list[np.ndarray]] = (0, [])

    def groups(self, progress: Progress) -> Generator[Group, None, None]:
        """The walk from ``progress``'s position: its corpus mix's, or its epoch and batch in the epoch."""
        if self.mix is not None:
            return self._mixed(progress.mix)
        return self._epochs(progress.epoch, progress.batch_in_epoch)

    def _epochs(self, epoch: int, batch_in_epoch: int) -> Generator[Group, None, None]:
        """One corpus's groups; an empty group marks the start of each next epoch. A tail of an epoch too short to
        give every rank a batch is left out."""
        corpus, world = self.stores[0], self.world
        while True:
            batches = self.epoch_batches(epoch)
            if len(batches) - batch_in_epoch < world:
                epoch, batch_in_epoch = epoch + 1, 0
                yield Group([], 0, epoch, 0)
                continue
            group = batches[batch_in_epoch : batch_in_epoch + self.tc.accum * world]
            batch_in_epoch += len(group)
            mine = [corpus.collate(indices, self.buckets) for indices in group[self.rank :: world]]
            yield Group(mine, sum(map(corpus.target_tokens, group)), epoch, batch_in_epoch)

    def _mixed(self, position: list[int]) -> Generator[Group, None, None]:
        """Several corpora's groups: each batch of a group drawn from one of them (CorpusMix)."""
        world = self.world
        position = list(position) or self.mix.start()
        while True:
            group = [self.mix.next(position) for _ in range(self.tc.accum * world)]
            mine = [self.stores[c].collate(indices, self.buckets) for c, indices in group[self.rank :: world]]
            tokens = sum(self.stores[corpus].target_tokens(indices) for corpus, indices in group)
            yield Group(mine, tokens, mix=list(position))

    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """The epoch's batches as corpus indices, identical on every rank (the shuffle is seeded by epoch)."""
        held = self._epoch_indices
        if held[0] != epoch:
            seed = self.tc.seed * 100_003 + epoch
            held = self._epoch_indices = (
                epoch,
                self.stores[0].batch_indices(self.tc.batch_tokens, seed, self.buckets.multiple),
            )
        return held[1]
