"""LoRA (Hu et al., 2021): low-rank adapters on the linear layers of a built Transformer.

An adapter on a layer y = x W^T + b is two matrices, A (rank, in) and B (out, rank); the adapted layer computes
x W^T + b + (alpha / rank) B A drop(x), dropout on the adapter's input in training only. A starts as nn.Linear's
weights do, B at zero, so a model given new adapters computes what its base computes. The layer keeps its own
weights: the adapter sits beside them as ``Linear.lora`` (mtkit.model.linear), whose decoding paths (a oneDNN
product over packed weights, the joined query, key and value projections) add it. Merging folds the adapter into
the weights, W + (alpha / rank) B A, after which the layer is an ordinary one again.

The layers an adapter may sit on are the attention projections (self- and cross-attention: q, k, v, out) and the
feed-forward layers (up, down) of the encoder and the decoder (``TARGETS``); never the embeddings or the output
projection. An adapter's tensors are named after its layer: ``decoder.layers.0.self_attn.q_proj.lora.a`` and
``.lora.b``, the names its file holds (mtkit.model.adapter_file).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mtkit.config import ConfigError, LoraConfig, LoraTarget
from mtkit.model.attention import Dropout, MultiHeadAttention
from mtkit.model.linear import Linear
from mtkit.model.transformer import FeedForward, Transformer

ATTENTION = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "out": "out_proj"}
# Each group train.lora.targets may name, and the single projections it stands for.
TARGETS: dict[str, tuple[str, ...]] = {
    "self_attention": ("self_q", "self_k", "self_v", "self_out"),
    "cross_attention": ("cross_q", "cross_k", "cross_v", "cross_out"),
    "ffn": ("ffn_up", "ffn_down"),
}
TARGETS["attention"] = TARGETS["self_attention"] + TARGETS["cross_attention"]
TENSORS = ("a", "b")  # an adapter's tensors: A (rank, in), B (out, rank)


class LowRank(nn.Module):
    """One layer's adapter: ``forward(x)`` is what it adds to the layer's output, (alpha / rank) B A drop(x)."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(rank, in_features))  # drawn by ``add_adapters``, or read from a file
        self.b = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank
        self.dropout = Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(F.linear(self.dropout(x), self.a), self.b) * self.scale

    def delta(self) -> Tensor:
        """(alpha / rank) B A, in float32: what merging adds to the layer's weights."""
        return (self.b.detach().float() @ self.a.detach().float()) * self.scale

    def extra_repr(self) -> str:
        return f"rank={self.a.size(0)}, scale={self.scale:g}"


def projections(targets: Iterable[LoraTarget]) -> set[str]:
    """The single projections ``targets`` name, its groups expanded."""
    return {single for target in targets for single in TARGETS.get(target, (target,))}


def _candidates(model: Transformer) -> Iterator[tuple[str, Linear]]:
    """Every layer an adapter may sit on, with its projection's name in train.lora.targets."""
    stacks = [(layer, False) for layer in model.encoder.layers] + [(layer, True) for layer in model.decoder.layers]
    for layer, decoder in stacks:
        attentions: list[tuple[str, MultiHeadAttention]] = [("self", layer.self_attn)]
        if decoder:
            attentions.append(("cross", layer.cross_attn))
        for kind, attention in attentions:
            for short, attribute in ATTENTION.items():
                yield f"{kind}_{short}", getattr(attention, attribute)
        ffn: FeedForward = layer.ffn
        yield "ffn_up", ffn.up
        yield "ffn_down", ffn.down


def most_tensors(model: Transformer) -> int:
    """How many tensors adapters on ``model`` can have at most: two for every layer one may sit on."""
    return 2 * sum(1 for _ in _candidates(model))


