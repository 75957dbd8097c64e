"""int8 inference: every linear layer of a trained model as int8 weights times int8 activations.

Weights are quantized once, symmetrically per output channel. Activations are quantized as they come,
symmetrically per row (a token's vector, or one beam's step), so that a row's result never depends on the
rows beside it: the product of two int8 matrices is summed exactly in int32 (``torch._int_mm``, PyTorch's
int8 kernel, which runs on VNNI or AMX where the CPU has them), and scaling back is element by element.
Batching, a beam search's reordering and sentences that join a continuous search therefore change no
translation, as in fp32. Attention itself (scores, softmax, the mix of values), layer norms and
embeddings stay in fp32, as in CTranslate2's int8.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

INT8_MAX = 127  # symmetric: -127..127, so that -x quantizes to the negation of x
TINY_SCALE = 1e-12  # the scale of an all-zero row or channel, which then quantizes to zeros


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (N, K) float -> (int8 (N, K), scale (N, 1)) with x ~ int8 * scale, each row on its own scale."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_(min=TINY_SCALE) / INT8_MAX
    return (x / scale).round_().to(torch.int8), scale


class Int8Linear(nn.Module):
    """``nn.Linear`` with int8 weights (per output channel) and int8 activations (per row, at run time).

    ``weight`` holds the int8 matrix (out, in); ``scale`` (out,) brings each output back to float. Tensors
    of any leading shape go in, as with ``nn.Linear``; the output is float32.
    """

    def __init__(self, weight: Tensor, scale: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)
        self.in_features, self.out_features = weight.size(1), weight.size(0)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        weight = linear.weight.detach().float()
        quantized, scale = quantize_rows(weight)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(quantized, scale.squeeze(1), bias)

    def rows(self, ids: Tensor) -> Int8Linear:
        """The layer restricted to outputs ``ids`` (a shortlist's candidates), quantized as the whole one is."""
        return Int8Linear(self.weight[ids], self.scale[ids], None if self.bias is None else self.bias[ids])

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).float()
        quantized, row_scale = quantize_rows(rows)
        products = torch._int_mm(quantized, self.weight.t())  # (N, out) int32, exact
        # Converted in place, into the same memory: int32 and float32 have one size and each element is read
        # before it is written. Then scaled in place, with no type promotion.
        out = products.view(torch.float32).copy_(products).mul_(row_scale).mul_(self.scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def quantize_int8(model: nn.Module) -> nn.Module:
    """``model`` with each of its ``nn.Linear`` layers replaced, in place, by an ``Int8Linear`` (CPU only).

    A tied output layer gets an int8 copy; the embedding it shares weights with stays float32.
    """
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear.from_linear(child))
        else:
            quantize_int8(child)
    return model
