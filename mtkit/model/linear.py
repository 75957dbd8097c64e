"""Linear layers as decoding runs them: through oneDNN over a copy of the weights packed once, where that pays.

Training multiplies through ATen (``torch.nn.functional.linear``) as ``nn.Linear`` does. Decoding, without gradients,
multiplies by the same weights at every step of every sentence; on some CPUs oneDNN's product over weights laid out
for it once is the faster (``mtkit.runtime.fp32_vocabulary_gemm`` and ``bf16_decoding_gemm`` say where, measured in
docs/benchmarks.md). The packed copy is made again whenever a weight changes (``mtkit.model.derived.Derived``), so a
model decoded between training updates (validation) decodes with its current weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtkit import runtime
from mtkit.model.derived import Derived, onednn_linear


def onednn_pays(weight: Tensor, vocabulary: bool = False) -> bool:
    """Whether decoding multiplies by ``weight`` through oneDNN over a packed copy: without gradients, on a CPU, in bf16
    for any layer where ``runtime.bf16_decoding_gemm`` says so, and in fp32 only for output weights (``vocabulary``:
    the whole output layer's, or a shortlist's cut of them) where ``runtime.fp32_vocabulary_gemm`` says so and there
    are enough of them that oneDNN's fixed cost per call pays (``ONEDNN_MIN_WEIGHTS``). fp32 layers of a model's own
    width stay in ATen: there oneDNN was slower at the one to five rows of a sentence's beams."""
    if torch.is_grad_enabled() or weight.is_cuda:
        return False
    if weight.dtype == torch.bfloat16:
        return runtime.bf16_decoding_gemm(runtime.cpu_vendor(), runtime.cpu_features()) == "onednn"
    return (
        vocabulary
        and weight.dtype == torch.float32
        and weight.numel() >= runtime.ONEDNN_MIN_WEIGHTS
        and runtime.fp32_vocabulary_gemm(runtime.cpu_vendor()) == "onednn"
    )


def decoding_linear(weight: Tensor, bias: Tensor | None, vocabulary: bool = False) -> Callable[[Tensor], Tensor]:
    """``F.linear`` with these weights as decoding should run it (``onednn_pays``), for weights made once and kept
    (a shortlist's cut of the output layer, the joined query, key and value projections)."""
    if onednn_pays(weight, vocabulary):
        return onednn_linear(weight, bias)
    return lambda x: F.linear(x, weight, bias)


def packed_linear(
    copy: Derived[Callable[[Tensor], Tensor]], weight: Tensor, bias: Tensor | None
) -> Callable[[Tensor], Tensor]:
    """``F.linear`` with these weights through oneDNN, over the packed copy that ``copy`` keeps for them."""
    sources = [weight] if bias is None else [weight, bias]
    return copy.get(sources, lambda: onednn_linear(weight, bias))


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) that decodes through oneDNN over a packed copy of its
    weights where that pays (``onednn_pays``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self._packed: Derived[Callable[[Tensor], Tensor]] = Derived()

    def forward(self, x: Tensor) -> Tensor:
        if not onednn_pays(self.weight):
            return F.linear(x, self.weight, self.bias)
        return packed_linear(self._packed, self.weight, self.bias)(x)

    def train(self, mode: bool = True) -> Self:
        self._packed.clear()  # a fused optimizer's steps leave no trace that the copy could be checked against
        return super().train(mode)
