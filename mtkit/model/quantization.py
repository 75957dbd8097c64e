"""int8 inference: every linear layer of a trained model as int8 weights times int8 activations.

Weights are quantized once, symmetrically per output channel. Activations are quantized as they come,
symmetrically per row (a token's vector, or one beam's step), so that a row's result never depends on the
rows beside it: the products of two int8 matrices are summed exactly in int32 and scaling back is element by
element. Batching, a beam search's reordering and sentences that join a continuous search therefore add no
dependence on other sentences of int8's own. Attention itself (scores, softmax, the mix of values), layer norms
and embeddings stay in fp32, as in CTranslate2's int8; there, as in fp32 decoding, other padding can move a sum
by rounding, which int8's rounding of the next layer's input can, rarely, carry to another token.

Two kernels sum the products, chosen by what the CPU has (``mtkit.runtime.int8_kernel``):

- ``dot``: signed times signed int8 (``torch._int_mm``), for CPUs with int8 dot products (VNNI, AMX).
- ``pairs``: oneDNN's unsigned-times-signed int8 kernel, the fast one on CPUs with AVX2 alone, whose
  instruction (vpmaddubsw) adds two products in int16 before int32 and saturates beyond 32,767. Activations go
  in shifted by 128 (1..255) and weights get 7 bits (-63..63), so no pair exceeds 2 * 255 * 63 = 32,130 and
  the sums stay exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mtkit.runtime import Int8Kernel, cpu_features, int8_kernel

INT8_MAX = 127  # symmetric: -127..127, so that -x quantizes to the negation of x
PAIRS_WEIGHT_MAX = 63  # the pairs kernel's weights: 2 * 255 * 63 fits in int16
PAIRS_SHIFT = 128  # the pairs kernel's activations, -127..127, go in as the unsigned 1..255
TINY_SCALE = 1e-12  # the scale of an all-zero row or channel, which then quantizes to zeros


def row_scales(x: Tensor, top: int = INT8_MAX) -> Tensor:
    """The scale (N, 1) that maps each row of ``x`` (N, K) onto -top..top."""
    return x.abs().amax(dim=-1, keepdim=True).clamp_(min=TINY_SCALE) / top


def quantize_rows(x: Tensor, top: int = INT8_MAX) -> tuple[Tensor, Tensor]:
    """x (N, K) float -> (int8 (N, K), scale (N, 1)) with x ~ int8 * scale, each row on its own scale."""
    scale = row_scales(x, top)
    return (x / scale).round_().to(torch.int8), scale


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (per output channel) and int8 activations (per row, at run time).

    ``weight`` holds the int8 matrix (out, in); ``scale`` (out,) brings each output back to float. Tensors
    of any leading shape go in, as with ``nn.Linear``; the output is float32. It answers what decoding asks of
    a linear layer (``mtkit.model.linear.DecodingLinear``): itself, its rows, or layers joined.
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None, kernel: Int8Kernel) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.kernel = kernel
        # The pairs kernel's weights in oneDNN's layout and its zero points, made on first use.
        self._packed: Tensor | None = None
        self._zero_points: Tensor | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear, kernel: Int8Kernel) -> Int8Linear:
        weight = linear.weight.detach().float()
        quantized, scale = quantize_rows(weight, PAIRS_WEIGHT_MAX if kernel == "pairs" else INT8_MAX)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(quantized, scale.squeeze(1), bias, kernel)

    @classmethod
    def joined(cls, layers: Sequence[Int8Linear]) -> Int8Linear:
        """One layer computing what ``layers`` (of one input width and kernel) compute, outputs side by side: the
        same values, since each row is quantized on its own scale and the products are summed exactly."""
        biases = [layer.bias for layer in layers]
        bias = None if any(b is None for b in biases) else torch.cat(biases)
        weight, scale = torch.cat([layer.weight for layer in layers]), torch.cat([layer.scale for layer in layers])
        return cls(weight, scale, bias, layers[0].kernel)

    def decoding(self) -> Int8Linear:
        """The layer itself: decoding multiplies as ``forward`` does."""
        return self

    def rows(self, ids: Tensor) -> Int8Linear:
        """The layer restricted to outputs ``ids`` (a shortlist's candidates), quantized as the whole one is."""
        bias = None if self.bias is None else self.bias[ids]
        return Int8Linear(self.weight[ids], self.scale[ids], bias, self.kernel)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).float()
        scale = row_scales(rows)
        if self.kernel == "pairs":
            out = self._pairs((rows / scale).round_().add_(PAIRS_SHIFT).to(torch.uint8))
        else:
            products = torch._int_mm((rows / scale).round_().to(torch.int8), self.weight.t())  # (N, out) int32
            # Converted in place, into the same memory: int32 and float32 have one size and each element is read
            # before it is written. Then scaled by channel, in place, with no type promotion.
            out = products.view(torch.float32).copy_(products).mul_(self.scale)
        out.mul_(scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def _pairs(self, shifted: Tensor) -> Tensor:
        """``shifted`` (N, in; uint8, zero at 128) times the weights, summed exactly, scaled by channel: (N, out)."""
        if self._packed is None:
            self._packed = torch.ops.onednn.qlinear_prepack(self.weight, None)
            self._zero_points = torch.zeros(self.out_features, dtype=torch.long)
        return torch.ops.onednn.qlinear_pointwise(
            shifted, 1.0, PAIRS_SHIFT, self._packed, self.scale, self._zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip

    def __getstate__(self) -> dict:
        """Copies (``copy.deepcopy``) pack their own weights: oneDNN's packed tensor has no storage to copy."""
        return {**self.__dict__, "_packed": None}

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}, kernel={self.kernel}"


def quantize_int8(model: nn.Module, kernel: Int8Kernel | None = None) -> nn.Module:
    """``model`` with each of its ``nn.Linear`` layers replaced, in place, by an ``Int8Linear`` (CPU only), on
    ``kernel``: by default the one this CPU is fast at.

    A tied output layer gets an int8 copy; the embedding it shares weights with stays float32.
    """
    kernel = kernel or int8_kernel(cpu_features())
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_linear(child, kernel))
        else:
            quantize_int8(child, kernel)
    return model
