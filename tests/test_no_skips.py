"""The rule .ci/run sets (MTKIT_TESTS_NO_SKIPS=1): a test that is skipped or marked to fail (xfail) fails the session,
unless the machine lacks what it needs (conftest.py's ``MACHINE_SKIPS``), checked on a session of stand-in tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

STAND_INS = {
    "tests/test_cuda.py": """
import pytest
import torch


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu():
    pass


def test_skipped_inside_for_another_reason():
    pytest.skip("no data")
""",
    "tests/test_other.py": """
import pytest


def test_runs():
    pass


def test_skipped_with_a_machines_reason_in_another_file():
    pytest.skip("needs a CUDA device")


@pytest.mark.xfail(reason="a known bug")
def test_marked_to_fail():
    assert False


@pytest.mark.xfail(reason="a known bug")
def test_marked_to_fail_and_passes():
    pass


def test_fails_itself_as_expected():
    pytest.xfail("a known bug")
""",
}


def test_a_skip_or_an_xfail_fails_the_session_unless_the_machine_lacks_what_the_test_needs(tmp_path):
    for name, text in STAND_INS.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {
        **{name: value for name, value in os.environ.items() if not name.startswith("PYTEST_")},  # this session's
        "MTKIT_TESTS_NO_SKIPS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rN", "tests"]
    result = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert " failed" not in result.stdout.splitlines()[-1]  # nothing failed but the rule
    assert sorted(line.strip() for line in result.stdout.splitlines() if line.startswith("  tests/")) == [
        "tests/test_cuda.py::test_skipped_inside_for_another_reason (skipped: no data)",
        "tests/test_other.py::test_fails_itself_as_expected (xfailed)",
        "tests/test_other.py::test_marked_to_fail (xfailed)",
        "tests/test_other.py::test_marked_to_fail_and_passes (xpassed)",
        "tests/test_other.py::test_skipped_with_a_machines_reason_in_another_file (skipped: needs a CUDA device)",
    ]
    assert "5 tests did not run that must (MTKIT_TESTS_NO_SKIPS):" in result.stdout
