"""Python pools on a GPU (pytest marker and ctest-style label "gpu"): skipped where torch or a
CUDA device is missing, as on CI. scripts/device_check.sh runs them on a lent GPU machine.

The same op on a gpu Python pool and a cpu one; the worker's device, stream, budget and pinned
segments; a sticky CUDA error that replaces only its worker; the memory budget."""

from __future__ import annotations

import pathlib
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

torch = pytest.importorskip("torch", reason="no torch: the gpu Python pool tests need it")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu
OPS_DIR = str(pathlib.Path(__file__).resolve().parent / "pyops")
BUDGET = 256 << 20


def _pool(name, kind, **extra):
    p = {"name": name, "kind": kind,
         "python": {"interpreter": sys.executable, "modules": ["pyops_gpu"], "path": [OPS_DIR]}}
    p.update(extra)
    return p


@pytest.fixture(scope="module")
def gd():
    cfg = {"pools": [_pool("pycpu", "cpu", workers=1),
                     _pool("pygpu", "gpu", gpus=[0], workers_per_gpu=2, memory_limit=BUDGET)],
           "restart_backoff_initial_ms": 10}
    with gpuq.testing.Daemon(cfg, start_timeout=180) as d:
        yield d


@pytest.fixture
def gc(gd):
    with gpuq.connect(gd.runtime_dir) as c:
        yield c


def _pool_status(d, name):
    return next(p for p in d.status()["pools"] if p["name"] == name)


def test_same_op_on_gpu_and_cpu(gc):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32), dtype=np.float32)
    b = rng.standard_normal((32, 16), dtype=np.float32)
    on_gpu = gc.call("gpu_matmul", a, b, pool="pygpu")
    on_cpu = gc.call("gpu_matmul", a, b, pool="pycpu")
    np.testing.assert_allclose(on_gpu, on_cpu, rtol=1e-4, atol=1e-4)
    assert gc.call("gpu_info", pool="pycpu") == {"gpu": False}


def test_device_stream_and_pinned_segment(gc):
    info = gc.call("gpu_info", pool="pygpu")
    assert info["gpu"] and info["devices"] == 1 and info["device"] == 0
    assert info["stream"] == info["worker_stream"] != info["default_stream"]
    pinned = gc.call("gpu_pinned_copy", gc.array(np.ones(1024, np.float32)), pool="pygpu")
    assert isinstance(pinned, np.bool_) and pinned  # a scalar comes back as a numpy scalar


def test_memory_budget(gc):
    # The pool's budget on its GPU is shared by its two workers: BUDGET / 2 each.
    assert gc.call("gpu_alloc", BUDGET // 4, pool="pygpu") == BUDGET // 4
    with pytest.raises(gpuq.OutOfMemory):
        gc.call("gpu_alloc", BUDGET * 3 // 4, pool="pygpu")
    with pytest.raises(gpuq.OutOfMemory, match="^gpu_alloc: OutOfMemoryError: CUDA out of "
                                               "memory"):
        gc.call("gpu_alloc", 2 * BUDGET, pool="pygpu")
    assert gc.call("gpu_alloc", BUDGET // 4, pool="pygpu") == BUDGET // 4  # serves on


def test_sticky_error_replaces_only_its_worker(gc, gd):
    before = {w["id"]: (w["pid"], w["restarts"]) for w in _pool_status(gd, "pygpu")["workers"]}
    with pytest.raises(gpuq.OpFailed):
        gc.call("gpu_sticky_error", pool="pygpu")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = _pool_status(gd, "pygpu")
        after = {w["id"]: (w["pid"], w["restarts"]) for w in st["workers"]}
        if st["status"] == "ready" and sum(r for _, r in after.values()) == \
                sum(r for _, r in before.values()) + 1:
            break
        time.sleep(0.1)
    replaced = [w for w in after if after[w][0] != before[w][0]]
    assert len(replaced) == 1, (before, after)
    a = np.ones((8, 8), np.float32)
    np.testing.assert_allclose(gc.call("gpu_matmul", a, a, pool="pygpu"), a @ a)
