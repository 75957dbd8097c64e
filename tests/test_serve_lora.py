"""`mtkit serve --adapter NAME=PATH`: one base model in memory, several LoRA adapters over it, each request
translated (or scored) with the adapter it names, as `mtkit translate --adapter` translates it, whatever requests
for other adapters run beside it."""

from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers import invoke, joint_run, one_line_error
from live_server import serving_in_this_process
from safetensors.torch import save_file

import mtkit
from mtkit.config import LoraConfig, ServeConfig
from mtkit.model import checkpoint, loading, lora
from mtkit.model.adapter_file import adapter_header
from mtkit.serving.adapters import load_adapters
from mtkit.translation.engines import load_translator

CPU = torch.device("cpu")


def write_adapter(path: Path, base: Path, settings: LoraConfig, seed: int) -> Path:
    """An adapter file for the model ``base``: A as training draws it, B random (not zero)."""
    model = loading.load_for_inference(base, CPU).model
    torch.manual_seed(seed)
    lora.add_adapters(model, settings)
    with torch.no_grad():
        for layer in lora.adapted_layers(model).values():
            layer.lora.b.normal_(0.0, 0.1)
    digest = checkpoint.stored_weights_digest(checkpoint.weights_file(loading.resolve(base)))
    tensors = {name: t.detach().contiguous() for name, t in lora.adapter_weights(model).items()}
    save_file(tensors, path, metadata=adapter_header(settings, digest))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory, spm_model) -> Path:
    return joint_run(tmp_path_factory.mktemp("base"), spm_model, seed=1, ending=True)


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, Path]:
    """Two adapters of the base: one on every projection, one on the self-attention's values alone."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "everywhere": write_adapter(root / "a.safetensors", base, LoraConfig(rank=4, targets=("attention", "ffn")), 5),
        "values": write_adapter(root / "b.safetensors", base, LoraConfig(rank=2, alpha=32, targets=("self_v",)), 6),
    }


@contextlib.contextmanager
def serving(base: Path, adapters: dict[str, Path], cfg: ServeConfig):
    """The application as `mtkit serve BASE --adapter NAME=PATH...` sets it up, under uvicorn in a thread; its URL."""
    translator = load_translator(base, device="cpu", precision="fp32")
    served = load_adapters(base, translator, adapters)
    with serving_in_this_process(translator, cfg, name="base", adapters=served) as running:
        yield running.url


def test_concurrent_requests_for_each_adapter_get_what_translate_gives_with_it(base, adapters, corpus_files):
    lines = corpus_files["val.en"].read_text().splitlines()[:24]
    expected = {
        name: mtkit.load(base, device="cpu", precision="fp32", adapter=path).translate(lines)
        for name, path in [(None, None), *adapters.items()]
    }
    assert len({tuple(translations) for translations in expected.values()}) == 3  # each adapter matters

    def ask(request: int) -> bool:
        name = [None, *adapters][request % 3]
        chosen = slice(request % 8, request % 8 + 1 + request % 4)
        body = {"text": lines[chosen], **({"adapter": name} if name else {})}
        with httpx.Client(base_url=url, timeout=120) as client:
            return client.post("/v1/translate", json=body).json() == {"translations": expected[name][chosen]}

    with serving(base, adapters, ServeConfig(max_wait_ms=20, max_batch_size=8)) as url:
        with ThreadPoolExecutor(12) as pool:
            assert all(pool.map(ask, range(36)))
        models = httpx.get(url + "/v1/models").json()["models"][0]["adapters"]
        assert [(m["name"], m["rank"], m["targets"]) for m in models] == [
            ("everywhere", 4, ["attention", "ffn"]),
            ("values", 2, ["self_v"]),
        ]
        unknown = httpx.post(url + "/v1/translate", json={"text": "A dog.", "adapter": "legal"})
        assert unknown.status_code == 422
        assert "no adapter 'legal'; it serves everywhere, values" in unknown.json()["detail"]
        pairs = {"source": lines[:3], "target": expected["values"][:3], "adapter": "values"}
        scores = httpx.post(url + "/v1/score", json=pairs).json()["scores"]
        want = mtkit.load(base, device="cpu", precision="fp32", adapter=adapters["values"])
        assert [s["logprob"] for s in scores] == pytest.approx(
            [s.logprob for s in want.score(lines[:3], expected["values"][:3])], abs=1e-4
        )


def test_an_adapter_of_another_model_or_a_bad_option_stops_the_server_before_it_serves(
    base, adapters, spm_model, tmp_path
):
    other = joint_run(tmp_path, spm_model, seed=9)
    line = one_line_error(
        invoke("serve", other, "--port", 0, "--adapter", f"legal={adapters['values']}"), "adapts another base model"
    )
    assert str(adapters["values"]) in line and str(loading.resolve(other)) in line
    one_line_error(invoke("serve", base, "--adapter", "legal"), "--adapter takes NAME=PATH")
    twice = [f"--adapter=legal={adapters['values']}"] * 2
    one_line_error(invoke("serve", base, *twice), "--adapter gives each NAME once")
    one_line_error(
        invoke("serve", base, "--port", 0, "--precision", "int8", "--adapter", f"legal={adapters['values']}"),
        "int8 quantizes",
    )
