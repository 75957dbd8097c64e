"""Teacher-forced scoring: the log-probability a model gives each token of a given target, eos included.

One decoder pass over bos + target per batch, no search and no cache, then the same output projection search
steps through (``Transformer.output_layer``), with its log-softmax in float32 as search takes it. An ensemble's
mean log-probabilities are renormalised as its search renormalises them, so a search's output scored here gets
the log-probability the search reported (up to float rounding: the search computed it one cached step at a time;
and over the whole vocabulary: a search with a shortlist renormalised over its candidates only).
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
    model: Transformer | Ensemble,
    src: Tensor,
    src_pad_mask: Tensor,
    targets: list[list[int]],
    lead: tuple[int, ...] = (),
) -> list[list[float]]:
    """The log-probability of each token of each of ``targets`` (ids without bos and eos) followed by eos, given
    its row of ``src`` (B, S) and the tokens before it: len(target) + 1 numbers per target. ``lead`` (a target
    language's token) is read after bos and before each target, given, not scored.

    The decoder runs over the whole batch; the output projection and the log-softmax run one target at a time, so
    no more than one target's (T, V) logits per model are held, however many targets the batch has."""
    members = model.members if isinstance(model, Ensemble) else [model]
    memory = model.encode(src, src_pad_mask)
    memories = memory.split(model.widths, dim=-1) if isinstance(model, Ensemble) else [memory]
    tgt_in = pad(targets, prefix=[BOS_ID, *lead]).to(src.device)  # (B, T)
    tgt_out = pad(targets, prefix=[*lead], suffix=[EOS_ID]).to(src.device)  # (B, T): what each position predicts
    features = [m.decoder(tgt_in, mem, src_pad_mask) for m, mem in zip(members, memories)]  # each (B, T, D)
    outputs = [m.output_layer() for m in members]
    picked = []
    for row, (wanted, target) in enumerate(zip(tgt_out, targets)):
        scored = slice(len(lead), len(lead) + len(target) + 1)
        lprobs = [F.log_softmax(out(f[row, scored]).float(), dim=-1) for out, f in zip(outputs, features)]
        if len(lprobs) > 1:  # the members' mean renormalised, as an ensemble's search takes it
            lprobs = [F.log_softmax(torch.stack(lprobs).mean(dim=0), dim=-1)]
        picked.append(lprobs[0].gather(-1, wanted[scored, None]).squeeze(-1))
    flat, start, scores = torch.cat(picked).tolist(), 0, []  # one copy to the host, not one per row
    for target in targets:
        scores.append(flat[start : start + len(target) + 1])
        start += len(target) + 1
    return scores