def target_layers(model: Transformer, settings: LoraConfig) -> dict[str, Linear]:
    """The layers ``settings`` adapt, by their names in the model's state dict, in the model's order; ConfigError
    for a rank above the smaller width of one of them (B A could then hold no more than at that width)."""
    wanted = projections(settings.targets)
    names = {id(module): name for name, module in model.named_modules()}
    chosen = {names[id(layer)]: layer for projection, layer in _candidates(model) if projection in wanted}
    for name, layer in chosen.items():
        if not isinstance(layer, Linear):  # an int8 layer: its weights are quantized, an adapter is merged first
            raise ConfigError(f"{name} is a {type(layer).__name__}, which takes no adapter")
        if settings.rank > min(layer.in_features, layer.out_features):
            raise ConfigError(
                f"train.lora.rank {settings.rank} is more than {name} can take: it is {layer.in_features} wide in "
                f"and {layer.out_features} out"
            )
    return chosen


def expected_tensors(model: Transformer, settings: LoraConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of the adapter tensors ``settings`` put on ``model``."""
    shapes = {}
    for name, layer in target_layers(model, settings).items():
        shapes[f"{name}.lora.a"] = (settings.rank, layer.in_features)
        shapes[f"{name}.lora.b"] = (layer.out_features, settings.rank)
    return shapes


def add_adapters(model: Transformer, settings: LoraConfig) -> int:
    """Put a new adapter on each layer ``settings`` target, on the layer's device and in its dtype: A drawn from
    torch's generator as nn.Linear draws its weights (and peft its A), B zero. The number of parameters added."""
    added = 0
    for layer in _put(model, settings):
        nn.init.kaiming_uniform_(layer.lora.a, a=math.sqrt(5))
        added += layer.lora.a.numel() + layer.lora.b.numel()
    return added


def put_adapters(model: Transformer, settings: LoraConfig, tensors: dict[str, Tensor]) -> None:
    """Put the adapters of ``settings`` on ``model`` with the values ``tensors`` holds (an adapter file's, checked
    against the model: mtkit.model.adapter_file), drawing nothing from torch's generator."""
    _put(model, settings)
    load_adapter_weights(model, tensors)


def _put(model: Transformer, settings: LoraConfig) -> list[Linear]:
    """Each target layer of ``settings``, given an adapter whose A is not yet set."""
    layers = list(target_layers(model, settings).values())
    for layer in layers:
        adapter = LowRank(layer.in_features, layer.out_features, settings.rank, settings.alpha, settings.dropout)
        layer.lora = adapter.to(device=layer.weight.device, dtype=layer.weight.dtype)
    return layers


def adapted_layers(model: nn.Module) -> dict[str, Linear]:
    """The layers of ``model`` that carry an adapter, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, Linear) and m.lora is not None}


def adapter_weights(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors by name (``LAYER.lora.a``, ``LAYER.lora.b``): what a LoRA checkpoint saves."""
    return {
        f"{name}.lora.{tensor}": getattr(layer.lora, tensor)
        for name, layer in adapted_layers(model).items()
        for tensor in TENSORS
    }


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every adapter parameter of ``model``, in the model's order (the order an optimizer's state is matched by)."""
    ids = {id(p) for p in adapter_weights(model).values()}
    return [p for p in model.parameters() if id(p) in ids]


def load_adapter_weights(model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Copy ``tensors`` (checked against the model: mtkit.model.adapter_file) into its adapters."""
    with torch.no_grad():
        for name, parameter in adapter_weights(model).items():
            parameter.copy_(tensors[name])


def merge_adapters(model: nn.Module) -> None:
    """Fold each adapter into its layer's weights, W + (alpha / rank) B A (in float32, then the weights' dtype),
    and take it off: the layer computes what it computed with the adapter, up to float rounding, through the
    decoding paths of an ordinary layer."""
    with torch.no_grad():
        for layer in adapted_layers(model).values():
            layer.weight.copy_((layer.weight.float() + layer.lora.delta()).to(layer.weight.dtype))
            layer.lora = None
    model.train(model.training)  # the joined and packed copies of the weights are made again


def shared_copy(model: Transformer) -> Transformer:
    """A copy of ``model``'s modules holding the very same parameters and buffers (no weight is copied), to give
    adapters of its own: several adapters then serve over one base in memory. Copies of weights made for
    decoding are each copy's own."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
    copied = copy.deepcopy(model, memo=shared)
    return copied.train(model.training)  # setting the mode drops the derived copies it was given
