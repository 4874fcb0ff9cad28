"""Dynamic batching of Python ops (docs/python.md, "Dynamic batching"): a real gpuqd whose
Python workers run python/tests/pyops/pyops_batch.py; real client processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import signal
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
OPS_DIR = str(HERE / "pyops")
sys.path.insert(0, OPS_DIR)
import pyops_batch  # noqa: E402 - the workers import it too (python.path)


def python_pool(name, workers):
    return {"name": name, "kind": "cpu", "workers": workers,
            "python": {"interpreter": sys.executable, "modules": ["pyops_batch"],
                       "path": [OPS_DIR]}}


CONFIG = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1},
                    python_pool("one", 1), python_pool("two", 2)],
          "restart_backoff_initial_ms": 10, "cancel_grace_ms": 300,
          "client_queue_share": 1.0, "max_clients": 48}


@pytest.fixture(scope="module")
def bdaemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture
def bc(bdaemon):
    with gpuq.connect(bdaemon.runtime_dir, name="pytest-batching") as c:
        yield c


def rows(n, seed, features=8):
    return np.random.default_rng(seed).standard_normal((n, features), dtype=np.float32)


def pool_status(daemon, name):
    return next(p for p in daemon.status()["pools"] if p["name"] == name)


def wait_ready(daemon, name, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = pool_status(daemon, name)
        if p["status"] == "ready" and all(w["state"] == "ready" for w in p["workers"]):
            return p
        time.sleep(0.05)
    raise AssertionError(f"pool {name} not ready: {pool_status(daemon, name)}")


def behind_a_blocker(c, seconds=0.3):
    """A job that holds pool "one"'s only worker, so that the jobs sent next queue up and its
    worker gathers them all once it is free."""
    f = c.submit_call("block", seconds, pool="one")
    time.sleep(0.05)  # it has started
    return f


def call_of(meta):
    assert (meta[:, 0] == meta[0, 0]).all()  # a job's rows come from one call
    return int(meta[0, 0]), int(meta[0, 1])


# ---- results ------------------------------------------------------------------------------------


def _client_process(runtime_dir, index, jobs, barrier, out):
    try:
        with gpuq.connect(runtime_dir, name=f"batch-client-{index}") as c:
            barrier.wait(60)
            got = []
            for j in range(jobs):
                x = rows(1 + (index + j) % 3, [index, j])
                y, meta = c.call("bmlp", x, pool="two", pause=0.002)
                ref, _ = c.call("umlp", x, pool="two")
                np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(y, pyops_batch.mlp_numpy(x), rtol=1e-5, atol=1e-5)
                assert y.shape == (x.shape[0], 3)
                got.append(call_of(meta))
            out.put((index, got, None))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put((index, [], repr(e)))


def test_results_match_the_unbatched_op_row_for_row_under_32_clients(bdaemon):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(32)
    out = ctx.Queue()
    procs = [ctx.Process(target=_client_process, args=(bdaemon.runtime_dir, i, 12, barrier, out))
             for i in range(32)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(60)
    errors = [(i, e) for i, _, e in results if e]
    assert not errors, errors
    calls = [call for _, got, _ in results for call in got]
    assert len(calls) == 32 * 12
    # Jobs of different clients shared calls: batching happened, and every row still matched.
    assert max(n for _, n in calls) > 3


def test_a_call_never_gets_more_than_max_batch_size_rows(bc):
    # bsmall takes 4 rows at most. Queued jobs of 1 and 3 rows: the worker gathers while the
    # next job still fits (it counts each job's rows before it takes it), so no call has more
    # than 4 rows, and one job is never cut in two. A first job larger than the limit runs
    # alone.
    sizes = [3, 1, 3, 3, 1, 1, 3, 5, 1, 3, 2, 2, 2]
    blocker = behind_a_blocker(bc)
    sent = [(rows(n, 100 + i), bc.submit_call("bsmall", rows(n, 100 + i), pool="one"))
            for i, n in enumerate(sizes)]
    blocker.result(timeout=30)
    calls = {}
    for x, f in sent:
        y, meta = f.result(timeout=30)
        np.testing.assert_allclose(y, pyops_batch.mlp_numpy(x), rtol=1e-5, atol=1e-5)
        call, call_rows = call_of(meta)
        calls.setdefault(call, [call_rows, 0])[1] += x.shape[0]
    for call_rows, jobs_rows in calls.values():
        assert call_rows == jobs_rows  # the call's rows are its jobs' rows, whole
        assert call_rows <= 4 or call_rows == 5  # the 5-row job, alone
    assert any(jobs_rows > 3 for _, jobs_rows in calls.values())  # it did batch


def test_a_job_that_says_fewer_rows_than_it_has_fails_alone(bc):
    # A forged job (gpuq's client writes py.r from the arrays): 3 rows said to be 1 would let a
    # batch past max_batch_size, so it fails InvalidArgument and its batch mates are served.
    x = rows(3, 7)
    block, start, length, h, n, _, said = gpuq._native.encode_call((x,), None, 0, 64)
    assert said == 3
    conn = bc._c()
    buf = bc.empty(length + 4096, np.uint8)
    buf[:length] = np.frombuffer(bytes(block[start:start + length]), np.uint8)
    off = bc._offset(conn, buf)
    params = [("py.h", h), ("py.n", n), ("py.r", 1)]
    blocker = behind_a_blocker(bc)
    mate = bc.submit_call("bsmall", rows(1, 8), pool="one")
    job = conn.native.submit("bsmall", off, length, off + length, 4096, params,
                             gpuq._native.JobOptions("one"))
    forged = gpuq.Future(job, [buf], None, conn.watcher)
    blocker.result(timeout=30)
    with pytest.raises(gpuq.InvalidArgument, match=r"3 rows, but its params say 1 \(py.r\)"):
        forged.result(timeout=30)
    y, _ = mate.result(timeout=30)
    np.testing.assert_allclose(y, pyops_batch.mlp_numpy(rows(1, 8)), rtol=1e-5, atol=1e-5)


def test_a_lone_caller_does_not_wait_the_delay(bc):
    # bwait's delay is a second: a caller alone is answered long before it passes.
    for i in range(5):
        t0 = time.monotonic()
        y, meta = bc.call("bwait", rows(2, i), pool="one")
        assert time.monotonic() - t0 < 0.5
        assert call_of(meta)[1] == 2
        np.testing.assert_allclose(y, pyops_batch.mlp_numpy(rows(2, i)), rtol=1e-5, atol=1e-5)


def test_mixed_shapes_and_kwargs_never_share_a_call(bc):
    blocker = behind_a_blocker(bc)
    sent = []
    for i in range(12):
        scale = 1.0 if i % 3 else 2.0
        x = rows(1 + i % 2, i, features=8)
        sent.append((x, scale, bc.submit_call("bmlp", x, pool="one", scale=scale)))
    blocker.result(timeout=30)
    members = {}
    for x, scale, f in sent:
        y, meta = f.result(timeout=30)
        np.testing.assert_allclose(y, pyops_batch.mlp_numpy(x, scale), rtol=1e-5, atol=1e-5)
        members.setdefault(call_of(meta)[0], set()).add(scale)
    assert all(len(s) == 1 for s in members.values())  # no call mixed two scales
    assert len(members) < len(sent)                     # and jobs did share calls
    # Arrays whose shapes past axis 0 differ: separate calls too.
    blocker = behind_a_blocker(bc)
    f8 = [bc.submit_call("bsleep", rows(1, i, 8), pool="one") for i in range(3)]
    f5 = [bc.submit_call("bsleep", rows(1, i, 5), pool="one") for i in range(3)]
    blocker.result(timeout=30)
    c8 = {call_of(f.result(timeout=30)[1])[0] for f in f8}
    c5 = {call_of(f.result(timeout=30)[1])[0] for f in f5}
    assert not c8 & c5
    assert len(c8) == 1 and len(c5) == 1


# ---- per-job semantics --------------------------------------------------------------------------


def _open_a_batch(bc):
    """Makes bwait's next batch on pool "one" wait for two jobs, for at most its quiet gap (a
    tenth of bwait's 1 s delay: 0.1 s): each of its last 4 batches held two."""
    for _ in range(4):
        blocker = behind_a_blocker(bc)
        fs = [bc.submit_call("bwait", rows(1, i), pool="one") for i in range(2)]
        blocker.result(timeout=30)
        assert len({call_of(f.result(timeout=30)[1])[0] for f in fs}) == 1


