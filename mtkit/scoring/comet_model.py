"""The COMET estimators as networks, read top-down: sparsemax, the learned mix of the encoder's layers, pooling,
the feed-forward head, and the whole network of either kind.

COMET (unbabel-comet's ``regression_metric``) encodes source, translation and reference apart, pools each into a
sentence embedding and scores the features [mt, ref, mt*ref, |mt-ref|, mt*src, |mt-src|]. CometKiwi
(``unified_metric``) encodes translation and source as one sequence, ``<s> mt </s></s> src </s>``, and scores
the mixed embedding of its first token. Parameter names are unbabel-comet's (``encoder.model.*``,
``layerwise_attention.*``, ``estimator.ff.*``), so its checkpoints' state dicts load unchanged.

Shapes: ``ids`` and ``mask`` are (B, T), ``mask`` 1 where a token is (padding 0); hidden states are (B, T, H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

POOLS = ("avg", "max", "cls", "default")  # "default": the last layer's first token, whatever ``layer`` says
ACTIVATIONS = {"Tanh": nn.Tanh, "Sigmoid": nn.Sigmoid, "Softplus": nn.Softplus}
SEPARATOR_TOKENS = 2  # XLM-R joins two segments with </s></s>
LAYER_NORM_EPS = 1e-12  # the mix's own normalisation of each layer, as unbabel-comet's


@dataclass(frozen=True)
class CometConfig:
    """What a COMET checkpoint's hyper-parameters say about the network above the encoder."""

    kind: str  # "regression" (COMET: sentences encoded apart) or "unified" (CometKiwi: encoded together)
    layer: int | None  # the hidden state scored (0: the embeddings); None: the learned mix of all of them
    sparsemax: bool  # the mix's weights through sparsemax (else softmax)
    layer_norm: bool  # each layer normalised over a sentence's tokens before mixing
    pool: str  # one of POOLS (regression); the unified kind always takes the first token
    hidden_sizes: tuple[int, ...]  # the head's hidden layers
    activation: str  # a key of ACTIVATIONS, after each hidden layer
    final_activation: str | None  # a key of ACTIVATIONS on the score, or none
    mix_dropout: bool  # whether the mix was trained with dropout, which leaves two buffers in its state dict

    @property
    def features(self) -> int:
        """How many vectors of the encoder's width the head reads: six sentence features, or one embedding."""
        return 6 if self.kind == "regression" else 1


def sparsemax(x: Tensor) -> Tensor:
    """The Euclidean projection of the vector ``x`` onto the probability simplex (Martins and Astudillo, 2016):
    like softmax it sums to one, unlike softmax it gives weights of exactly zero to the smallest values."""
    ordered = x.sort(descending=True).values
    cumulative = ordered.cumsum(0) - 1
    ranks = torch.arange(1, x.numel() + 1, dtype=x.dtype, device=x.device)
    support = int((ranks * ordered > cumulative).sum())
    threshold = cumulative[support - 1] / support
    return (x - threshold).clamp(min=0)


class LayerMix(nn.Module):
    """gamma * sum_k w_k * layer_k over the encoder's hidden states, w the softmax or sparsemax of learned scalars."""

    def __init__(self, layers: int, config: CometConfig) -> None:
        super().__init__()
        self.scalar_parameters = nn.ParameterList([nn.Parameter(torch.zeros(1)) for _ in range(layers)])
        self.gamma = nn.Parameter(torch.ones(1))
        self.sparsemax, self.layer_norm = config.sparsemax, config.layer_norm
        if config.mix_dropout:  # training-time state only; kept so that the checkpoint's state dict matches
            self.register_buffer("dropout_mask", torch.zeros(layers))
            self.register_buffer("dropout_fill", torch.zeros(layers))

    def weights(self) -> Tensor:
        scalars = torch.cat(list(self.scalar_parameters)).float()
        return sparsemax(scalars) if self.sparsemax else torch.softmax(scalars, dim=0)

    def forward(self, layers: list[Tensor], mask: Tensor) -> Tensor:
        """layers: (B, T, H) each, float32, as many as have a weight (the rest weigh zero) -> (B, T, H)."""
        weights = self.weights()
        mixed = torch.zeros_like(layers[0])
        for weight, hidden in zip(weights.tolist(), layers, strict=False):
            if weight != 0.0:
                mixed.add_(normalised(hidden, mask) if self.layer_norm else hidden, alpha=weight)
        return mixed * self.gamma.float()


