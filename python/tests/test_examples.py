"""Every script of examples/python runs, as written, against a daemon with the built-in
default config (what `gpuqd` runs with no config), and exits 0."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

import gpuq.testing

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples" / "python").glob(
    "*.py"))


@pytest.fixture(scope="module")
def default_daemon():
    with gpuq.testing.Daemon() as d:
        yield d


def test_there_are_examples():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_runs(default_daemon, script):
    r = subprocess.run([sys.executable, str(script)], env=default_daemon.env(),
                       capture_output=True, text=True, timeout=300, cwd=script.parent)
    assert r.returncode == 0, f"{script.name} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