def test_a_job_cancelled_while_its_batch_gathers_leaves_it(bc):
    _open_a_batch(bc)
    a = bc.submit_call("bwait", rows(1, 10), pool="one")  # taken, then waits for company
    time.sleep(0.04)  # within the quiet gap (0.1 s)
    assert not a.done()
    assert a.stop() is False  # running: asked to stop
    b = bc.submit_call("bwait", rows(1, 11), pool="one")
    y, meta = b.result(timeout=30)
    assert call_of(meta)[1] == 1  # b's call had b's row alone
    with pytest.raises(gpuq.Cancelled, match="batch was gathered"):
        a.result(timeout=30)


def test_a_job_expired_while_its_batch_gathers_leaves_it(bc):
    _open_a_batch(bc)
    a = bc.submit_call("bwait", rows(1, 20), pool="one", expire_after=0.02)
    time.sleep(0.05)  # past its deadline, within the quiet gap (0.1 s)
    b = bc.submit_call("bwait", rows(1, 21), pool="one")
    assert call_of(b.result(timeout=30)[1])[1] == 1
    with pytest.raises(gpuq.Expired):
        a.result(timeout=30)


def test_a_lone_job_after_a_batch_is_stopped_by_its_cancel(bc, bdaemon):
    # The worker's page says how many jobs its call serves; after a batch it says one again,
    # so a cancelled lone job that ignores its flag has its worker stopped after the grace, as
    # any job's would be (a call serving several clients is not stopped for one's cancel).
    wait_ready(bdaemon, "one")
    _open_a_batch(bc)
    f = bc.submit_call("block", 5.0, pool="one")
    time.sleep(0.2)
    assert f.stop() is False  # running: asked to stop
    with pytest.raises(gpuq.Cancelled):
        f.result(timeout=3)
    wait_ready(bdaemon, "one")


