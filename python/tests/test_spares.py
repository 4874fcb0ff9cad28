"""Spare workers (docs/design/faults.md, "Spare workers"; a pool's ``spare_workers``) with a real
gpuqd and real Python workers: a spare, ready and held out of the ring, takes the place of an
active worker killed with SIGKILL or stopped for a job past its time limit (the next job runs
in the spare's own process, pinned where the dead worker was), a new spare is started behind
it; and a kill storm (a random ready or starting worker killed every 0.2-0.6 s for
GPUQ_TEST_SPARE_STORM_S seconds, 30 by default, while 6 client processes send retryable jobs)
ends with every job answered and the pool whole again."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import random
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


def spare_pool(workers=2, spares=1, **extra):
    return {"name": "py", "kind": "cpu", "workers": workers, "spare_workers": spares,
            "cpus": [0, 1],
            "python": {"interpreter": sys.executable, "modules": ["pyops_spares"],
                       "path": [OPS_DIR]}, **extra}


def pool_status(daemon):
    return next(p for p in daemon.status()["pools"] if p["name"] == "py")


def wait_for(daemon, what, cond, timeout=60.0):
    """Polls the pool's status until cond(status) holds; returns that status."""
    deadline = time.monotonic() + timeout
    st = pool_status(daemon)
    while time.monotonic() < deadline:
        st = pool_status(daemon)
        if cond(st):
            return st
        time.sleep(0.02)
    raise AssertionError(f"{what} within {timeout} s: {st}")


def whole(st, workers, spares):
    """The pool as configured: every active worker and every spare ready, and nothing queued."""
    return (st["workers_ready"] == workers and st["workers_total"] == workers
            and st["spares_ready"] == spares and st["spares_total"] == spares
            and all(w["state"] == "ready" for w in st["workers"]))


def spare_of(st):
    [s] = [w for w in st["workers"] if w["role"] == "spare"]
    return s


def gpuqctl(daemon, *args):
    """gpuqctl's output (beside gpuqd: the wheel's gpuq/bin/, else the build tree's tools/)."""
    gpuqd = pathlib.Path(gpuq.testing.find_gpuqd())
    exe = gpuqd.parent / "gpuqctl"
    if not exe.exists():
        exe = gpuqd.parent.parent / "tools" / "gpuqctl"
    return subprocess.run([str(exe), "--runtime-dir", daemon.runtime_dir, *args], check=True,
                          capture_output=True, text=True, timeout=30).stdout


