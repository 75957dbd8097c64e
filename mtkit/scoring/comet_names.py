"""COMET's names, models and limits, without torch: the command line reads them while it parses its options, and
mtkit.scoring.comet checks what it loads against them."""

from __future__ import annotations

import typing
from typing import Literal

COMET_MODELS = {"comet": "Unbabel/wmt22-comet-da", "cometkiwi": "Unbabel/wmt22-cometkiwi-da"}  # -m name -> Hub id
COMET_NAME = "COMET"  # the name a reference-based model's scores carry
COMETKIWI_NAME = "CometKiwi"  # the name a reference-free model's scores carry
SCORE_NAMES = (COMET_NAME, COMETKIWI_NAME)

CometPrecision = Literal["fp32", "bf16", "int8", "auto"]  # the number formats a COMET model scores in
PRECISIONS: tuple[str, ...] = typing.get_args(CometPrecision)
MAX_BATCH_SIZE = 4096  # segments in one forward pass: beyond this only memory grows
