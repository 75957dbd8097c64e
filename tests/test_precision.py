"""Precision ``auto``: what it chooses on each kind of machine (a function of the device's features, so every kind
is tested on any machine), the warning for an emulated bf16, and where the choice is reported."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from helpers import invoke

import mtkit
from mtkit import runtime
from mtkit.runtime import (
    RuntimeSetupError,
    bf16_decoding_gemm,
    choose_precision,
    fp32_vocabulary_gemm,
    read_cpu_features,
)

# /proc/cpuinfo flags of the CPU kinds mtkit runs on, trimmed to those that matter here.
AMD_EPYC_ZEN4 = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"}
INTEL_ICE_LAKE = {"avx2", "fma", "avx512f", "avx512_vnni"}  # AVX-512 with VNNI, no bf16
INTEL_SAPPHIRE_RAPIDS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
AVX2_ONLY = {"avx2", "fma"}
NO_CPUINFO = set()  # macOS, Windows: no flags to read

# /proc/cpuinfo of 64-bit Arm CPUs (one core's lines, as Linux writes them): their features are ``Features``.
GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""
X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16
"""


H200, A100, T4, V100 = (9, 0), (8, 0), (7, 5), (7, 0)  # CUDA compute capabilities


@pytest.mark.parametrize(
    "device, features, gpu, asked, chosen, native",
    [
        ("cpu", AMD_EPYC_ZEN4, None, "auto", "bf16", True),
        ("cpu", INTEL_SAPPHIRE_RAPIDS, None, "auto", "bf16", True),
        ("cpu", INTEL_ICE_LAKE, None, "auto", "fp32", True),
        ("cpu", AVX2_ONLY, None, "auto", "fp32", True),
        ("cpu", NO_CPUINFO, None, "auto", "fp32", True),
        ("cpu", INTEL_ICE_LAKE, None, "bf16", "bf16", False),  # asked for: it runs, emulated, with a warning
        ("cpu", AVX2_ONLY, None, "bf16", "bf16", False),
        ("cpu", AMD_EPYC_ZEN4, None, "bf16", "bf16", True),
        ("cpu", NO_CPUINFO, None, "bf16", "bf16", True),  # unknown: not warned about
        ("cpu", AMD_EPYC_ZEN4, None, "fp32", "fp32", True),
        ("cuda", INTEL_ICE_LAKE, H200, "auto", "bf16", True),  # the GPU decides, not the host CPU
        ("cuda", AMD_EPYC_ZEN4, A100, "auto", "bf16", True),
        ("cuda", AMD_EPYC_ZEN4, T4, "auto", "fp32", True),  # no bf16 units before Ampere: fp32, never fp16
        ("cuda", AMD_EPYC_ZEN4, V100, "bf16", "bf16", False),
        ("cuda", AMD_EPYC_ZEN4, V100, "fp16", "fp16", True),
        ("cuda", INTEL_ICE_LAKE, H200, "fp32", "fp32", True),
    ],
)
def test_auto_is_bf16_only_where_the_device_computes_it_natively(device, features, gpu, asked, chosen, native):
    choice = choose_precision(asked, device, set(features), gpu)
    assert (choice.precision, choice.native) == (chosen, native)
    assert choice.reason.startswith("auto: " if asked == "auto" else "asked for")


def test_the_reason_names_the_feature_found_or_missing():
    assert choose_precision("auto", "cpu", AMD_EPYC_ZEN4).reason == "auto: this CPU has AVX512-BF16"
    both = choose_precision("auto", "cpu", INTEL_SAPPHIRE_RAPIDS).reason
    assert both == "auto: this CPU has AVX512-BF16 and AMX-BF16"
    missing = choose_precision("auto", "cpu", INTEL_ICE_LAKE).reason
    assert missing == "auto: this CPU has no AVX512-BF16 or AMX-BF16, so bf16 would be emulated"
    assert "/proc/cpuinfo" in choose_precision("auto", "cpu", NO_CPUINFO).reason
    assert "emulated" in choose_precision("bf16", "cpu", INTEL_ICE_LAKE).reason
    assert choose_precision("auto", "cuda", AMD_EPYC_ZEN4, T4).reason == (
        "auto: this GPU (compute capability 7.5) has no bf16 units"
    )


@pytest.mark.parametrize(
    "cpuinfo, has, lacks",
    [(X86_CPUINFO, "avx512_bf16", "bf16"), (GRAVITON3, "bf16", "avx512_bf16"), (GRAVITON2, "asimd", "bf16")],
)
def test_cpu_features_are_read_from_x86_flags_and_arm_features(tmp_path, cpuinfo, has, lacks):
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    features = read_cpu_features(str(tmp_path / "cpuinfo"))
    assert has in features and lacks not in features
    assert read_cpu_features(str(tmp_path / "missing")) == frozenset()


def test_on_arm_bf16_is_native_with_the_bf16_feature_and_the_reason_says_so(tmp_path):
    (tmp_path / "graviton3").write_text(GRAVITON3)
    (tmp_path / "graviton2").write_text(GRAVITON2)
    graviton3 = read_cpu_features(str(tmp_path / "graviton3"))
    graviton2 = read_cpu_features(str(tmp_path / "graviton2"))
    assert choose_precision("auto", "cpu", graviton3) == runtime.PrecisionChoice("bf16", "auto: this CPU has Arm BF16")
    assert choose_precision("bf16", "cpu", graviton3) == runtime.PrecisionChoice("bf16", "asked for")
    assert choose_precision("auto", "cpu", graviton2) == runtime.PrecisionChoice(
        "fp32", "auto: this CPU has no Arm BF16, so bf16 would be emulated"
    )
    emulated = choose_precision("bf16", "cpu", graviton2)
    assert (emulated.reason, emulated.native) == ("asked for; emulated, as this CPU has no Arm BF16", False)
    assert choose_precision("auto", "cpu", NO_CPUINFO).reason == (
        "auto: no CPU feature list (/proc/cpuinfo) to find AVX512-BF16, AMX-BF16 or Arm BF16 in"
    )


