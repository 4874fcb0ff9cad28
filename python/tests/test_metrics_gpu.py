"""Metrics of a gpu pool (pytest marker "gpu"): a GPU worker's device memory and budget, and
NVML's per-GPU figures from gpuqd's sampler child (docs/metrics.md). Skipped where there is no
NVIDIA driver or no gpuq-gpu-worker, as on CI; scripts/device_check.sh runs it on a lent GPU.

Reads the text with a small parser of its own: the lent machine has no prometheus_client
(test_metrics.py checks the format with it)."""

from __future__ import annotations

import os
import pathlib
import re
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

if not os.path.isdir("/proc/driver/nvidia"):
    pytest.skip("no NVIDIA driver", allow_module_level=True)
GPU_WORKER = pathlib.Path(gpuq.testing.find_gpuqd()).parent / "gpuq-gpu-worker"
if not GPU_WORKER.exists():
    pytest.skip("gpuqd was built without CUDA (no gpuq-gpu-worker)", allow_module_level=True)

pytestmark = pytest.mark.gpu
BUDGET = 512 << 20

SAMPLE = re.compile(r'^(\w+)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def samples(text):
    """[(name, {labels}, value)] of the sample lines."""
    out = []
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        m = SAMPLE.match(line)
        assert m, line
        out.append((m.group(1), dict(LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def find(all_samples, name, **labels):
    return [(l, v) for n, l, v in all_samples
            if n == name and all(l.get(k) == v2 for k, v2 in labels.items())]


@pytest.fixture(scope="module")
def gd():
    cfg = {"pools": [{"name": "gpu", "kind": "gpu", "gpus": [0], "workers_per_gpu": 1,
                      "memory_limit": BUDGET}]}
    with gpuq.testing.Daemon(cfg, start_timeout=180) as d:
        yield d


def test_gpu_worker_memory_and_nvml_figures(gd):
    with gpuq.connect(gd.runtime_dir) as c:
        a = np.ones((256, 256), np.float32)
        for _ in range(20):
            c.gemm(a, a, pool="gpu").result(60)
    # The sampler writes once a second: wait for its first line.
    deadline = time.monotonic() + 15
    while True:
        s = samples(gpuq.metrics(gd.runtime_dir))
        if find(s, "gpuq_gpu_memory_total_bytes") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    budget = find(s, "gpuq_worker_gpu_memory_budget_bytes", pool="gpu")
    used = find(s, "gpuq_worker_gpu_memory_used_bytes", pool="gpu")
    assert len(budget) == 1 and budget[0][1] == BUDGET, budget
    assert budget[0][0]["gpu"] == "0" and budget[0][0]["worker"] == "0"
    assert len(used) == 1 and 0 <= used[0][1] <= BUDGET, used
    total = find(s, "gpuq_gpu_memory_total_bytes", gpu="0")
    assert total, "no NVML figures: is the GPU sampler running? (gpuqd log)\n" + gd.log()
    assert total[0][0]["uuid"].startswith("GPU-")
    assert total[0][1] > BUDGET
    mem_used = find(s, "gpuq_gpu_memory_used_bytes", gpu="0")
    assert mem_used and 0 < mem_used[0][1] <= total[0][1]
    util = find(s, "gpuq_gpu_utilization_ratio", gpu="0")
    assert util and 0.0 <= util[0][1] <= 1.0
    ok = find(s, "gpuq_jobs_total", pool="gpu", op="gemm", outcome="ok")
    assert ok and ok[0][1] == 20