def test_a_time_limit_ends_the_gathering(bc, bdaemon):
    # Gathering counts toward a job's time limit: once the first job's has passed, the batch is
    # called at once, instead of waiting out bwait's one-second delay for company until the
    # supervisor stops the worker (0.2 s limit + 0.3 s cancel_grace_ms).
    wait_ready(bdaemon, "one")
    restarts = sum(w["restarts"] for w in pool_status(bdaemon, "one")["workers"])
    _open_a_batch(bc)
    f = bc.submit_call("bwait", rows(1, 25), pool="one", time_limit=0.2)
    y, meta = f.result(timeout=30)  # bwait does not look at its flag: it answers
    assert call_of(meta)[1] == 1
    time.sleep(0.5)  # past the grace
    assert sum(w["restarts"] for w in pool_status(bdaemon, "one")["workers"]) == restarts


def test_a_time_limit_stops_the_call_and_the_others_run_again(bc):
    blocker = behind_a_blocker(bc)
    limited = bc.submit_call("bsleep", rows(1, 30), pool="one", seconds=1.5, time_limit=0.3)
    same = bc.submit_call("bsleep", rows(1, 31), pool="one", seconds=1.5, time_limit=0.3)
    free = bc.submit_call("bsleep", rows(1, 32), pool="one", seconds=1.5)
    blocker.result(timeout=30)
    t0 = time.monotonic()
    with pytest.raises(gpuq.TimedOut):
        limited.result(timeout=30)
    with pytest.raises(gpuq.TimedOut):
        same.result(timeout=30)
    assert time.monotonic() - t0 < 1.2  # stopped, not run to its end
    x, meta = free.result(timeout=30)  # run again, alone, to its end
    np.testing.assert_array_equal(x, rows(1, 32))
    assert call_of(meta)[1] == 1


def test_a_call_that_ignores_its_time_limit_is_stopped_and_the_others_run_again(bc, bdaemon):
    before = sum(w["restarts"] for w in pool_status(bdaemon, "one")["workers"])
    blocker = behind_a_blocker(bc)
    limited = bc.submit_call("bsleep", rows(1, 40), pool="one", seconds=1.0, cooperative=False,
                             time_limit=0.2)
    free = bc.submit_call("bsleep", rows(1, 41), pool="one", seconds=1.0, cooperative=False)
    blocker.result(timeout=30)
    with pytest.raises(gpuq.TimedOut):
        limited.result(timeout=30)
    x, meta = free.result(timeout=60)  # on the replacement worker
    np.testing.assert_array_equal(x, rows(1, 41))
    assert call_of(meta)[1] == 1
    wait_ready(bdaemon, "one")
    assert sum(w["restarts"] for w in pool_status(bdaemon, "one")["workers"]) == before + 1


