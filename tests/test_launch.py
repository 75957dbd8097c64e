"""The mtkit command starts itself under mimalloc (mtkit/launch.py), checked on real processes."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from mtkit import launch

# Where pyproject installs cmeel-mimalloc; elsewhere the command runs under the system's allocator.
MIMALLOC_PLATFORM = sys.platform == "linux" and platform.machine() == "x86_64"
needs_mimalloc = pytest.mark.skipif(not MIMALLOC_PLATFORM, reason="cmeel-mimalloc provides mimalloc on x86-64 Linux")


@needs_mimalloc
def test_the_library_is_found_where_the_dependency_installs_it():
    library = launch.mimalloc_library()
    assert library is not None and library.is_file() and library.name == launch.LIBRARY_NAME


def doctor(**env: str) -> subprocess.CompletedProcess:
    """``python -m mtkit doctor --json`` with ``env`` added to an environment that preloads nothing."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", launch.ALLOCATOR_ENV)}
    return subprocess.run(
        [sys.executable, "-m", "mtkit", "doctor", "--json"], env={**base, **env}, capture_output=True, text=True
    )


@needs_mimalloc
def test_the_command_runs_under_mimalloc_unless_the_system_allocator_is_asked_for():
    assert json.loads(doctor().stdout)["allocator"] == "mimalloc"
    assert json.loads(doctor(MTKIT_ALLOCATOR="mimalloc").stdout)["allocator"] == "mimalloc"
    assert json.loads(doctor(MTKIT_ALLOCATOR="system").stdout)["allocator"] == "system"


@needs_mimalloc
def test_a_preload_the_user_set_is_kept_and_mimalloc_is_added_once():
    library = str(launch.mimalloc_library())
    env = launch.preload_environment({"LD_PRELOAD": "/opt/their.so"})
    assert env["LD_PRELOAD"] == f"{library}:/opt/their.so"
    assert env["MIMALLOC_PURGE_DELAY"] == launch.PURGE_DELAY_MS
    assert launch.preload_environment(env) is None  # the second start runs the CLI, not a third start
    assert launch.preload_environment({"MIMALLOC_PURGE_DELAY": "-1"})["MIMALLOC_PURGE_DELAY"] == "-1"


def test_an_unknown_allocator_is_a_one_line_error():
    done = doctor(MTKIT_ALLOCATOR="jemalloc")
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["error: MTKIT_ALLOCATOR='jemalloc': expected one of mimalloc, system"]


@needs_mimalloc
def test_the_restarted_command_imports_the_installed_mtkit_not_a_folder_in_the_current_directory(tmp_path):
    script = Path(sys.executable).parent / "mtkit"
    if not script.is_file():
        pytest.skip("the mtkit console script is not installed beside this Python")
    (tmp_path / "mtkit").mkdir()
    (tmp_path / "mtkit" / "__init__.py").write_text("raise SystemExit('the wrong mtkit')\n")
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", launch.ALLOCATOR_ENV, "PYTHONPATH")}
    done = subprocess.run([str(script), "doctor", "--json"], cwd=tmp_path, env=base, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["allocator"] == "mimalloc"