def normalised(hidden: Tensor, mask: Tensor) -> Tensor:
    """Each sentence's (T, H) states shifted and scaled by the mean and variance over its tokens' values."""
    keep = mask.unsqueeze(-1).to(hidden.dtype)
    count = mask.sum(1).to(hidden.dtype).view(-1, 1, 1) * hidden.size(-1)
    mean = (hidden * keep).sum((1, 2), keepdim=True) / count
    variance = (((hidden * keep - mean) * keep) ** 2).sum((1, 2), keepdim=True) / count
    return (hidden - mean) / torch.sqrt(variance + LAYER_NORM_EPS)


def pooled(pool: str, ids: Tensor, states: Tensor, mask: Tensor, pad_id: int) -> Tensor:
    """(B, T, H) -> (B, H): the mean over a sentence's tokens, their maximum, or the first token's state.
    Tokens equal to ``pad_id`` count as padding, as unbabel-comet counts them."""
    if pool == "cls":
        return states[:, 0]
    padding = ids.eq(pad_id).unsqueeze(-1)
    if pool == "max":
        return states.masked_fill(padding, float("-inf")).amax(1)
    return states.masked_fill(padding, 0.0).sum(1) / mask.sum(1, keepdim=True).to(states.dtype)


class Estimator(nn.Module):
    """The head: linear layers with an activation after each hidden one, one score out. Dropout stays in the
    sequence (inactive in evaluation) so that the layers keep unbabel-comet's indices in ``ff``."""

    def __init__(self, features: int, config: CometConfig) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for width in config.hidden_sizes:
            layers += [nn.Linear(features, width), ACTIVATIONS[config.activation](), nn.Dropout(0.0)]
            features = width
        layers.append(nn.Linear(features, 1))
        if config.final_activation is not None:
            layers.append(ACTIVATIONS[config.final_activation]())
        self.ff = nn.Sequential(*layers)

    def forward(self, features: Tensor) -> Tensor:
        return self.ff(features).view(-1)


class XLMREncoder(nn.Module):
    """transformers' XLM-R model (no pooler) as ``model``, answering every hidden state up to the last one used."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor, mask: Tensor) -> list[Tensor]:
        """(B, T) -> the embeddings and each kept layer's output, (B, T, H) each, in float32."""
        out = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        return [hidden.float() for hidden in out.hidden_states]

    def keep_layers(self, count: int) -> None:
        """Runs only the first ``count`` layers from now on (those above weigh nothing in the score), and one at
        least: transformers 5 gathers the hidden states from its layers' calls, and with none gives none, the
        embeddings' included."""
        self.model.encoder.layer = self.model.encoder.layer[: max(count, 1)]


class CometNetwork(nn.Module):
    """The encoder, the layer mix (or one chosen layer) and the head of either kind."""

    def __init__(self, encoder: nn.Module, layers: int, config: CometConfig, pad_id: int) -> None:
        """``encoder``: an XLM-R model of ``layers`` layers (``layers + 1`` hidden states)."""
        super().__init__()
        self.config, self.pad_id = config, pad_id
        self.encoder = XLMREncoder(encoder)
        self.layerwise_attention = LayerMix(layers + 1, config) if config.layer is None else None
        self.estimator = Estimator(config.features * encoder.config.hidden_size, config)

    def layers_used(self) -> int:
        """How many encoder layers the score depends on: up to the chosen layer, or the highest weighted one."""
        if self.config.kind == "regression" and self.config.pool == "default":
            return len(self.encoder.model.encoder.layer)
        if self.layerwise_attention is None:
            return self.config.layer
        return int(self.layerwise_attention.weights().nonzero().max())

    def embedded(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, T) -> (B, T, H): the mix of the hidden states, or the chosen one, in float32."""
        layers = self.encoder(ids, mask)
        if self.layerwise_attention is None:
            return layers[self.config.layer]
        return self.layerwise_attention(layers, mask)

    def sentence_embeddings(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, T) -> (B, H): COMET's embedding of each sentence, encoded on its own."""
        if self.config.pool == "default":
            return self.encoder(ids, mask)[-1][:, 0]
        return pooled(self.config.pool, ids, self.embedded(ids, mask), mask, self.pad_id)

    def compared(self, mt: Tensor, ref: Tensor, src: Tensor) -> Tensor:
        """COMET's scores of translations from their sentence embeddings and their reference's and source's, (N, H)
        each -> (N,)."""
        features = (mt, ref, mt * ref, (mt - ref).abs(), mt * src, (mt - src).abs())
        return self.estimator(torch.cat(features, dim=1))

    def joint_scores(self, ids: Tensor, mask: Tensor) -> Tensor:
        """CometKiwi's scores of joint sequences (B, T) -> (B,): the head over the mixed first token."""
        return self.estimator(self.embedded(ids, mask)[:, 0])