def test_an_exception_fails_every_job_of_the_call(bc):
    blocker = behind_a_blocker(bc)
    fs = [bc.submit_call("bfail", rows(1, i) * (1 if i != 2 else -1) + (0 if i == 2 else 10),
                         pool="one") for i in range(4)]
    blocker.result(timeout=30)
    for f in fs:
        with pytest.raises(gpuq.OpFailed, match="ValueError: bfail: a negative row") as e:
            f.result(timeout=30)
        assert "raise ValueError" in e.value.remote_traceback
    x, _ = bc.call("bfail", rows(1, 5) + 10, pool="one")  # the worker serves on
    assert x.shape == (1, 8)


def test_a_result_without_a_row_per_input_row_fails_the_call(bc):
    blocker = behind_a_blocker(bc)
    fs = [bc.submit_call("bbad", rows(2, i), pool="one") for i in range(3)]
    blocker.result(timeout=30)
    for f in fs:
        with pytest.raises(gpuq.OpFailed, match="one row per input row"):
            f.result(timeout=30)
    # Alone, the same op is a plain call: its one row is the answer.
    assert bc.call("bbad", rows(1, 9), pool="one").shape == (1, 8)


def _find_worker_pid(daemon, pool):
    return [w["pid"] for w in pool_status(daemon, pool)["workers"]][0]


def test_a_worker_death_fails_each_job_as_worker_died_or_retries_it(bc, bdaemon):
    wait_ready(bdaemon, "one")
    pid = _find_worker_pid(bdaemon, "one")
    blocker = behind_a_blocker(bc)
    plain = bc.submit_call("bsleep", rows(1, 50), pool="one", seconds=2.0, cooperative=False)
    retried = bc.submit_call("bsleep", rows(1, 51), pool="one", seconds=2.0, cooperative=False,
                             retryable=True)
    blocker.result(timeout=30)
    time.sleep(0.3)  # both run, in one call
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(gpuq.WorkerDied):
        plain.result(timeout=30)
    x, _ = retried.result(timeout=60)
    np.testing.assert_array_equal(x, rows(1, 51))
    wait_ready(bdaemon, "one")


def _doomed_client(runtime_dir, ready):
    c = gpuq.connect(runtime_dir, name="doomed")
    f = c.submit_call("bsleep", rows(1, 60), pool="one", seconds=1.0, cooperative=False)
    ready.set()
    f.result(timeout=60)


def test_a_client_that_dies_mid_batch_loses_only_its_own_rows(bc, bdaemon):
    wait_ready(bdaemon, "one")
    restarts = sum(w["restarts"] for w in pool_status(bdaemon, "one")["workers"])
    ctx = mp.get_context("spawn")
    blocker = behind_a_blocker(bc, 1.5)
    ready = ctx.Event()
    doomed = ctx.Process(target=_doomed_client, args=(bdaemon.runtime_dir, ready))
    doomed.start()
    assert ready.wait(30)
    mine = bc.submit_call("bsleep", rows(1, 61), pool="one", seconds=1.0, cooperative=False)
    blocker.result(timeout=30)
    time.sleep(0.3)  # the call serving both runs
    os.kill(doomed.pid, signal.SIGKILL)
    doomed.join(30)
    x, meta = mine.result(timeout=30)
    np.testing.assert_array_equal(x, rows(1, 61))
    assert call_of(meta)[1] == 2  # the call served both clients
    time.sleep(0.5)  # past cancel_grace_ms: the worker was not stopped for the departed client
    assert sum(w["restarts"] for w in pool_status(bdaemon, "one")["workers"]) == restarts


def test_the_status_shows_each_ops_batching(bdaemon):
    st = pool_status(bdaemon, "one")
    assert st["python"]["batching"]["bmlp"] == {"max_batch_size": 64, "max_queue_delay_us": 2000}
    assert "umlp" not in st["python"]["batching"]


def test_bad_batching_arguments_are_refused():
    for kwargs, msg in [({"max_batch_size": 0}, "max_batch_size"),
                        ({"max_batch_size": 1.5}, "max_batch_size"),
                        ({"max_batch_size": 4, "max_queue_delay_us": -1}, "max_queue_delay_us"),
                        ({"max_batch_size": 4, "max_queue_delay_us": 2_000_000},
                         "max_queue_delay_us")]:
        with pytest.raises(ValueError, match=msg):
            gpuq.op("some_op", **kwargs)
