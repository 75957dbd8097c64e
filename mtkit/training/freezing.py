"""Which parameters train: train.freeze holds parts of the model at their values, as fine-tuning often wants.

The parts are told apart by the modules that own the parameters, never by their names:

- ``embeddings``: the source and target token embeddings and learned position embeddings. With tied
  embeddings (model.tie_embeddings or model.tie_output) the output projection is the target embedding
  matrix itself, so freezing the embeddings freezes the output projection too.
- ``encoder``: the encoder's layers and final norm.
- ``decoder``: the decoder's layers and final norm, and the output projection (with its bias) unless it is
  tied to the embeddings.

train.lora holds every part still and trains the adapters on them alone (``adapters_only``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from torch import nn

from mtkit.config import FreezeGroup
from mtkit.model.lora import adapter_parameters
from mtkit.model.transformer import Transformer

log = logging.getLogger("mtkit")


def parts(model: Transformer) -> dict[FreezeGroup, list[nn.Parameter]]:
    """Each part's parameters; together they are every parameter of ``model``, each in one part."""
    embeddings = [*model.encoder.embed.parameters(), *model.decoder.embed.parameters()]
    shared = {id(p) for p in embeddings}
    encoder = [p for p in model.encoder.parameters() if id(p) not in shared]
    decoder = [p for p in [*model.decoder.parameters(), *model.output.parameters()] if id(p) not in shared]
    return {"embeddings": list({id(p): p for p in embeddings}.values()), "encoder": encoder, "decoder": decoder}


def freeze(model: Transformer, frozen: Iterable[FreezeGroup]) -> list[nn.Parameter]:
    """Turn off gradients of the ``frozen`` parts; the parameters left to train, for the optimizer, in the model's
    order (the order an optimizer's saved state is matched by)."""
    frozen = set(frozen)
    for part, parameters in parts(model).items():
        for p in parameters:
            p.requires_grad_(part not in frozen)
    if frozen:
        held = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        log.info("train.freeze: %s held (%s parameters)", ", ".join(sorted(frozen)), f"{held:,}")
    return [p for p in model.parameters() if p.requires_grad]


def adapters_only(model: Transformer) -> list[nn.Parameter]:
    """Turn off the gradients of every parameter but the LoRA adapters'; those, for the optimizer, in the model's
    order."""
    trained = adapter_parameters(model)
    ids = {id(p) for p in trained}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return trained
