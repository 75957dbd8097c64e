"""Teacher-forced scoring: the log-probability a model gives each token of a given target, eos included.

One decoder pass over bos + target per batch, no search and no cache, through the same ``model.decode`` (and so
the same output projection, ``Transformer.output_layer``) that search steps through, with its log-softmax in
float32 as search takes it. An ensemble's mean log-probabilities are renormalised there as its search
renormalises them, so a search's output scored here gets the log-probability the search reported (up to float
rounding: the search computed it one cached step at a time).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mtkit.data.parallel import pad
from mtkit.data.tokenizer import BOS_ID, EOS_ID
from mtkit.decoding.ensemble import Ensemble
from mtkit.model.transformer import Transformer


@torch.inference_mode()
def forced_log_probs(
    model: Transformer | Ensemble, src: Tensor, src_pad_mask: Tensor, targets: list[list[int]]
) -> list[list[float]]:
    """The log-probability of each token of each of ``targets`` (ids without bos and eos) followed by eos, given
    its row of ``src`` (B, S) and the tokens before it: len(target) + 1 numbers per target."""
    tgt_in = pad(targets, prefix=[BOS_ID]).to(src.device)  # (B, T)
    tgt_out = pad(targets, suffix=[EOS_ID]).to(src.device)  # (B, T): what each position predicts
    logits = model.decode(tgt_in, model.encode(src, src_pad_mask), src_pad_mask)  # (B, T, V)
    picked = []
    for row, wanted, target in zip(logits, tgt_out, targets):  # one row at a time: one (T, V) float32 copy at most
        lprobs = F.log_softmax(row[: len(target) + 1].float(), dim=-1)
        picked.append(lprobs.gather(-1, wanted[: len(target) + 1, None]).squeeze(-1))
    flat, start, scores = torch.cat(picked).tolist(), 0, []  # one copy to the host, not one per row
    for target in targets:
        scores.append(flat[start : start + len(target) + 1])
        start += len(target) + 1
    return scores
