"""Bounds on what a config (one in a checkpoint header too) can make mtkit build, each with the reason for it.

A section names the bounds its checks compare keys with in its ``bounds``; ``docs/config.md`` lists them
there, with the reasons below.
"""

MAX_POSITIONS = 65_536
MAX_LAYERS = 1_000
MAX_BEAM = 1_000
MAX_BATCH_TOKENS = 1 << 20
MAX_PREFETCH = 16
MAX_PAD_MULTIPLE = 256
MAX_LENPEN = 10.0
MIN_TEMPERATURE = 1e-30
MAX_TEMPERATURE = 1e30
MAX_CORPORA = 256
MAX_LANGUAGES = 1_024
MAX_TEACHERS = 16
MAX_PER_SOURCE = 1_000

REASONS: dict[str, str] = {
    "MAX_POSITIONS": (
        "Position tables are computed, not stored, so a header's max_positions is not checked by the weights it "
        "comes with."
    ),
    "MAX_LAYERS": "per stack",
    "MAX_BEAM": (
        "Hypotheses per sentence (a beam, or n-best translations) that a setting may ask for, wherever it comes "
        "from (a flag, a config, a checkpoint header, an export's mtkit.json): 64 lines at beam 1,000 stay in "
        "bounded memory."
    ),
    "MAX_BATCH_TOKENS": (
        "Padded tokens in one batch, and so sentences in it: per side in training, source tokens times the beam "
        "in decoding (25 times decoding's default)."
    ),
    "MAX_PREFETCH": (
        "Updates whose batches are held made ahead of training (each train.accum batches of train.batch_tokens "
        "per side)."
    ),
    "MAX_PAD_MULTIPLE": (
        "Padded lengths rounded up to a multiple of at most this (a longer one pads short batches to no use)."
    ),
    "MAX_LENPEN": "A length penalty's alpha is useful from 0.6 to 2; at 10, 65,536 ** alpha still fits a float.",
    "MIN_TEMPERATURE": (
        "A sampling temperature T divides float32 log-probabilities, which CUDA computes as a product with 1 / T: "
        "both T and 1 / T must be float32 numbers (3.4e38 at most), or the draw's weights are NaN. At "
        "MIN_TEMPERATURE each draw is the greedy token, at MAX_TEMPERATURE every allowed token is equally likely."
    ),
    "MAX_TEMPERATURE": "The other end of MIN_TEMPERATURE's range: 1 / T must be a float32 number too.",
    "MAX_CORPORA": "corpora in data.corpora: each is a token store held open and a share of the batches",
    "MAX_LANGUAGES": (
        "languages in data.languages: each is a token of the model's vocabulary (NLLB-200 names 202, M2M100 100)"
    ),
    "MAX_TEACHERS": "models in a teacher ensemble: each is held in memory and run at every decoding step",
    "MAX_PER_SOURCE": "shortlist candidates per source token, at most: bounds what a shortlist file may allocate",
}
