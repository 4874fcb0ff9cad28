"""Every script of examples/python runs, as written, against a daemon with the built-in
default config (what `gpuqd` runs with no config), and exits 0.

The pattern examples of examples/python/patterns run against a daemon with the Python pools
of their sample config, gpuqd-patterns.json, whose paths are this checkout's and whose
interpreter is this test's: each once with its default pool ("patterns-gpu": on a machine
without a GPU, its jobs go to the cpu Python pool "patterns") and once with
$GPUQ_PATTERNS_POOL naming the cpu Python pool. With GPUQ_TEST_REQUIRE_GPU=1 (the `patterns`
stage of scripts/device_check.sh, on a GPU machine with torch) the default-pool runs must show
that they ran on "patterns-gpu" itself, with the model on a cuda device, not on its fallback."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import gpuq.testing

EXAMPLES = sorted((pathlib.Path(__file__).resolve().parents[2] / "examples" / "python").glob(
    "*.py"))
REPO = pathlib.Path(__file__).resolve().parents[2]
PATTERNS_DIR = REPO / "examples" / "python" / "patterns"
PATTERN_OPS = "pattern_ops"  # the pools' module, not an example
# The TensorFlow ones (tf_*.py, their own config) need TensorFlow: test_tensorflow.py runs them.
PATTERNS = sorted(p for p in PATTERNS_DIR.glob("*.py")
                  if p.stem != PATTERN_OPS and not p.stem.startswith("tf_"))


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


# ---- examples/python/patterns ---------------------------------------------------------------


def patterns_config():
    """gpuqd-patterns.json with its Python pools pointed at this checkout and interpreter."""
    cfg = json.loads((PATTERNS_DIR / "gpuqd-patterns.json").read_text())
    python_pools = [p for p in cfg["pools"] if "python" in p]
    assert {p["name"] for p in python_pools} == {"patterns", "patterns-gpu"}
    for pool in python_pools:
        pool["python"].update(interpreter=sys.executable, path=[str(PATTERNS_DIR)],
                              modules=[PATTERN_OPS], allow_callables=True)
        if pool.get("kind", "cpu") == "cpu":
            pool["workers"] = 2
    return cfg


@pytest.fixture(scope="module")
def patterns_daemon():
    with gpuq.testing.Daemon(patterns_config()) as d:
        yield d


def test_there_are_patterns_each_with_its_page():
    assert [p.stem for p in PATTERNS] == ["fork_pool", "joblib_torch", "shared_gpu",
                                          "shared_gpu_batched", "textgen_executor"]
    for p in PATTERNS:
        page = REPO / "docs" / "python" / "patterns" / f"{p.stem}.md"
        assert page.is_file(), f"{p.name} has no page {page.relative_to(REPO)}"
        assert str(page.relative_to(REPO)) in p.read_text(), f"{p.name} does not name its page"


@pytest.mark.parametrize("pool", [None, "patterns"], ids=["default-pool", "env-patterns"])
@pytest.mark.parametrize("script", PATTERNS, ids=[p.name for p in PATTERNS])
def test_pattern_runs(patterns_daemon, script, pool):
    env = patterns_daemon.env()
    env.pop("GPUQ_PATTERNS_POOL", None)
    if pool is not None:
        env["GPUQ_PATTERNS_POOL"] = pool
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=script.parent)
    assert r.returncode == 0, f"{script.name} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.rstrip().endswith("ok"), r.stdout
    want = pool or "patterns-gpu"
    assert f"pool {want!r}" in r.stdout, r.stdout
    if pool is None and os.environ.get("GPUQ_TEST_REQUIRE_GPU") == "1":
        assert "cuda" in r.stdout, f"{script.name}: the model is not on a cuda device\n{r.stdout}"
        if script.stem != "fork_pool":  # it prints only the model's device
            assert ("runs on 'patterns-gpu'" in r.stdout or "of 'patterns-gpu')" in r.stdout), \
                f"{script.name} did not run on the gpu pool itself\n{r.stdout}"
    print(r.stdout)
