"""gpuq from every process model: fork, spawn and forkserver pools, joblib/loky, a killed client."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import gpuq

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import mp_tasks  # noqa: E402


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_multiprocessing_pool(default_env, method):
    # The parent uses the default client first: a forked child inherits it and must get a
    # connection of its own, leaving the parent's jobs alone.
    parent_job = gpuq.submit("sleep", us=300_000)
    ctx = mp.get_context(method)
    with ctx.Pool(3, initializer=mp_tasks.wait_for_all, initargs=(ctx.Barrier(3),)) as pool:
        results = pool.map(mp_tasks.echo_task, range(12), chunksize=1)
    assert [s for _, s in results] == [1000 * i for i in range(12)]
    assert len({pid for pid, _ in results}) >= 2
    assert parent_job.result(30) == 300_000
    assert gpuq.submit("noop").result(10) == 0


def test_forked_child_reads_parent_segment_array(default_env):
    a = gpuq.array(np.arange(1 << 16, dtype=np.uint8))
    expected = gpuq.submit("checksum", a).result(30)
    with mp.get_context("fork").Pool(2) as pool:
        # The child inherits `a` (in the parent's segment): it is copied into its own.
        assert pool.map(mp_tasks.checksum_of, [a, a]) == [expected, expected]


def test_joblib_loky(default_env):
    joblib = pytest.importorskip("joblib")
    results = joblib.Parallel(n_jobs=2, backend="loky")(
        joblib.delayed(mp_tasks.echo_task)(i) for i in range(8))
    assert [s for _, s in results] == [1000 * i for i in range(8)]


CHILD = """
import sys, gpuq
c = gpuq.connect(sys.argv[1], name="doomed")
futures = [c.submit("sleep", us=2_000_000) for _ in range(2)]
futures += [c.submit("sleep", us=1) for _ in range(6)]
print("submitted", flush=True)
import time; time.sleep(60)
"""


def test_killed_client_is_reclaimed(client, daemon):
    before = daemon.status()["clients"]
    p = subprocess.Popen([sys.executable, "-c", CHILD, daemon.runtime_dir],
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "submitted"
        assert daemon.status()["clients"] == before + 1
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        p.kill()
    # Others are served while and after the daemon reclaims the dead client's jobs.
    assert client.submit("noop").result(30) == 0
    deadline = time.monotonic() + 20
    while daemon.status()["clients"] != before:
        assert time.monotonic() < deadline, "the daemon kept the killed client"
        time.sleep(0.05)
    fs = [client.submit("sleep", us=1000) for _ in range(20)]
    assert [f.result(30) for f in fs] == [1000] * 20


def test_client_pickles_as_connect_arguments(client, daemon):
    import pickle

    c2 = pickle.loads(pickle.dumps(client))
    try:
        assert c2 is not client and c2.submit("noop").result(10) == 0
    finally:
        c2.close()
    assert os.getpid()  # the original still works
    assert client.submit("noop").result(10) == 0


def test_keep_running_jobs_is_accepted_and_pickled(daemon):
    import pickle

    with gpuq.connect(daemon.runtime_dir, name="keeper", keep_running_jobs=True) as c:
        assert c.submit("sleep", us=1000).result(10) == 1000
        c2 = pickle.loads(pickle.dumps(c))
        try:
            assert c2._keep_running_jobs is True and c2.submit("noop").result(10) == 0
        finally:
            c2.close()
    with gpuq.Client(daemon.runtime_dir, keep_running_jobs=False) as c:
        assert c._keep_running_jobs is False and c.submit("noop").result(10) == 0
