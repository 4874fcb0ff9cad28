"""``gpuq serve`` / ``python -m gpuq serve`` (gpuq/_serve.py, docs/python.md "gpuq serve"): the
config it writes, the arguments it refuses, and a real daemon it starts, serves from and drains
on Ctrl-C (SIGINT)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
OPS_DIR = str(HERE / "pyops")
SCRIPTS = pathlib.Path(sys.executable).parent


def serve_cmd(*args):
    return [sys.executable, "-m", "gpuq", "serve", *args]


def run(*args, **kw):
    return subprocess.run(serve_cmd(*args), capture_output=True, text=True, timeout=60, **kw)


def test_print_config_cpu_pool(tmp_path):
    r = run("pyops_serve", "--gpus", "none", "--workers", "2", "--path", OPS_DIR,
            "--print-config", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"pools": [{
        "name": "default", "kind": "cpu", "workers": 2,
        "python": {"interpreter": sys.executable, "modules": ["pyops_serve"],
                   "path": [OPS_DIR, str(tmp_path)]}}]}


def test_print_config_gpu_pool(tmp_path):
    r = run("app.ops", "more", "--gpus", "0,GPU-0b7e1c3a", "--workers", "2", "--spares", "1",
            "--allow-callables", "--pool", "models", "--print-config", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"pools": [{
        "name": "models", "kind": "gpu", "gpus": [0, "GPU-0b7e1c3a"], "workers_per_gpu": 2,
        "spare_workers": 1,
        "python": {"interpreter": sys.executable, "modules": ["app.ops", "more"],
                   "path": [str(tmp_path)], "allow_callables": True}}]}


def test_the_printed_config_is_one_gpuqd_accepts(tmp_path):
    r = run("pyops_serve", "--gpus", "none", "--workers", "1", "--path", OPS_DIR,
            "--print-config")
    path = tmp_path / "gpuqd.json"
    path.write_text(r.stdout)
    check = subprocess.run([gpuq.testing.find_gpuqd(), "--config", str(path), "--check-config"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "pool default" in check.stdout


@pytest.mark.parametrize("args,message", [
    (["m", "--gpus", "two"], "neither a GPU index"),
    (["m", "--gpus", "0,,1"], "comma-separated list"),
    (["m", "--workers", "0"], "--workers 0"),
    (["m", "--gpus", "none", "--workers", "2000"], "--workers 2000"),
    (["m", "--spares", "65"], "--spares 65"),
    ([], "name at least one module"),
    (["app/ops.py"], "not a module name"),
    (["m", "--path", "/nonexistent-gpuq-dir"], "not a directory"),
    (["m", "--pool", "Models"], "--pool 'Models'"),
    (["m", "--start-timeout", "0"], "--start-timeout"),
])
def test_bad_arguments_are_refused_with_what_to_do(args, message):
    r = run(*args, "--print-config")
    assert r.returncode == 2
    assert message in r.stderr, r.stderr


def test_gpuq_command_help_and_unknown_command():
    r = subprocess.run([sys.executable, "-m", "gpuq"], capture_output=True, text=True)
    assert r.returncode == 2 and "serve MODULE" in r.stdout
    r = subprocess.run([sys.executable, "-m", "gpuq", "frobnicate"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "unknown command 'frobnicate'" in r.stderr
    script = SCRIPTS / "gpuq"
    if not script.exists():
        pytest.skip(f"no console script {script} (gpuq not installed by pip)")
    r = subprocess.run([str(script), "version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"gpuq {gpuq.__version__}"


def start_serve(tmp_path, *args):
    runtime_dir = str(tmp_path / "run")
    env = dict(os.environ, GPUQ_GPUQD=gpuq.testing.find_gpuqd())
    proc = subprocess.Popen(serve_cmd(*args, "--runtime-dir", runtime_dir), cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, runtime_dir


def test_serve_starts_serves_and_drains_on_ctrl_c(tmp_path):
    proc, runtime_dir = start_serve(tmp_path, "pyops_serve", "--gpus", "none", "--workers", "1",
                                    "--path", OPS_DIR)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C drains" in line:
                break
        text = "".join(out)
        assert "pool default: 1 of 1 workers ready on the CPUs" in text, text
        assert "ops: triple, nap\n" in text, text  # in the module's order
        assert f"listening in {runtime_dir}" in text, text
        with gpuq.connect(runtime_dir) as c:
            np.testing.assert_array_equal(c.call("triple", np.arange(4)), np.arange(4) * 3)
            running = c.submit_call("nap", 1.0)
            time.sleep(0.3)  # started: the one worker runs it
            proc.send_signal(signal.SIGINT)  # what Ctrl-C sends this command
            assert running.result(timeout=30) == 1.0  # the drain lets it finish
        assert proc.wait(timeout=60) == 0
        assert "draining" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_fails_naming_a_module_that_does_not_import(tmp_path):
    proc, _ = start_serve(tmp_path, "pyops_import_error", "--gpus", "none", "--workers", "1",
                          "--path", OPS_DIR)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "pool default is unavailable" in err, err
    assert "this module fails to import on purpose" in err, err
    assert "Ctrl-C drains" not in out


@pytest.mark.gpu
def test_serve_runs_a_torch_op_on_every_gpu(tmp_path):
    """The README's first path on a GPU machine: gpuq serve with --gpus all, a torch op on cuda.
    Skipped without torch or a CUDA device (scripts/device_check.sh runs it on one)."""
    torch = pytest.importorskip("torch", reason="no torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    proc, runtime_dir = start_serve(tmp_path, "pyops_serve_gpu", "--gpus", "all", "--path",
                                    OPS_DIR)
    try:
        out = []
        for line in proc.stdout:
            out.append(line)
            if "Ctrl-C drains" in line:
                break
        text = "".join(out)
        assert "workers ready on GPU" in text, text + proc.stderr.read()
        with gpuq.connect(runtime_dir) as c:
            r = c.call("where_am_i", np.ones(8, np.float32), timeout=120)
        assert r["device"].startswith("cuda") and r["sum"] == 8.0, r
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
