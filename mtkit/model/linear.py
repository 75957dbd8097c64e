"""Linear layers as decoding runs them: through oneDNN over a copy of the weights packed once, where that pays.

Training multiplies through ATen (``torch.nn.functional.linear``) as ``nn.Linear`` does. Decoding, without gradients,
multiplies by the same weights at every step of every sentence; on some CPUs oneDNN's product over weights laid out
for it once is the faster (``mtkit.runtime.fp32_vocabulary_gemm`` and ``bf16_decoding_gemm`` say where, measured in
docs/benchmarks.md). The packed copy is made again whenever a weight changes (``mtkit.model.derived.Derived``), so a
model decoded between training updates (validation) decodes with its current weights.

``DecodingLinear`` is what decoding asks of any linear layer, whichever kernel multiplies: ``Linear`` here (ATen or
oneDNN) and ``mtkit.model.quantization.Int8Linear`` answer it, so the architecture never asks which one it holds.

A ``Linear`` may carry a LoRA adapter (``lora``, a ``LowRankUpdate``: mtkit.model.lora), whose low-rank product
every path adds to the layer's own: ``forward``, ``decoding``, ``rows`` and ``joined``. The packed copy holds the
layer's weights alone, so an adapter's values never go stale in it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, Self

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtkit import runtime
from mtkit.model.derived import Derived


class LowRankUpdate(Protocol):
    """A LoRA adapter as a layer adds it: ``scale`` B A x, its own dropout on x in training."""

    a: Tensor  # (rank, in)
    b: Tensor  # (out, rank)
    scale: float

    def __call__(self, x: Tensor) -> Tensor: ...


class DecodingLinear(Protocol):
    """A linear layer as decoding uses it, whatever its kernel."""

    def __call__(self, x: Tensor) -> Tensor: ...

    def decoding(self) -> Callable[[Tensor], Tensor]:
        """The layer as a decoding step applies it: itself, or the same product over weights laid out for a faster
        kernel."""

    def rows(self, ids: Tensor) -> Callable[[Tensor], Tensor]:
        """The layer cut to output rows ``ids`` (a shortlist's candidates), as decoding applies it."""

    @classmethod
    def joined(cls, layers: Sequence[Self]) -> Callable[[Tensor], Tensor]:
        """One layer computing what ``layers`` (of one input) compute, outputs side by side, as decoding applies it."""


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


def onednn_linear(weight: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """``F.linear(x, weight, bias)`` through oneDNN over a copy of ``weight`` packed once in oneDNN's layout (fp32,
    CPU). Each row's result is the same whatever the number of rows (unlike MKL's below 64 rows, measured)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def linear(x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    return linear


def low_rank_product(a: Tensor, b: Tensor) -> Callable[[Tensor], Tensor]:
    """x -> x A^T B^T: an adapter's update, with its scale in ``b``, for copies made once and kept."""
    a, b = a.detach(), b.detach()
    return lambda x: F.linear(F.linear(x, a), b)


def stacked_updates(layers: Sequence[Linear]) -> Callable[[Tensor], Tensor]:
    """The adapters of ``layers`` (of one input; a layer without one adds nothing) as one update whose outputs lie
    side by side, as their layers' joined outputs do: A stacked (sum of ranks, in), and B block-diagonal, each
    adapter's scaled B where its layer's outputs meet its rank's columns. Two products in all, not two a layer."""
    adapters = [layer.lora for layer in layers if layer.lora is not None]
    a = torch.cat([adapter.a for adapter in adapters])
    b = a.new_zeros(sum(layer.out_features for layer in layers), a.size(0))
    row = column = 0
    for layer in layers:
        if layer.lora is not None:
            rank = layer.lora.a.size(0)
            b[row : row + layer.out_features, column : column + rank] = layer.lora.b.detach() * layer.lora.scale
            column += rank
        row += layer.out_features
    return low_rank_product(a, b)


def decoding_linear(weight: Tensor, bias: Tensor | None, vocabulary: bool = False) -> Callable[[Tensor], Tensor]:
    """``F.linear`` with these weights as decoding should run it (``onednn_pays``), for weights made once and kept
    (a shortlist's cut of the output layer, the joined query, key and value projections)."""
    if onednn_pays(weight, vocabulary):
        return onednn_linear(weight, bias)
    return lambda x: F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (the same parameters and state dict) that decodes through oneDNN over a packed copy of its
    weights where that pays (``onednn_pays``).

    A hidden layer (``vocabulary`` False) does so in ``forward`` itself, which its module calls at every step. The
    output layer over the vocabulary (``vocabulary`` True) keeps ``forward`` for training and scoring; decoding asks
    for ``decoding()`` or a shortlist's ``rows``, where fp32 weights of its size may go to oneDNN too.
    """

    lora: LowRankUpdate | None  # the layer's LoRA adapter, if it has one (a submodule: its tensors are the model's)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, vocabulary: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.vocabulary = vocabulary
        self._packed: Derived[Callable[[Tensor], Tensor]] = Derived()
        self.register_module("lora", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.vocabulary or not onednn_pays(self.weight):
            out = F.linear(x, self.weight, self.bias)
        else:
            out = self._packed_copy()(x)
        return out if self.lora is None else out + self.lora(x)

    def decoding(self) -> Callable[[Tensor], Tensor]:
        """The layer itself, or where oneDNN pays (and no adapter adds to it), the same layer over a copy of its
        weights packed for oneDNN, made once and again only when they change."""
        return self._packed_copy() if self.lora is None and onednn_pays(self.weight, self.vocabulary) else self

    def rows(self, ids: Tensor) -> Callable[[Tensor], Tensor]:
        """The layer cut to output rows ``ids`` (a shortlist's candidates): a copy of those rows (and of its
        adapter's), kept by the caller."""
        bias = None if self.bias is None else self.bias[ids]
        cut = decoding_linear(self.weight[ids], bias, self.vocabulary)
        if self.lora is None:
            return cut
        update = low_rank_product(self.lora.a, self.lora.b[ids] * self.lora.scale)
        return lambda x: cut(x) + update(x)

    @classmethod
    def joined(cls, layers: Sequence[Linear]) -> Callable[[Tensor], Tensor]:
        """One layer computing what ``layers`` (of one input width) compute, outputs side by side: a copy of their
        weights (and of their adapters', ``stacked_updates``), kept by the caller."""
        biases = [layer.bias for layer in layers]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        joint = decoding_linear(torch.cat([layer.weight for layer in layers]), bias)
        if all(layer.lora is None for layer in layers):
            return joint
        updates = stacked_updates(layers)
        return lambda x: joint(x) + updates(x)

    def _packed_copy(self) -> Callable[[Tensor], Tensor]:
        """``F.linear`` with this layer's weights through oneDNN, over the packed copy kept for them."""
        weight, bias = self.weight, self.bias
        sources = [weight] if bias is None else [weight, bias]
        return self._packed.get(sources, lambda: onednn_linear(weight, bias))

    def train(self, mode: bool = True) -> Self:
        self._packed.clear()  # a fused optimizer's steps leave no trace that the copy could be checked against
        return super().train(mode)
