"""Priorities from Python (issue 41): ``priority=`` on submit, try_submit, submit_call, the
Executor and the joblib backend; checked with a clear error; and a real daemon starting higher
levels first. One worker, so the start order is the run order (each job's start: its submit
time plus its time queued)."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

OPS_DIR = str(pathlib.Path(__file__).resolve().parent / "pyops")
CONFIG = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "queue_factor": 32,
          "max_jobs_per_client": 64}


@pytest.fixture(scope="module")
def one_worker():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


def test_priority_levels_come_from_the_native_module():
    assert list(gpuq._options.PRIORITIES) == ["high", "normal", "low"]
    assert gpuq._options.priority_level(None) == gpuq._options.PRIORITIES["normal"]


@pytest.mark.parametrize("bad", ["urgent", "HIGH", 1, 0.5, b"high"])
def test_a_wrong_priority_names_the_levels(one_worker, bad):
    with gpuq.connect(one_worker.runtime_dir) as c:
        with pytest.raises(gpuq.InvalidArgument, match="priority: must be one of 'high', "
                                                        "'normal', 'low'"):
            c.submit("noop", priority=bad)
        with pytest.raises(gpuq.InvalidArgument, match="priority"):
            c.try_submit("noop", priority=bad)
        with pytest.raises(gpuq.InvalidArgument, match="priority"):
            gpuq.Executor(client=c, priority=bad)
        # The client goes on.
        assert c.submit("noop", priority="low").result(timeout=30) is not None


def test_higher_levels_start_first(one_worker):
    with gpuq.connect(one_worker.runtime_dir) as c:
        hold = c.submit("sleep", us=400_000)
        deadline = time.monotonic() + 30
        while not hold.running():
            assert time.monotonic() < deadline
            time.sleep(0.001)
        jobs = []
        for level in ("low", "normal", "high"):
            for i in range(3):
                t = time.monotonic_ns()
                jobs.append((f"{level[0].upper()}{i}", t,
                             c.submit("sleep", us=3000, priority=level)))
        hold.result(timeout=30)
        starts = []
        for tag, t, f in jobs:
            f.result(timeout=30)
            starts.append((t + f.info.queued_ns, tag))
        order = " ".join(tag for _, tag in sorted(starts))
        assert order == "H0 H1 H2 N0 N1 N2 L0 L1 L2", order


def test_batching_gathers_within_one_level():
    # One worker of a Python pool (pyops/pyops_batch.py), held by a job that sleeps until it is
    # stopped, while two clients queue 1-row jobs of the batched op "bmlp" (64 rows a call),
    # low and high in turn: 16 rows that would all fit one call. Each job's meta names its call
    # (call ids grow on a worker), so each job tells which jobs shared its call: no call mixes
    # levels, and the high calls come before the low ones.
    pool = {
        "name": "py",
        "kind": "cpu",
        "workers": 1,
        "python": {"interpreter": sys.executable, "modules": ["pyops_batch"], "path": [OPS_DIR]},
    }
    with (
        gpuq.testing.Daemon(dict(CONFIG, pools=[pool])) as d,
        gpuq.connect(d.runtime_dir) as a,
        gpuq.connect(d.runtime_dir) as b,
    ):
        hold = a.submit_call("bsleep", np.zeros((1, 8), np.float32), seconds=120)
        deadline = time.monotonic() + 60
        while not hold.running():
            assert time.monotonic() < deadline
            time.sleep(0.005)
        jobs = []
        for i in range(4):
            for c in (a, b):
                for level in ("low", "high"):
                    x = np.full((1, 8), i, np.float32)
                    jobs.append((level, c.submit_call("bmlp", x, priority=level)))
        hold.stop()
        with pytest.raises(gpuq.Cancelled):
            hold.result(timeout=60)
        calls = {}
        for level, f in jobs:
            _, meta = f.result(timeout=60)
            calls.setdefault(int(meta[0, 0]), []).append(level)
        levels = [sorted(set(calls[call])) for call in sorted(calls)]
        assert all(len(one) == 1 for one in levels), levels  # no call mixes levels
        order = [one[0] for one in levels]
        assert order == sorted(order, key=["high", "low"].index), order  # high calls first
        for level in ("low", "high"):  # and each level's jobs did share calls
            assert max(js.count(level) for js in calls.values()) > 1, calls


def test_executor_and_joblib_check_their_priority(one_worker):
    with gpuq.connect(one_worker.runtime_dir) as c:
        with pytest.raises(gpuq.InvalidArgument, match="priority"):
            gpuq.Executor(client=c, priority="soon")
    joblib = pytest.importorskip("joblib")
    gpuq.register_joblib()
    with pytest.raises(gpuq.InvalidArgument, match="priority"):
        joblib.parallel_backend("gpuq", priority="soon")


def test_executor_and_joblib_run_at_a_priority():
    import sys

    config = {"pools": [{"name": "py", "kind": "cpu", "workers": 1,
                         "python": {"interpreter": sys.executable, "allow_callables": True}}]}
    joblib = pytest.importorskip("joblib")
    gpuq.register_joblib()
    with gpuq.testing.Daemon(config) as d, gpuq.connect(d.runtime_dir) as c:
        with gpuq.Executor(client=c, priority="high") as ex:
            assert list(ex.map(abs, range(-2, 3))) == [2, 1, 0, 1, 2]
        with joblib.parallel_backend("gpuq", client=c, priority="low"):
            out = joblib.Parallel(n_jobs=2)(joblib.delayed(abs)(i) for i in range(-2, 3))
        assert out == [2, 1, 0, 1, 2]


def test_client_weights_reach_the_status_and_follow_a_reload():
    config = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
              "client_weights": [{"user": os.getuid(), "weight": 3}]}
    with gpuq.testing.Daemon(config) as d, gpuq.connect(d.runtime_dir, name="weighted") as c:
        held = [c.submit("sleep", us=30_000_000) for _ in range(2)]
        try:
            deadline = time.monotonic() + 30
            while not held[0].running():
                assert time.monotonic() < deadline
                time.sleep(0.005)

            def weight():
                rows = [r for r in c.status()["client_jobs"] if r["program"] == "weighted"]
                assert len(rows) == 1, rows
                return rows[0]["weight"]

            assert weight() == 3
            d.reload(dict(config, client_weights=[{"user": os.getuid(), "weight": 7}]))
            assert weight() == 7
        finally:
            for f in held:
                f.stop()
            for f in held:
                try:
                    f.result(timeout=30)
                except gpuq.Cancelled:
                    pass
