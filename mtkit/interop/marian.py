"""Where each of mtkit's weights sits in a transformers ``MarianMTModel``: one table both directions read.

Marian's sinusoidal positions put sin in the first half of the model dimension and cos in the second,
where mtkit interleaves them (sin on even dimensions). Both use the same frequencies, so one fixed
permutation of the model dimension (``residual_order``), applied to every weight that reads or writes
the residual stream, makes the two models compute the same function: LayerNorm is blind to the order
of its inputs, and attention and the feed-forward block see the stream only through those weights.
The export (hf_export.py) applies the permutation, the import (hf_import.py) its inverse; both are
exact, as a permutation moves values without changing them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch
from torch import Tensor

from mtkit.model.transformer import DecoderLayer, EncoderLayer, Transformer

# Which axis of a weight is the residual stream: a projection's input columns ("reads"), a projection's
# output rows or a LayerNorm's vector ("writes"), or none (a bias inside a block).
Axis = Literal["reads", "writes", "none"]

NOT_A_TOKEN = -1e4  # the logit bias of an id that is no target token: exp(-1e4) is 0 in float32

# Marian's activation names (transformers' ACT2FN) for model.activation; "silu" is swish's other name.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "swish": "swish", "silu": "swish"}


def residual_order(d_model: int) -> Tensor:
    """Marian's dimension j is mtkit's dimension order[j]: the sin dimensions (even) first, then the cos ones."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def to_marian(tensor: Tensor, axis: Axis, order: Tensor) -> Tensor:
    """An mtkit weight with its residual-stream axis in Marian's order (``order`` is ``residual_order``)."""
    if axis == "reads":
        return tensor[:, order]
    return tensor[order] if axis == "writes" else tensor


def from_marian(tensor: Tensor, axis: Axis, order: Tensor) -> Tensor:
    """The inverse of ``to_marian``: a Marian weight with its residual-stream axis in mtkit's order."""
    return to_marian(tensor, axis, torch.argsort(order))


def layer_weights(model: Transformer) -> Iterator[tuple[str, Tensor, Axis]]:
    """(Marian name, mtkit tensor, residual axis) of every weight inside the layers, in Marian's naming.

    Embeddings, positions and the output projection are mapped by the export and import themselves,
    as their rows are token ids, which the two toolkits number differently.
    """
    for i, layer in enumerate(model.encoder.layers):
        yield from _encoder_layer(f"model.encoder.layers.{i}", layer)
    for i, layer in enumerate(model.decoder.layers):
        yield from _decoder_layer(f"model.decoder.layers.{i}", layer)


def _linear(name: str, linear: torch.nn.Linear, axis: Axis) -> Iterator[tuple[str, Tensor, Axis]]:
    yield f"{name}.weight", linear.weight, axis
    if linear.bias is not None:
        yield f"{name}.bias", linear.bias, "writes" if axis == "writes" else "none"


def _norm(name: str, norm: torch.nn.LayerNorm) -> Iterator[tuple[str, Tensor, Axis]]:
    yield f"{name}.weight", norm.weight, "writes"
    yield f"{name}.bias", norm.bias, "writes"


def _attention(name: str, attn) -> Iterator[tuple[str, Tensor, Axis]]:
    for proj in ("q_proj", "k_proj", "v_proj"):
        yield from _linear(f"{name}.{proj}", getattr(attn, proj), "reads")
    yield from _linear(f"{name}.out_proj", attn.out_proj, "writes")


def _ffn(name: str, ffn) -> Iterator[tuple[str, Tensor, Axis]]:
    yield from _linear(f"{name}.fc1", ffn.up, "reads")
    yield from _linear(f"{name}.fc2", ffn.down, "writes")


def _encoder_layer(name: str, layer: EncoderLayer) -> Iterator[tuple[str, Tensor, Axis]]:
    yield from _attention(f"{name}.self_attn", layer.self_attn)
    yield from _norm(f"{name}.self_attn_layer_norm", layer.res_attn.norm)
    yield from _ffn(name, layer.ffn)
    yield from _norm(f"{name}.final_layer_norm", layer.res_ffn.norm)


def _decoder_layer(name: str, layer: DecoderLayer) -> Iterator[tuple[str, Tensor, Axis]]:
    yield from _attention(f"{name}.self_attn", layer.self_attn)
    yield from _norm(f"{name}.self_attn_layer_norm", layer.res_self.norm)
    yield from _attention(f"{name}.encoder_attn", layer.cross_attn)
    yield from _norm(f"{name}.encoder_attn_layer_norm", layer.res_cross.norm)
    yield from _ffn(name, layer.ffn)
    yield from _norm(f"{name}.final_layer_norm", layer.res_ffn.norm)
