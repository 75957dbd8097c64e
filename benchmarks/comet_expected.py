"""Writes tests/data/comet_expected.json: unbabel-comet's own scores of the test fixture's COMET models, one per
variant (comet_fixture.VARIANTS: each network option mtkit implements).

unbabel-comet cannot be installed beside mtkit, so the parity test compares mtkit against the scores it
computed here once, in fp32 on the CPU, with its own API (load_from_checkpoint, then predict at its command
line's batch size). Run it with the peer environment's python, from anywhere:

    $(bash benchmarks/comet_peer_env.sh) benchmarks/comet_expected.py
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from comet_fixture import HYPOTHESES, REFERENCES, SOURCES, VARIANTS, build_comet  # noqa: E402

BATCH_SIZE = 16  # comet-score's default


def peer_scores(kind: str, options: dict, folder: Path) -> dict:
    """unbabel-comet's segment and system scores of build_comet(folder, kind, seed=0, options=options) on the
    fixture's texts; for the two COMET-22 models themselves (no options), the token ids it encodes too."""
    import comet
    import torch
    import transformers

    build_comet(folder, kind, seed=0, options=options)
    model = comet.load_from_checkpoint(str(folder / "checkpoints" / "model.ckpt"))
    samples = [
        {"src": source, "mt": hypothesis, "ref": reference} if kind == "comet" else {"src": source, "mt": hypothesis}
        for source, hypothesis, reference in zip(SOURCES, HYPOTHESES, REFERENCES)
    ]
    output = model.predict(samples, batch_size=BATCH_SIZE, gpus=0, progress_bar=False)
    inputs = {} if options else {"input_ids": encoder_inputs(model, samples)}
    return {
        "segments": [float(score) for score in output.scores],
        "system": float(output.system_score),
        **inputs,
        "unbabel_comet": comet.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch_size": BATCH_SIZE,
        "precision": "fp32",
    }


def encoder_inputs(model, samples: list[dict]) -> dict[str, list[list[int]]]:
    """The token ids unbabel-comet feeds its encoder, truncated and joined as it does, padding removed."""
    inputs = model.prepare_sample(samples, stage="predict")
    if isinstance(inputs, tuple):  # a unified model: one joined sequence per segment, mt first
        batches = {"+".join(model.hparams.input_segments): inputs[0]}
    else:
        batches = {
            side: {"input_ids": inputs[f"{side}_input_ids"], "attention_mask": inputs[f"{side}_attention_mask"]}
            for side in ("src", "mt", "ref")
        }
    return {
        name: [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        for name, batch in batches.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "tests" / "data" / "comet_expected.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        expected = {
            name: peer_scores(kind, options, Path(scratch) / name) for name, (kind, options) in VARIANTS.items()
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(expected, indent=1) + "\n", encoding="utf-8")
    for kind, result in expected.items():
        print(f"{kind}: system {result['system']:.6f} over {len(result['segments'])} segments")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
