"""The Python code blocks of docs/python.md and README.md run as written, each in a process of
its own, against a daemon with the built-in default config. Blocks fenced ```py instead of
```python are sketches that need what that daemon has not (a Python pool and its module, a
GPU, the reader's own model): they are not run here; python/tests/test_python_ops.py and the
seed-pattern examples (examples/python/patterns) run the same calls for real."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

import gpuq.testing

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = [REPO / "docs" / "python.md", REPO / "README.md"]


def blocks():
    for doc in DOCS:
        text = doc.read_text()
        for i, m in enumerate(re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)):
            line = text[:m.start()].count("\n") + 1
            yield pytest.param(m.group(1), id=f"{doc.name}:{line}")


@pytest.fixture(scope="module")
def default_daemon():
    with gpuq.testing.Daemon() as d:
        yield d


@pytest.mark.parametrize("code", list(blocks()))
def test_doc_block_runs(default_daemon, code, tmp_path):
    r = subprocess.run([sys.executable, "-c", code], env=default_daemon.env(),
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, f"exited {r.returncode}\n{code}\n{r.stdout}\n{r.stderr}"