def test_fp16_needs_cuda():
    with pytest.raises(RuntimeSetupError, match="fp16 needs a CUDA device"):
        choose_precision("fp16", "cpu", AMD_EPYC_ZEN4)


@pytest.fixture
def cpu(monkeypatch):
    """Make this machine's CPU report the given /proc/cpuinfo flags; warnings given before are forgotten."""
    monkeypatch.setattr(runtime, "_warned", set())

    def set_features(features: set[str]) -> None:
        monkeypatch.setattr(runtime, "cpu_features", lambda: frozenset(features))

    return set_features


def test_an_explicit_bf16_without_native_support_runs_and_warns_once(run_with_decode_settings, cpu, caplog):
    cpu(INTEL_ICE_LAKE)
    with caplog.at_level(logging.WARNING, logger="mtkit"):
        first = mtkit.load(run_with_decode_settings, device="cpu", precision="bf16")
        mtkit.load(run_with_decode_settings, device="cpu", precision="bf16")
    assert first.precision["precision"] == "bf16" and "emulated" in first.precision["reason"]
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no AVX512-BF16 or AMX-BF16" in warning and "slower than fp32" in warning
    assert first.translate(["A dog runs."]) and len(first.translate(["A dog.", "", "Two cats."])) == 3


def test_an_explicit_bf16_on_an_arm_cpu_without_it_is_warned_about(tmp_path, cpu, caplog):
    (tmp_path / "cpuinfo").write_text(GRAVITON2)
    cpu(read_cpu_features(str(tmp_path / "cpuinfo")))
    with caplog.at_level(logging.WARNING, logger="mtkit"):
        choice = runtime.resolve_precision("bf16", torch.device("cpu"))
    assert (choice.precision, choice.native) == ("bf16", False)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "no Arm BF16" in warning and "slower than fp32" in warning


@pytest.mark.parametrize("features, chosen", [(AMD_EPYC_ZEN4, "bf16"), (INTEL_ICE_LAKE, "fp32")])
def test_load_and_translate_default_to_auto(run_with_decode_settings, cpu, features, chosen, caplog):
    cpu(features)
    translator = mtkit.load(run_with_decode_settings, device="cpu")
    assert translator.precision == choose_precision("auto", "cpu", features).to_dict()
    assert translator.precision["precision"] == chosen
    assert next(translator.model.parameters()).dtype == runtime.DTYPES[chosen]
    with caplog.at_level(logging.WARNING, logger="mtkit"):
        assert invoke("translate", run_with_decode_settings, "--device", "cpu", input="A dog runs.\n").exit_code == 0
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]  # auto never warns


@pytest.mark.parametrize("features", [AMD_EPYC_ZEN4, INTEL_ICE_LAKE])
def test_doctor_says_what_auto_picks_and_why(cpu, features, no_cuda):
    cpu(features)
    report = json.loads(invoke("doctor", "--json").stdout)
    choice = choose_precision("auto", "cpu", features)
    assert report["auto_precision"]["cpu"] == choice.to_dict()
    assert report["cpu_bf16_instructions"] == (choice.precision == "bf16")
    [line] = [line for line in invoke("doctor").stdout.splitlines() if line.startswith("precision auto")]
    assert f"cpu: {choice.precision} ({choice.reason.removeprefix('auto: ')})" in line


def test_training_logs_and_records_what_auto_chose(tmp_path, corpus_files, spm_model, cpu, caplog):
    from helpers import small_config

    from mtkit.training.trainer import run_training

    cpu(INTEL_ICE_LAKE)
    with caplog.at_level(logging.INFO, logger="mtkit"):
        run_training(small_config(corpus_files, spm_model, max_steps=1, precision="auto", device="cpu"), tmp_path)
    reason = choose_precision("auto", "cpu", INTEL_ICE_LAKE).reason
    assert any(r.getMessage().startswith(f"precision fp32 ({reason}) on ") for r in caplog.records)
    start = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["step"] == 0 and start["device"] == "cpu"
    assert (start["precision"], start["reason"]) == ("fp32", reason)
    assert start["hardware"].startswith(runtime.cpu_name()) and "no native bf16" in start["hardware"]


def test_the_vocabulary_product_goes_through_onednn_only_on_x86_cpus_not_made_by_intel():
    """MKL, ATen's own, takes a slower path on other vendors' CPUs; where the vendor is unknown, ATen stays."""
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "aten"
    assert fp32_vocabulary_gemm("AuthenticAMD") == onednn and fp32_vocabulary_gemm("HygonGenuine") == onednn
    assert fp32_vocabulary_gemm("GenuineIntel") == "aten" and fp32_vocabulary_gemm(None) == "aten"


def test_bf16_decoding_products_go_through_onednn_only_with_native_bf16_on_cpus_not_made_by_intel():
    """Measured faster on an AMD EPYC with AVX512-BF16; not measured on Intel's CPUs; emulated bf16 keeps ATen."""
    onednn = "onednn" if torch.backends.mkldnn.is_available() else "aten"
    assert bf16_decoding_gemm("AuthenticAMD", {"avx512f", "avx512_bf16"}) == onednn
    assert bf16_decoding_gemm("AuthenticAMD", {"avx2", "avx512f"}) == "aten"
    assert bf16_decoding_gemm("GenuineIntel", {"avx512_bf16", "amx_bf16"}) == "aten"
    assert bf16_decoding_gemm(None, {"avx512_bf16"}) == "aten"
