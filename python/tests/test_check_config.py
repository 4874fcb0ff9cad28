"""`gpuqd --check-config` imports each Python pool's modules as the daemon would (issue 38): it
prints each pool's ops, or fails (exit status 2) naming the pool, the module that did not import,
its exception and the end of what the interpreter printed."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import gpuq.testing

OPS_DIR = str(pathlib.Path(__file__).resolve().parent / "pyops")


def _pool(name, *modules):
    return {"name": name, "kind": "cpu", "workers": 1,
            "python": {"interpreter": sys.executable, "modules": list(modules),
                       "path": [OPS_DIR]}}


def check(tmp_path, config):
    path = tmp_path / "gpuqd.json"
    path.write_text(json.dumps(config))
    return subprocess.run([gpuq.testing.find_gpuqd(), "--check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=180)


def test_ops_of_each_python_pool_are_printed(tmp_path):
    r = check(tmp_path, {"pools": [{"name": "cpu", "workers": 1}, _pool("py", "pyops_mod"),
                                   _pool("batch", "pyops_batch")]})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "python_call, double, add" in lines["pool py"], r.stdout
    assert sys.executable in lines["pool py"]
    assert "python_call" in lines["pool batch"]
    assert r.stdout.rstrip().endswith("config OK")


def test_a_module_that_does_not_import_fails_the_check(tmp_path):
    r = check(tmp_path, {"pools": [_pool("py", "pyops_mod"),
                                   _pool("broken", "pyops_mod", "pyops_import_error")]})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "config OK" not in r.stdout
    first = r.stderr.splitlines()[0]
    assert first.startswith("gpuqd: pool broken: python: importing module 'pyops_import_error' "
                            "failed (exit status 1): RuntimeError: this module fails to import "
                            "on purpose"), r.stderr
    # The traceback's end, with the module's file and line.
    assert "pyops_import_error.py" in r.stderr and "  | RuntimeError:" in r.stderr
    assert "pool py: python" in r.stdout  # the good pool is still listed


def test_a_missing_module_is_named(tmp_path):
    r = check(tmp_path, {"pools": [_pool("py", "pyops_mod", "no_such_module_gpuq")]})
    assert r.returncode == 2
    assert ("pool py: python: importing module 'no_such_module_gpuq' failed (exit status 1): "
            "ModuleNotFoundError: No module named 'no_such_module_gpuq'") in r.stderr, r.stderr
