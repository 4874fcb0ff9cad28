"""Config reload of gpu pools (docs/design/live_changes.md, "Config reload"), with a real gpuqd,
real Python workers and two fake GPUs (a /proc tree read under the test hook
GPUQ_TEST_GPU_ROOT; GPUQ_TEST_GPU_WORKER=real, so each gpu pool's worker runs its interpreter
with --gpu and its share of the pool's memory budget, as on a real GPU, while its op touches no
CUDA). While client processes call a gpu pool without pause, reloads add gpu pools, take
memory from a running pool's GPU (the running pool is rolled to its smaller budget before the
new pool starts), move a pool to the other GPU, and resize one within its max_workers: every
call answered, none failed, each worker on the GPU and with the budget the plan gives it. What would promise a GPU more than it
has, or roll a pool that has no seat for it, is refused whole; so is a gpu pool added to a
gpuqd that found no GPUs at start."""

from __future__ import annotations

import pathlib
import time

import pytest

import gpuq
import gpuq.testing
from test_reload import callers, pool_status

UUIDS = ["GPU-0b7e1c3a-5d2f-4a61-9c8e-2f4b6d8a0c1e", "GPU-7a41d2e9-0c3b-4f85-8d16-93e5b0a7c2f4"]
BUSES = ["0000:3b:00.0", "0000:af:00.0"]
CLIENTS = 8

# `version` answers with the GPU its worker was given: a caller's "versions" are the GPUs it saw.
MODULE = '''
import os, gpuq

@gpuq.op("version")
def version(x=0):
    return {"version": os.environ.get("CUDA_VISIBLE_DEVICES"), "pid": os.getpid(), "x": x}
'''


@pytest.fixture
def two_gpus(tmp_path, monkeypatch):
    for uuid, bus in zip(UUIDS, BUSES):
        info = tmp_path / "gpus/proc/driver/nvidia/gpus" / bus
        info.mkdir(parents=True)
        (info / "information").write_text(
            f"Model: \t\t NVIDIA H100 80GB HBM3\nGPU UUID: \t {uuid}\nBus Location: \t {bus}\n"
            "GPU Excluded:\t No\n")
    monkeypatch.setenv("GPUQ_TEST_HOOKS", "1")
    monkeypatch.setenv("GPUQ_TEST_GPU_ROOT", str(tmp_path / "gpus"))
    monkeypatch.setenv("GPUQ_TEST_GPU_WORKER", "real")
    modules = tmp_path / "mods"
    modules.mkdir()
    (modules / "gpumod.py").write_text(MODULE)
    return modules


def gpu_pool(name, modules, gpu, **extra):
    return {"name": name, "kind": "gpu", "gpus": [gpu],
            "python": {"modules": ["gpumod"], "path": [str(modules)],
                       "env": {"PYTHONDONTWRITEBYTECODE": "1"}},
            **extra}


def budgets(daemon, name):
    """Each running worker of pool `name` (spares and surge seats included): (its GPU's UUID,
    its memory share from its command line)."""
    out = []
    for w in pool_status(daemon, name)["workers"]:
        if not w.get("pid"):
            continue
        try:
            argv = pathlib.Path(f"/proc/{w['pid']}/cmdline").read_bytes().split(b"\0")
            environ = pathlib.Path(f"/proc/{w['pid']}/environ").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited since the status (a retired worker)
        if b"--memory-limit-fraction" not in argv:
            out.append(("starting", 0.0))  # forked, not yet its program: wait_workers looks again
            continue
        env = dict(e.split(b"=", 1) for e in environ.split(b"\0") if b"=" in e)
        share = float(argv[argv.index(b"--memory-limit-fraction") + 1])
        out.append((env[b"CUDA_VISIBLE_DEVICES"].decode(), round(share, 6)))
    return sorted(out)


def wait_workers(daemon, name, want, timeout=120):
    deadline = time.monotonic() + timeout
    while True:
        got = budgets(daemon, name)
        if got == want:
            return
        assert time.monotonic() < deadline, (name, got, want)
        time.sleep(0.05)


