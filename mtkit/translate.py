"""Lines in, lines out: tokenize, batch by length, search, detokenize, restore input order.

Exactly one output line per input line: empty and whitespace-only lines give empty lines without
touching the model, and over-long lines are truncated to the model's positions (with a warning).
"""

from __future__ import annotations

import logging

import torch

from mtkit.config import DecodeConfig
from mtkit.data import source_tensor
from mtkit.model import Transformer
from mtkit.search import beam_search
from mtkit.tokenizer import Tokenizer

log = logging.getLogger("mtkit")


def translate_lines(
    model: Transformer,
    src_tok: Tokenizer,
    tgt_tok: Tokenizer,
    lines: list[str],
    decode: DecodeConfig,
    device: torch.device,
) -> list[str]:
    """Translations of ``lines`` in the same order; one string per line."""
    outputs = [""] * len(lines)
    todo = [i for i, line in enumerate(lines) if line.strip()]
    ids = dict(zip(todo, src_tok.encode([lines[i] for i in todo])))
    limit = model.encoder.embed.max_positions - 1  # room for the source eos
    for i in todo:
        if len(ids[i]) > limit:
            log.warning("line %d: %d source tokens truncated to %d (model.max_positions)", i + 1, len(ids[i]), limit)
            ids[i] = ids[i][:limit]
    todo.sort(key=lambda i: len(ids[i]), reverse=True)  # similar lengths share a batch
    for start in range(0, len(todo), decode.batch_size):
        chunk = todo[start : start + decode.batch_size]
        src, src_pad_mask = source_tensor([ids[i] for i in chunk])
        hyps = beam_search(
            model,
            src.to(device),
            src_pad_mask.to(device),
            beam=decode.beam,
            lenpen=decode.lenpen,
            max_len_a=decode.max_len_a,
            max_len_b=decode.max_len_b,
        )
        for i, text in zip(chunk, tgt_tok.decode([h[0].tokens for h in hyps])):
            outputs[i] = text
    return outputs