def thread_affinities(pid):
    return {tid: os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


@pytest.fixture(scope="module", autouse=True)
def two_cpus():
    if not {0, 1} <= os.sched_getaffinity(0):
        pytest.skip("needs CPUs 0 and 1")


def occupy_other_worker(c, daemon):
    """Starts a cooperative spin on one active worker; returns (its future, the other active
    worker's status entry), once the spin runs."""
    fut = c.submit_call("spin", pool="py")
    st = wait_for(daemon, "a worker running the spin",
                  lambda s: any(w["busy"] and w["role"] == "active" for w in s["workers"]))
    [free] = [w for w in st["workers"] if w["role"] == "active" and not w["busy"]]
    return fut, free


def test_a_killed_worker_is_replaced_by_the_spare_at_once():
    cfg = {"pools": [spare_pool()], "restart_backoff_initial_ms": 100}
    with gpuq.testing.Daemon(cfg) as d, gpuq.connect(d.runtime_dir) as c:
        st = wait_for(d, "the spare ready", lambda s: whole(s, 2, 1))
        spare = spare_of(st)
        assert st["status"] == "ready" and st["capacity"] == 20  # the ring: 2 active workers
        # The spare idles, held: it has served nothing.
        assert spare["jobs_done"] == 0 and spare["cpus"] == [0]
        spin, victim = occupy_other_worker(c, d)

        os.kill(victim["pid"], signal.SIGKILL)
        t0 = time.monotonic()
        r = c.call("whoami", pool="py", timeout=30)
        took = time.monotonic() - t0
        # Served by the spare's own process (no new start), in its new place.
        assert r["pid"] == spare["pid"] and r["worker"] == spare["id"], (r, spare)
        assert took < 2.0, took  # a fresh start would add a Python start to the back-off
        st = pool_status(d)
        promoted = next(w for w in st["workers"] if w["id"] == spare["id"])
        assert promoted["role"] == "active" and promoted["cpus"] == victim["cpus"]
        assert st["spare_promotions"] == 1
        # Every thread of the promoted process is pinned where the dead worker was.
        assert set(map(frozenset, thread_affinities(spare["pid"]).values())) == {
            frozenset(victim["cpus"])}

        # A new spare is started behind it, in the dead worker's entry, on the spare's old CPU.
        st = wait_for(d, "a new spare", lambda s: whole(s, 2, 1))
        new_spare = spare_of(st)
        assert new_spare["id"] == victim["id"] and new_spare["pid"] not in (victim["pid"], 0)
        assert new_spare["cpus"] == [0] and new_spare["jobs_done"] == 0
        assert "spares 1/1 ready (1 promoted)" in gpuqctl(d, "status")
        metrics = gpuq.metrics(d.runtime_dir)
        assert 'gpuq_spare_promotions_total{pool="py"} 1' in metrics
        assert 'gpuq_workers{pool="py",state="spare"} 1' in metrics
        spin.stop()
        with pytest.raises(gpuq.Cancelled):
            spin.result(timeout=30)
        # The new spare is held too: it serves nothing while the active workers do.
        for _ in range(20):
            assert c.call("whoami", pool="py", timeout=30)["pid"] != new_spare["pid"]


def test_a_worker_stopped_for_a_job_past_its_time_limit_is_replaced_by_the_spare():
    cfg = {"pools": [spare_pool()], "cancel_grace_ms": 300}
    with gpuq.testing.Daemon(cfg) as d, gpuq.connect(d.runtime_dir) as c:
        spare = spare_of(wait_for(d, "the spare ready", lambda s: whole(s, 2, 1)))
        spin, victim = occupy_other_worker(c, d)
        hung = c.submit_call("hang", pool="py", time_limit=0.3)
        nxt = c.submit_call("whoami", pool="py")  # queued behind the hung job
        with pytest.raises(gpuq.TimedOut, match="was stopped"):
            hung.result(timeout=30)
        t0 = time.monotonic()
        r = nxt.result(timeout=30)
        assert r["pid"] == spare["pid"], (r, spare)
        assert time.monotonic() - t0 < 2.0
        st = pool_status(d)
        assert st["stops_forced"] == 1 and st["spare_promotions"] == 1
        assert next(w for w in st["workers"] if w["id"] == victim["id"])["role"] == "spare"
        wait_for(d, "a new spare", lambda s: whole(s, 2, 1))
        spin.stop()


# ---- the kill storm -----------------------------------------------------------------------------


def _storm_client(runtime_dir, index, stop, out):
    """Sends retryable jobs until `stop` is set; puts (index, ok, died, errors) on `out`."""
    ok = died = 0
    errors = []
    rng = random.Random(index)
    try:
        with gpuq.connect(runtime_dir, name=f"storm-{index}") as c:
            while not stop.is_set():
                x = np.arange(4, dtype=np.float64) + rng.random()
                fut = c.submit_call("work", x, ms=rng.choice((0, 0, 1, 5, 20)), pool="py",
                                    retryable=True)
                try:
                    y, pid = fut.result(timeout=120)
                except gpuq.WorkerDied as e:
                    # Retried once after its first worker died; its second worker died too.
                    if "while running this job" not in str(e):
                        errors.append(f"WorkerDied with an odd message: {e}")
                    died += 1
                    continue
                except Exception as e:  # noqa: BLE001 - anything else is a failure, reported
                    errors.append(repr(e))
                    continue
                if not np.array_equal(y, x * 2) or pid <= 0:
                    errors.append(f"wrong answer {y!r} for {x!r}")
                ok += 1
    except BaseException as e:  # noqa: BLE001 - reported to the test
        errors.append(repr(e))
    out.put((index, ok, died, errors))


def test_a_kill_storm_ends_with_every_job_answered_and_the_pool_whole():
    duration = float(os.environ.get("GPUQ_TEST_SPARE_STORM_S", "30"))
    workers, spares = 2, 2
    # Back-offs that a minute after the storm has outlived, and jobs that wait out a pool with
    # no ready worker (pool_down_fail_ms 0) instead of failing PoolDown: what is checked is that
    # kills lose no job and leave no worker behind.
    cfg = {"pools": [spare_pool(workers, spares)], "restart_backoff_initial_ms": 100,
           "restart_backoff_max_ms": 2000, "start_backoff_initial_ms": 1000,
           "start_backoff_max_ms": 8000, "pool_down_fail_ms": 0}
    with gpuq.testing.Daemon(cfg) as d:
        wait_for(d, "the spares ready", lambda s: whole(s, workers, spares))
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        out = ctx.Queue()
        procs = [ctx.Process(target=_storm_client, args=(d.runtime_dir, i, stop, out))
                 for i in range(6)]
        for p in procs:
            p.start()
        rng = random.Random(int(os.environ.get("GPUQ_TEST_SPARE_STORM_SEED", "29")))
        kills = 0
        end = time.monotonic() + duration
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.2, 0.6))
            st = pool_status(d)
            live = [w for w in st["workers"]
                    if w["pid"] > 0 and w["state"] in ("ready", "starting")]
            if live:
                try:
                    os.kill(rng.choice(live)["pid"], signal.SIGKILL)
                    kills += 1
                except ProcessLookupError:
                    pass  # it died meanwhile
        stop.set()
        results = [out.get(timeout=180) for _ in procs]
        for p in procs:
            p.join(60)
        errors = [(i, e) for i, _, _, es in results for e in es]
        assert not errors, errors
        ok = sum(r[1] for r in results)
        died = sum(r[2] for r in results)
        assert kills >= duration / 0.6 * 0.8, kills
        assert ok > 0 and all(r[1] > 0 for r in results), results
        st = pool_status(d)
        assert st["spare_promotions"] > 0, st
        # Whole within a minute of the storm: every active worker and spare ready, nothing
        # queued or held, and it serves.
        st = wait_for(d, "the pool whole after the storm", lambda s: whole(s, workers, spares),
                      timeout=60)
        assert st["queue_depth"] == 0 and st["cells_held"] == 0
        with gpuq.connect(d.runtime_dir) as c:
            y, _ = c.call("work", np.ones(3), pool="py", timeout=30)
            np.testing.assert_array_equal(y, np.full(3, 2.0))
        print(f"kill storm: {kills} kills in {duration:.0f} s, {ok} jobs done, {died} WorkerDied "
              f"(killed twice), {st['spare_promotions']} promotions")