def test_gpu_pools_added_rebudgeted_and_moved_under_load(two_gpus):
    mods = two_gpus
    g0 = gpu_pool("g0", mods, 0, rollout_surge_workers=1)
    g1 = gpu_pool("g1", mods, 1, rollout_surge_workers=1)
    g2 = gpu_pool("g2", mods, 0, memory_limit=0.3)
    with gpuq.testing.Daemon({"added_pool_workers": 4, "pools": [g0]}) as d:
        # g0 alone on GPU 0: 0.9 of it (the default) for its worker and its surge seat.
        wait_workers(d, "g0", [(UUIDS[0], 0.45)])  # the surge seat is dormant: no process
        with callers(d.runtime_dir, ["g0"] * CLIENTS) as results:
            with gpuq.connect(d.runtime_dir, name="gpu-reload-checker") as c:
                # A gpu pool on the other GPU: added; nothing else moves.
                lines = d.reload({"added_pool_workers": 4, "pools": [g0, g1]})
                assert "pool g1: added, 1 workers" in lines, lines
                assert c.call("version", pool="g1")["version"] == UUIDS[1]
                assert pool_status(d, "g1")["gpus"][0]["uuid"] == UUIDS[1]
                wait_workers(d, "g1", [(UUIDS[1], 0.45)])
                assert pool_status(d, "g0")["generation"] == 1

                # A pool that takes 0.3 of GPU 0: g0's default share there falls to 0.6, so g0
                # is rolled to 0.3 per worker first, then g2 starts.
                lines = d.reload({"added_pool_workers": 4, "pools": [g0, g1, g2]})
                assert "pool g0: memory budget changed: rolling restart" in lines, lines
                assert "pool g2: added, 1 workers" in lines, lines
                assert pool_status(d, "g0")["generation"] == 2
                wait_workers(d, "g0", [(UUIDS[0], 0.3)])
                wait_workers(d, "g2", [(UUIDS[0], 0.3)])
                assert c.call("version", pool="g2")["version"] == UUIDS[0]
                assert pool_status(d, "g1")["generation"] == 1  # another GPU: untouched

                # More than GPU 0 has, or a roll without a seat: refused whole.
                over = gpu_pool("g3", mods, 0, memory_limit=0.8)
                with pytest.raises(gpuq.InvalidArgument, match=r"more than all of it.*nothing changed"):
                    d.reload({"added_pool_workers": 4, "pools": [g0, g1, g2, over]})
                with pytest.raises(gpuq.InvalidArgument,
                                   match=r"pools\[g2\]: its workers must be rolled .*no seat for "
                                         r"a new worker on GPU 1.*rollout_surge_workers"):
                    d.reload({"added_pool_workers": 4,
                              "pools": [g0, g1, gpu_pool("g2", mods, 1, memory_limit=0.3)]})
                with pytest.raises(gpuq.InvalidArgument,
                                   match=r"pools\[g1\]: workers_per_gpu x its GPUs would be 2 "
                                         r"workers, more than its max_workers, 1"):
                    d.reload({"added_pool_workers": 4,
                              "pools": [g0, {**g1, "gpus": [0, 1]}, g2]})
                assert [p["name"] for p in d.status()["pools"]] == ["g0", "g1", "g2"]
                assert pool_status(d, "g0")["generation"] == 2

                # g0 moves to GPU 1 under its callers: g1's default share there halves, so g1
                # is rolled too; g0's callers see the new GPU once the reload returns.
                moved = {**g0, "gpus": [1]}
                lines = d.reload({"added_pool_workers": 4, "pools": [moved, g1, g2]})
                assert "pool g0: gpus changed: rolling restart" in lines, lines
                assert "pool g1: memory budget changed: rolling restart" in lines, lines
                wait_workers(d, "g0", [(UUIDS[1], 0.225)])
                wait_workers(d, "g1", [(UUIDS[1], 0.225)])
                assert pool_status(d, "g0")["gpus"][0]["uuid"] == UUIDS[1]
                for i in range(20):
                    assert c.call("version", i, pool="g0")["version"] == UUIDS[1]
    failures = [f for _, _, fs, _, _, _ in results for f in fs]
    assert not failures, failures[:5]
    for _, calls, _, seen, gone, _ in results:
        assert calls > 0 and not gone
        assert seen[-1] == UUIDS[1], seen  # moved, and never back
        assert seen in ([UUIDS[0], UUIDS[1]], [UUIDS[1]]), seen


