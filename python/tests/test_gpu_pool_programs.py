"""A gpu Python pool needs no gpuq-gpu-worker; a C++ gpu pool does, and says so (issue 38).

gpuqd and gpuq-worker copied to a folder of their own without gpuq-gpu-worker (as a build without
CUDA, or a pip install without the gpu extra, has them), a fake GPU (a /proc + /sys tree read
under the test hook GPUQ_TEST_GPU_ROOT) and the hook GPUQ_TEST_GPU_WORKER=real, under which each
gpu pool runs what it would run on a real GPU (docs/service.md, "Test hooks"): the Python pool its
interpreter with --gpu (and its share of the pool's memory budget), which answers a numpy op
(no framework is imported, so no CUDA is touched); the C++ pool gpuq-gpu-worker, which is
missing: unavailable, with where gpuqd looked and how to install it, in the status and in
`gpuqd --check-config`."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

import gpuq
import gpuq.testing

OPS_DIR = str(pathlib.Path(__file__).resolve().parent / "pyops")
UUID = "GPU-0b7e1c3a-5d2f-4a61-9c8e-2f4b6d8a0c1e"
BUS = "0000:3b:00.0"
NEEDS = "a C++ gpu pool needs gpuq-gpu-worker, which is not installed"


def _fake_gpu_tree(root: pathlib.Path) -> None:
    info = root / "proc/driver/nvidia/gpus" / BUS
    info.mkdir(parents=True)
    (info / "information").write_text(
        f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {UUID}\nBus Location: \t {BUS}\n"
        "GPU Excluded:\t No\n")


@pytest.fixture
def bare_gpuqd(tmp_path, monkeypatch):
    """A copy of gpuqd with gpuq-worker beside it and no gpuq-gpu-worker, and the hooks set."""
    gpuqd = pathlib.Path(gpuq.testing.find_gpuqd())
    worker = gpuqd.parent / "gpuq-worker"
    if not worker.exists():
        pytest.skip(f"no gpuq-worker beside {gpuqd} to copy")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for f in (gpuqd, worker):
        shutil.copy2(f, bin_dir / f.name)
    if subprocess.run([str(bin_dir / "gpuqd"), "--version"], capture_output=True).returncode:
        pytest.skip(f"a copy of {gpuqd} does not run from elsewhere")
    _fake_gpu_tree(tmp_path / "gpus")
    monkeypatch.setenv("GPUQ_TEST_HOOKS", "1")
    monkeypatch.setenv("GPUQ_TEST_GPU_ROOT", str(tmp_path / "gpus"))
    monkeypatch.setenv("GPUQ_TEST_GPU_WORKER", "real")
    return bin_dir


CONFIG = {"pools": [
    {"name": "pygpu", "kind": "gpu", "workers_per_gpu": 2, "spare_workers": 1, "python": {
        "interpreter": sys.executable, "modules": ["pyops_mod"], "path": [OPS_DIR]}},
    {"name": "cxxgpu", "kind": "gpu"}]}


def test_python_gpu_pool_serves_without_gpuq_gpu_worker(bare_gpuqd):
    with gpuq.testing.Daemon(CONFIG, gpuqd=str(bare_gpuqd / "gpuqd")) as d:
        pools = {p["name"]: p for p in d.status()["pools"]}
        assert pools["pygpu"]["status"] == "ready", pools["pygpu"]
        assert pools["pygpu"]["gpus"][0]["uuid"] == UUID
        assert pools["cxxgpu"]["status"] == "unavailable"
        reason = pools["cxxgpu"]["reason"]
        assert NEEDS in reason and str(bare_gpuqd) in reason and "gpuq[gpu]" in reason, reason
        with gpuq.connect(d.runtime_dir) as c:
            np.testing.assert_array_equal(c.call("double", np.arange(4.0), pool="pygpu"),
                                          np.arange(4.0) * 2)
            with pytest.raises(gpuq.NoDevice, match="gpuq-gpu-worker"):
                c.submit("noop", pool="cxxgpu")
        # Its workers (the spare too) run the interpreter with --gpu, on the fake GPU, each with
        # a third of the pool's default budget there (0.9: the unavailable pool takes none).
        workers = pools["pygpu"]["workers"]
        assert len(workers) == 3
        for w in workers:
            argv = pathlib.Path(f"/proc/{w['pid']}/cmdline").read_bytes().split(b"\0")
            assert argv[0] == sys.executable.encode() and b"--gpu" in argv, argv
            share = float(argv[argv.index(b"--memory-limit-fraction") + 1])
            assert share == pytest.approx(0.3), argv


def test_check_config_says_the_same(bare_gpuqd, tmp_path):
    path = tmp_path / "gpuqd.json"
    path.write_text(json.dumps(CONFIG))
    r = subprocess.run([str(bare_gpuqd / "gpuqd"), "--check-config", "--config", str(path)],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.split(":")[0]: line for line in r.stdout.splitlines()}
    assert "unavailable" not in lines["pool pygpu"], r.stdout
    assert NEEDS in lines["pool cxxgpu"] and str(bare_gpuqd) in lines["pool cxxgpu"], r.stdout