def test_a_gpu_pool_resized_within_its_max_workers_under_load(two_gpus):
    """workers_per_gpu raised: the smaller shares come first (a rollout), then the new workers;
    lowered: the last workers retire and the others keep their (smaller) shares, no restart.
    Past max_workers: refused. Every call answered."""
    mods = two_gpus

    def cfg(per_gpu):
        return {"pools": [gpu_pool("g", mods, 0, gpus=[0, 1], workers_per_gpu=per_gpu,
                                   max_workers=4, rollout_surge_workers=surge)]}

    surge = 1
    with gpuq.testing.Daemon(cfg(1)) as d:
        # GPU 0: a worker and the surge seat share 0.9; GPU 1: its worker alone. A rollout
        # would have no seat on GPU 1: refused, nothing changed.
        wait_workers(d, "g", [(UUIDS[0], 0.45), (UUIDS[1], 0.9)])
        with pytest.raises(gpuq.InvalidArgument, match=r"pools\[g\]: its workers must be rolled.*"
                                                       r"no seat for a new worker on GPU 1.*"
                                                       r"nothing changed"):
            d.reload(cfg(2))
        assert pool_status(d, "g")["workers_total"] == 2
    surge = 2  # a seat on each GPU: a rollout starts a new worker beside the one it replaces
    with gpuq.testing.Daemon(cfg(1)) as d:
        wait_workers(d, "g", [(UUIDS[0], 0.45), (UUIDS[1], 0.45)])
        with callers(d.runtime_dir, ["g"] * CLIENTS) as results:
            lines = d.reload(cfg(2))
            assert lines == ["pool g: workers_per_gpu changed: rolling restart (4 workers)"], lines
            st = pool_status(d, "g")
            assert st["generation"] == 2 and st["workers_total"] == 4, st
            wait_workers(d, "g", [(UUIDS[0], 0.3), (UUIDS[0], 0.3), (UUIDS[1], 0.3),
                                  (UUIDS[1], 0.3)])
            with pytest.raises(gpuq.InvalidArgument,
                               match=r"max_workers: 4 is fewer than its workers_per_gpu x its "
                                     r"GPUs, 6.*nothing changed"):
                d.reload(cfg(3))
            lines = d.reload(cfg(1))
            assert lines == ["pool g: workers_per_gpu changed, in effect now (2 workers)"], lines
            wait_workers(d, "g", [(UUIDS[0], 0.3), (UUIDS[1], 0.3)])
            assert pool_status(d, "g")["generation"] == 2
    failures = [f for _, _, fs, _, _, _ in results for f in fs]
    assert not failures, failures[:5]
    assert all(calls > 0 for _, calls, _, _, _, _ in results)


def test_a_cxx_gpu_pool_moved_to_the_other_gpu(two_gpus, monkeypatch):
    """A C++ gpu pool (here on the CPU backend, as on fake GPUs without GPUQ_TEST_GPU_WORKER):
    its rollout needs no op listing, so it may end inside its start; moved to the other GPU, the
    reload's reply comes once its new worker serves there, and the next reload is not refused
    as one in progress."""
    monkeypatch.delenv("GPUQ_TEST_GPU_WORKER")

    def cfg(gpu):
        return {"pools": [{"name": "cg", "kind": "gpu", "gpus": [gpu], "rollout_surge_workers": 1}]}

    with gpuq.testing.Daemon(cfg(0)) as d:
        with gpuq.connect(d.runtime_dir) as c:
            c.submit("noop", pool="cg").result(30)
            assert d.reload(cfg(1)) == ["pool cg: gpus changed: rolling restart"]
            st = pool_status(d, "cg")
            assert st["generation"] == 2
            assert [w["gpu"] for w in st["workers"] if w.get("pid")] == [UUIDS[1]], st["workers"]
            c.submit("noop", pool="cg").result(30)
            assert d.reload(cfg(1)) == ["nothing changed"]
            assert d.reload(cfg(0)) == ["pool cg: gpus changed: rolling restart"]
            assert pool_status(d, "cg")["generation"] == 3


def test_a_gpu_pool_added_where_no_gpus_were_looked_for(tmp_path, two_gpus):
    """gpuqd looks for GPUs at start only when a gpu pool asks: one added later is refused,
    saying so, and the cpu pool serves on."""
    cpu = {"name": "cpu", "kind": "cpu", "workers": 1}
    with gpuq.testing.Daemon({"pools": [cpu]}) as d:
        with pytest.raises(gpuq.InvalidArgument, match=r"pools\[g\]: a new gpu pool: gpuqd looks "
                                                       r"for GPUs at start.*nothing changed"):
            d.reload({"pools": [cpu, gpu_pool("g", two_gpus, 0)]})
        with gpuq.connect(d.runtime_dir) as c:
            assert [p["name"] for p in c.pools] == ["cpu"]
