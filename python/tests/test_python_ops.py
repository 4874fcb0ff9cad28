"""Python pools (docs/python.md, "Python ops"): a real gpuqd whose Python workers run the ops of
python/tests/pyops/pyops_mod.py in this test's own interpreter (sys.executable), on CPUs."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import pathlib
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
OPS_DIR = str(HERE / "pyops")
sys.path.insert(0, OPS_DIR)
import pyops_helpers  # noqa: E402 - a module the workers import too (python.path)


def python_pool(name="py", workers=2, modules=("pyops_mod",), **extra):
    py = {"interpreter": sys.executable, "modules": list(modules), "path": [OPS_DIR],
          "env": {"GPUQ_TEST_ENV": "yes"}}
    py.update(extra)
    return {"name": name, "kind": "cpu", "workers": workers, "python": py}


CONFIG = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1},
                    python_pool(),
                    python_pool("pycall", workers=1, allow_callables=True)],
          "restart_backoff_initial_ms": 10, "cancel_grace_ms": 500}


@pytest.fixture(scope="module")
def pydaemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture
def pc(pydaemon):
    with gpuq.connect(pydaemon.runtime_dir, name="pytest-python") as c:
        yield c


def pool_status(daemon, name):
    return next(p for p in daemon.status()["pools"] if p["name"] == name)


def wait_ready(daemon, name, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        p = pool_status(daemon, name)
        if p["status"] == "ready":
            return p
        time.sleep(0.05)
    raise AssertionError(f"pool {name} not ready: {pool_status(daemon, name)}")


# ---- registration -------------------------------------------------------------------------------


def test_ops_are_registered_and_listed(pc, pydaemon):
    assert {"double", "identity", "stats", "python_call"} <= set(pc.ops)
    st = pool_status(pydaemon, "py")
    assert st["worker_spin_us"] == 300  # a Python pool's default
    assert pool_status(pydaemon, "cpu")["worker_spin_us"] == 50
    assert st["python"]["modules"] == ["pyops_mod"]
    assert st["python"]["allow_callables"] is False
    assert "double" in st["python"]["ops"] and "python_call" in st["python"]["ops"]
    w = st["workers"][0]
    assert w["backend"]["allow_callables"] is False and "double" in w["backend"]["ops"]


def test_worker_environment_pinning_and_on_start(pc, pydaemon):
    seen = {}
    for _ in range(20):
        r = pc.call("whoami")
        seen[r["worker"]] = r
    st = pool_status(pydaemon, "py")
    ids = {w["id"] for w in st["workers"]}
    for wid, r in seen.items():
        assert wid in ids
        assert r["pool"] == 1
        assert r["cuda_visible_devices"] == "-1"  # a CPU pool never sees a GPU
        assert r["env"] == "yes"                  # python.env
        assert r["started"] == 1                  # on_start ran once, before ready
        w = next(w for w in st["workers"] if w["id"] == wid)
        assert w["pid"] == r["pid"]
        assert os.sched_getaffinity(r["pid"]) == set(w["cpus"])


# ---- arrays in and out --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.uint16, np.int64,
                                   np.complex64, np.bool_])
def test_arrays_keep_dtype_and_shape(pc, dtype):
    x = (np.arange(24) % 2 if dtype is np.bool_ else np.arange(24)).astype(dtype).reshape(2, 3, 4)
    y = pc.call("identity", x)
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(y, x)
    assert not pc.in_segment(y)  # an answer of at most 64 KiB is read from a private copy


def test_params_and_several_arrays(pc):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(pc.call("double", a, factor=3), a * 3)
    np.testing.assert_array_equal(pc.call("double", a), a * 2)  # the default
    b = pc.array(a)  # in the segment: passed in place
    np.testing.assert_array_equal(pc.call("add", a, b), a + b)
    np.testing.assert_array_equal(pc.call("add", a, b=b), a + b)  # an array as a keyword
    # A non-contiguous array is copied in contiguous.
    big = np.arange(40, dtype=np.int32).reshape(5, 8)
    np.testing.assert_array_equal(pc.call("identity", big[:, ::2]), big[:, ::2])
    assert pc.call("kwargs", n=1, s="text", f=0.5, l=[1, 2], d={"k": None}) == \
        {"n": 1, "s": "text", "f": 0.5, "l": [1, 2], "d": {"k": None}}


def test_results_tuple_scalar_none(pc):
    x = np.array([1.0, 5.0, 3.0], dtype=np.float32)
    mean, mx, seven = pc.call("stats", x)
    assert mean == pytest.approx(3.0) and mean.dtype == np.float32
    assert mx == 5.0 and seven == 7 and seven.dtype == np.int32
    assert pc.call("nothing") is None


def test_input_views_are_read_only(pc):
    with pytest.raises(gpuq.OpFailed, match="read-only"):
        pc.call("write_input", np.zeros(4))


def test_result_larger_than_output_bytes(pc):
    with pytest.raises(gpuq.InvalidArgument, match="output_bytes=") as e:
        pc.call("big", 1 << 20)
    assert e.value.needed > 1 << 20
    assert pc.call("big", 1 << 20, output_bytes=e.value.needed).shape == (1 << 20,)


def test_bad_arguments_fail_before_submitting(pc):
    with pytest.raises(gpuq.InvalidArgument, match="JSON"):
        pc.call("kwargs", x=object())
    with pytest.raises(gpuq.UnknownOp, match="no Python pool"):
        pc.call("no_such_op")
    with pytest.raises(gpuq.InvalidArgument, match="output_bytes"):
        pc.call("identity", np.zeros(2), output_bytes=1)


def test_python_op_on_another_pool_is_refused(pc):
    with pytest.raises(gpuq.UnknownOp, match="not an op of this worker's pool"):
        pc.call("identity", np.zeros(2), pool="cpu")


def test_builtin_ops_run_on_python_pools(pc):
    assert pc.submit("noop", pool="py").result() == 0
    assert pc.submit("sleep", pool="py", us=10).result() == 10
    with pytest.raises(gpuq.UnknownOp, match="not an op of Python pools"):
        pc.run("conv2d", np.zeros(4, np.float32), pool="py")


# ---- failures -----------------------------------------------------------------------------------


def test_exception_carries_type_message_and_traceback(pc):
    with pytest.raises(gpuq.OpFailed) as e:
        pc.call("fail", msg="bad input 42")
    err = e.value
    assert "ValueError: bad input 42" in str(err)
    assert err.remote_type == "ValueError"
    assert "pyops_mod.py" in err.remote_traceback and "raise ValueError(msg)" in \
        err.remote_traceback
    assert isinstance(err.__cause__, gpuq.RemoteTraceback)
    assert "_worker.py" not in err.remote_traceback  # the op's frames only
    assert pc.call("double", np.ones(2)).tolist() == [2.0, 2.0]  # the worker serves on


def test_memory_error_is_out_of_memory(pc):
    # docs/python.md, "Errors": an op's MemoryError ends its job OutOfMemory, not OpFailed.
    with pytest.raises(gpuq.OutOfMemory) as e:
        pc.call("oom", msg="cannot hold 64 GiB of scores")
    err = e.value
    assert isinstance(err, MemoryError) and err.code == gpuq.OutOfMemory.code
    assert str(err) == "oom: MemoryError: cannot hold 64 GiB of scores"
    assert err.remote_type == "MemoryError" and "raise MemoryError(msg)" in err.remote_traceback
    # A real allocation failure: numpy's own MemoryError subclass, with numpy's message.
    f = pc.submit_call("alloc", 1 << 62)
    with pytest.raises(gpuq.OutOfMemory, match=r"^alloc: _ArrayMemoryError: Unable to "
                                               r"allocate 4\.00 EiB") as e:
        f.result()
    assert e.value.remote_type.endswith("._exceptions._ArrayMemoryError")  # numpy's
    assert f.info.code == gpuq.OutOfMemory.code and f.info.status == "failed"
    assert pc.call("double", np.ones(2)).tolist() == [2.0, 2.0]  # the worker serves on


def test_a_callables_memory_error_is_out_of_memory(pc):
    with gpuq.Executor(client=pc) as ex:
        f = ex.submit(np.empty, 1 << 62, np.uint8)
        with pytest.raises(MemoryError, match="Unable to allocate 4.00 EiB") as e:
            f.result()
        # The exception itself, as ProcessPoolExecutor re-raises it; the job's code says
        # OutOfMemory (a gpuq.OutOfMemory is raised instead where it does not unpickle).
        assert type(e.value).__module__.startswith("numpy")
        assert f.info.code == gpuq.OutOfMemory.code


def test_cancel_reaches_the_op(pc):
    f = pc.submit_call("spin")
    time.sleep(0.3)
    assert f.running() or not f.done()
    assert f.cancel() is False and not f.done()  # concurrent.futures' cancel: it runs on
    f.stop()
    with pytest.raises(gpuq.Cancelled):
        f.result(timeout=10)


def test_interpreter_crash_is_worker_died_and_respawn(pc, pydaemon):
    before = {w["id"]: w["restarts"] for w in pool_status(pydaemon, "py")["workers"]}
    with pytest.raises(gpuq.WorkerDied, match="signal 6"):
        pc.call("crash")
    wait_ready(pydaemon, "py")
    after = {w["id"]: w["restarts"] for w in pool_status(pydaemon, "py")["workers"]}
    assert sum(after.values()) == sum(before.values()) + 1
    np.testing.assert_array_equal(pc.call("double", np.ones(3)), np.full(3, 2.0))


def test_time_limit_stops_a_blocked_op(pc, pydaemon):
    with pytest.raises(gpuq.TimedOut):
        pc.call("sleep_forever", time_limit=0.2)
    wait_ready(pydaemon, "py")


def test_import_error_makes_the_pool_unavailable():
    cfg = {"pools": [{"name": "cpu", "workers": 1},
                     python_pool("broken", workers=1, modules=["pyops_import_error"])]}
    with gpuq.testing.Daemon(cfg) as d:
        st = pool_status(d, "broken")
        assert st["status"] == "unavailable"
        assert "fails to import on purpose" in st["reason"]
        assert "Traceback" in st["start_error"] and "pyops_import_error.py" in st["start_error"]
        assert "fails to import on purpose" in d.log()
        with gpuq.connect(d.runtime_dir) as c:  # the other pools serve
            assert c.submit("noop", pool="cpu").result() == 0
            with pytest.raises(gpuq.NoDevice, match="fails to import"):
                c.submit("noop", pool="broken").result()


def worker_with_failures(daemon, name, at_least, every=False):
    """Polls the status until a worker of pool `name` (`every`: each of them) has failed to start
    `at_least` times in a row; returns the pool's status then."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        st = pool_status(daemon, name)
        if (all if every else any)(w["start_failures"] >= at_least for w in st["workers"]):
            return st
        time.sleep(0.02)
    raise AssertionError(f"no worker of {name} failed {at_least} times: {pool_status(daemon, name)}")


def test_failing_on_start_is_a_start_failure_and_jobs_fail_with_pool_down():
    down_ms = 1500
    cfg = {"pools": [{"name": "cpu", "workers": 1},
                     python_pool("badstart", workers=2, modules=["pyops_bad_start"])],
           "restart_backoff_initial_ms": 10, "restart_backoff_max_ms": 20,
           "max_start_failures": 2, "start_backoff_initial_ms": 200, "start_backoff_max_ms": 400,
           "pool_down_fail_ms": down_ms}
    with gpuq.testing.Daemon(cfg, wait_ready=False) as d:
        # A start has failed: the pool's clock runs; a job sent now gets PoolDown within
        # pool_down_fail_ms plus a second, not after its caller's own timeout.
        worker_with_failures(d, "badstart", 1)
        with gpuq.connect(d.runtime_dir) as c:
            t0 = time.monotonic()
            fut = c.submit_call("bad_start_op", pool="badstart")
            with pytest.raises(gpuq.PoolDown) as e:
                fut.result(timeout=60)
            took = time.monotonic() - t0
            assert took <= down_ms / 1000 + 1.0, took
            msg = str(e.value)
            assert msg.startswith(f"pool 'badstart' is down (no ready worker for {down_ms} ms): worker ")
            assert "before it was ready: RuntimeError: on_start fails on purpose" in msg
            assert fut.info.status == "failed" and fut.info.code == gpuq.PoolDown.code

            # New jobs fail at once while the pool stays down; the other pool serves.
            for _ in range(3):
                t1 = time.monotonic()
                with pytest.raises(gpuq.PoolDown, match="on_start fails on purpose"):
                    c.submit_call("bad_start_op", pool="badstart").result(timeout=60)
                assert time.monotonic() - t1 < 0.5
            assert c.submit("noop", pool="cpu").result() == 0

        # Failed (2), and tried again: never given up on.
        st = worker_with_failures(d, "badstart", 3, every=True)
        assert st["status"] == "down" and d.status()["ready"] is False
        assert st["failing_jobs"] is True and st["accepting"] is False
        assert "on_start fails on purpose" in st["failing_jobs_error"]
        assert st["unserved_ms"] >= down_ms
        for w in st["workers"]:
            assert w["start_failures"] >= 1
            assert "before it was ready" in w["last_exit"]
            assert "Traceback" in w["start_error"]
            assert "on_start fails on purpose" in w["start_error"]
        assert "on_start fails on purpose" in d.log()
        assert "marked failed, trying again in" in d.log()


def test_a_worker_whose_on_start_hangs_is_killed_at_its_start_timeout():
    cfg = {"pools": [{"name": "cpu", "workers": 1},
                     python_pool("hang", workers=1, modules=["pyops_hang_start"])],
           "start_timeout_ms": 1000, "pool_down_fail_ms": 500,
           "restart_backoff_initial_ms": 10, "restart_backoff_max_ms": 20}
    with gpuq.testing.Daemon(cfg, wait_ready=False) as d:
        st = worker_with_failures(d, "hang", 1)
        w = st["workers"][0]
        assert w["last_exit"] == \
            "did not report ready within 1000 ms (start_timeout_ms) and was killed"
        assert "on_start hangs on purpose" in w["start_error"]
        with gpuq.connect(d.runtime_dir) as c:
            with pytest.raises(gpuq.PoolDown, match="start_timeout_ms"):
                c.submit_call("hang_start_op", pool="hang").result(timeout=60)
            assert c.submit("noop", pool="cpu").result() == 0
        assert "has not reported ready 1000 ms after it was started" in d.log()


def test_a_pool_whose_on_start_fails_7_times_comes_back_by_itself(tmp_path):
    counter = tmp_path / "starts"
    cfg = {"pools": [{"name": "cpu", "workers": 1},
                     python_pool("flaky", workers=1, modules=["pyops_flaky_start"],
                                 env={"GPUQ_TEST_START_COUNTER": str(counter),
                                      "GPUQ_TEST_START_FAILS": "7"})],
           "restart_backoff_initial_ms": 10, "restart_backoff_max_ms": 20,
           "max_start_failures": 3, "start_backoff_initial_ms": 100, "start_backoff_max_ms": 200,
           "pool_down_fail_ms": 0}  # 0: the job below waits for the pool instead of failing
    with gpuq.testing.Daemon(cfg, wait_ready=False) as d:
        with gpuq.connect(d.runtime_dir) as c:
            fut = c.submit_call("flaky_start_op", np.ones(3), pool="flaky")  # waits for it
            st = worker_with_failures(d, "flaky", 4)  # failed (3), and tried again
            assert st["workers"][0]["state"] in ("failed", "starting")
            assert "on_start fails on purpose" in st["workers"][0]["start_error"]
            np.testing.assert_array_equal(fut.result(timeout=120), np.full(3, 2.0))
        st = wait_ready(d, "flaky", timeout=60)
        w = st["workers"][0]
        assert w["state"] == "ready" and w["start_failures"] == 0
        assert w["next_start_ms"] is None and "start_error" not in w
        assert w["restarts"] == 7
        assert counter.read_text().count("start") == 8  # 7 failures, then the start that held
        assert d.status()["ready"] is True
        assert "failed to start 7 times in a row: marked failed" in d.log()


def test_bad_python_config_is_refused(tmp_path):
    for py, why in [({"modules": []}, "at least one module"),
                    ({"modules": ["a b"]}, "not a module name"),
                    ({"modules": ["m"], "path": ["rel"]}, "absolute path"),
                    ({"modules": ["m"], "env": {"CUDA_VISIBLE_DEVICES": "0"}}, "set by gpuqd"),
                    ({"modules": ["m"], "allow_callables": "yes"}, "true or false"),
                    ({"modules": ["m"], "venv": "/v", "interpreter": "/p"}, "not both"),
                    ({"modules": ["m"], "colour": 1}, "unknown key"),
                    ({}, "modules: is required")]:
        cfg = {"pools": [{"name": "p", "workers": 1, "python": py}]}
        with pytest.raises(RuntimeError, match=why):
            gpuq.testing.Daemon(cfg).start()


def test_missing_interpreter_makes_the_pool_unavailable():
    cfg = {"pools": [{"name": "cpu", "workers": 1},
                     {"name": "nopy", "workers": 1,
                      "python": {"interpreter": "/nonexistent/python3", "modules": ["m"]}}]}
    with gpuq.testing.Daemon(cfg) as d:
        st = pool_status(d, "nopy")
        assert st["status"] == "unavailable" and "not an executable" in st["reason"]


# ---- callables: gpuq.Executor and joblib ---------------------------------------------------------


def test_callables_are_refused_by_default(pc):
    with gpuq.Executor(pool="py", client=pc) as ex:
        with pytest.raises(gpuq.PermissionDenied, match="allow_callables"):
            ex.submit(pyops_helpers.scale, np.ones(2), 2).result()


def test_executor_runs_callables(pc):
    with gpuq.Executor(client=pc) as ex:
        assert ex.pool == "pycall"  # the first pool that allows them
        a = np.arange(1 << 16, dtype=np.float64)
        np.testing.assert_array_equal(ex.submit(pyops_helpers.scale, a, 2).result(), a * 2)
        assert ex.submit(lambda x, y=1: x + y, 1, y=5).result() == 6  # cloudpickle
        assert list(ex.map(abs, [-1, -2, 3])) == [1, 2, 3]
        with pytest.raises(ValueError, match="invalid literal") as e:
            ex.submit(int, "zz").result()
        # ProcessPoolExecutor's own cause class, as that executor makes it.
        assert type(e.value.__cause__) is concurrent.futures.process._RemoteTraceback
        fs = [ex.submit(pow, i, 2) for i in range(20)]
        assert sorted(f.result() for f in concurrent.futures.as_completed(fs)) == \
            [i * i for i in range(20)]


def test_ten_thousand_calls_held_before_any_is_read(pc):
    # Each call's block has room for a 64 KiB answer: 10,000 of them would take 640 MiB of the
    # 64 MiB segment. The calls that have ended give theirs back when a submit needs the room.
    x = np.arange(4.0)
    fs = [pc.submit_call("double", x, factor=i % 7) for i in range(10_000)]
    for i, f in enumerate(fs):
        np.testing.assert_array_equal(f.result(timeout=120), x * (i % 7))


def test_ten_thousand_calls_awaited_together(pc):
    async def main():
        return await asyncio.gather(*(pc.submit_call("kwargs", i=i) for i in range(10_000)))
    assert [r["i"] for r in asyncio.run(main())] == list(range(10_000))


def test_ten_thousand_executor_futures_held(pc):
    with gpuq.Executor(client=pc) as ex:
        fs = [ex.submit(abs, -i) for i in range(10_000)]
        assert [f.result(timeout=120) for f in fs] == list(range(10_000))


def test_small_answers_hold_no_segment_and_a_full_segment_says_why(pydaemon):
    with gpuq.connect(pydaemon.runtime_dir, segment_bytes=4 << 20) as c:
        # Small results are private copies: holding many keeps no block.
        kept = [c.call("double", np.ones(8), factor=i) for i in range(200)]
        assert all(r.base is None or not c.in_segment(r) for r in kept)
        # Large ones are views of their blocks: held, they fill the segment, and a call that
        # no pending call can make room for fails at once, saying what is free.
        held = [c.call("big", 1 << 20, output_bytes=(1 << 20) + 4096) for _ in range(3)]
        assert all(c.in_segment(r) for r in held)
        with pytest.raises(gpuq.OutOfMemory, match=r"bytes free, the largest run \d+"):
            c.call("big", 1 << 20, output_bytes=(1 << 20) + 4096, timeout=5)
        del held
        assert c.call("big", 1 << 20, output_bytes=(1 << 20) + 4096).shape == (1 << 20,)


def test_segment_room_under_a_random_mix_of_calls(pydaemon):
    """1 MiB and 64 MiB calls, @op and Executor, arrays in and out of the segment, at most 2
    in flight, over a 512 MiB segment, for a minute (GPUQ_TEST_SEGMENT_MIX_S): never
    OutOfMemory, every result right. (Up to 2 x 192 MiB is in use at once: a 64 MiB argument
    in the segment and a 128 MiB block holding a copied-in one and the answer's room.)"""
    duration = float(os.environ.get("GPUQ_TEST_SEGMENT_MIX_S", "60"))
    rng = np.random.default_rng(int(time.time()))
    sizes = (1 << 20, 64 << 20)
    calls = 0
    with gpuq.connect(pydaemon.runtime_dir, segment_bytes=512 << 20) as c, \
            gpuq.Executor(client=c) as ex:
        inflight: "collections.deque" = collections.deque()
        end = time.monotonic() + duration
        while time.monotonic() < end or inflight:
            if time.monotonic() < end:
                n = int(rng.choice(sizes)) // 8
                x = c.empty(n, np.float64) if rng.random() < 0.5 else np.empty(n)
                x[0], x[-1] = calls, -calls
                how = int(rng.integers(3))
                if how == 0:
                    f = c.submit_call("identity", x, output_bytes=x.nbytes + (64 << 10))
                elif how == 1:
                    f = c.submit_call("stats", x)  # a small answer
                else:
                    f = ex.submit(pyops_helpers.ends, x)
                inflight.append((f, how, calls))
                del x, f  # the future keeps its arguments while the job may use them
                calls += 1
            while len(inflight) >= 2 or (inflight and time.monotonic() >= end):
                f, how, k = inflight.popleft()
                r = f.result(timeout=120)
                if how == 0:
                    assert (r[0], r[-1]) == (k, -k)
                elif how == 1:
                    assert r is not None
                else:
                    assert r == (k, -k)
                del f, r  # a result read is let go, as a loop over calls does
    assert calls > 10


def test_executor_arguments_are_private_copies(pc):
    a = pc.array(np.zeros(4))
    with gpuq.Executor(client=pc) as ex:
        def bump(x):
            x += 1  # writable, as in a ProcessPoolExecutor
            return x
        np.testing.assert_array_equal(ex.submit(bump, a).result(), np.ones(4))
    np.testing.assert_array_equal(a, np.zeros(4))  # the caller's array is untouched


def test_executor_max_pending_and_shutdown(pc):
    ex = gpuq.Executor(client=pc, max_pending=2)
    fs = [ex.submit(time.sleep, 0.05) for _ in range(6)]
    ex.shutdown(wait=True)
    assert all(f.done() for f in fs)
    with pytest.raises(RuntimeError, match="shutdown"):
        ex.submit(abs, 1)


def test_executor_lets_go_of_what_its_tasks_returned(pydaemon):
    # A large result is a view of its task's block: once the caller drops it the block goes
    # back, however many tasks the executor has run (it keeps no finished future).
    with gpuq.connect(pydaemon.runtime_dir, segment_bytes=16 << 20) as c, \
            gpuq.Executor(client=c) as ex:
        x = np.ones(1 << 17)  # 1 MiB: its copy and the answer's room take 2 MiB a task
        for i in range(60):
            r = ex.submit(pyops_helpers.scale, x, i).result(timeout=60)
            assert r[0] == i and c.in_segment(r)
            del r


def test_executor_shutdown_waits_for_tasks_whose_futures_were_dropped(pc, tmp_path):
    ex = gpuq.Executor(client=pc)
    paths = [tmp_path / f"done-{i}" for i in range(3)]
    for p in paths:
        ex.submit(lambda p: (time.sleep(0.2), open(p, "w").close()) and None, str(p))
    ex.shutdown(wait=True)
    assert all(p.exists() for p in paths)


def test_joblib_backend(pc, pydaemon, monkeypatch):
    joblib = pytest.importorskip("joblib")
    monkeypatch.setenv("GPUQ_RUNTIME_DIR", pydaemon.runtime_dir)
    with joblib.parallel_backend("gpuq", pool="pycall"):
        out = joblib.Parallel(n_jobs=4)(joblib.delayed(pyops_helpers.scale)(np.full(3, i), 2)
                                        for i in range(10))
    assert [o.tolist() for o in out] == [[2 * i] * 3 for i in range(10)]
    # joblib runs the calls in the caller when its backend reports one job: this one never
    # does, so n_jobs=1 (and a one-worker pool) still runs them in the pool's worker.
    with joblib.parallel_backend("gpuq", pool="pycall"):
        pids = set(joblib.Parallel(n_jobs=1)(joblib.delayed(os.getpid)() for _ in range(4)))
    worker_pids = {w["pid"] for w in pool_status(pydaemon, "pycall")["workers"]}
    assert pids <= worker_pids and os.getpid() not in pids


# ---- hostile and unusual input --------------------------------------------------------------------


def _raw_job(pc, header_bytes, pool="py", op="identity"):
    """A Python-op job with a header written by hand (what a hostile client could send)."""
    conn = pc._c()
    block = pc.empty(len(header_bytes) + 4096, np.uint8)
    block[:len(header_bytes)] = np.frombuffer(header_bytes, np.uint8)
    off = pc._offset(conn, block)
    job = conn.native.submit(op, off, len(header_bytes), off + len(header_bytes), 4096,
                             [("py.h", 0), ("py.n", len(header_bytes))],
                             gpuq._native.JobOptions(pool))
    return gpuq.Future(job, [block], None, conn.watcher)


@pytest.mark.parametrize("name", ["json header", "counts past the end", "unknown tag",
                                  "huge dimensions", "65 dimensions", "offset past the buffer",
                                  "object dtype", "bytes past the buffer", "bad JSON"])
def test_crafted_headers_fail_only_their_job(pc, name):
    # Headers a hostile client could write (test_codec.BAD): the job fails InvalidArgument at
    # once, and the worker goes on serving.
    from test_codec import BAD
    t0 = time.monotonic()
    with pytest.raises(gpuq.InvalidArgument, match="identity: "):
        _raw_job(pc, BAD[name]).result(timeout=30)
    assert time.monotonic() - t0 < 5
    np.testing.assert_array_equal(pc.call("identity", np.arange(3)), np.arange(3))


def test_a_job_without_a_header_fails_alone(pc):
    conn = pc._c()
    block = pc.empty(4096, np.uint8)
    off = pc._offset(conn, block)
    job = conn.native.submit("identity", off, 64, off + 64, 1024, [],
                             gpuq._native.JobOptions("py"))
    with pytest.raises(gpuq.InvalidArgument, match="lack py.h and py.n"):
        gpuq.Future(job, [block], None, conn.watcher).result(timeout=30)


def test_structured_dtypes_both_ways(pc):
    many = np.zeros(4, dtype=[(f"field_{i}", "<f8") for i in range(12)])
    many["field_3"] = [1, 2, 3, 4]
    back = pc.call("identity", many)
    assert back.dtype == many.dtype
    np.testing.assert_array_equal(back["field_3"], [1, 2, 3, 4])
    nested = np.zeros(2, dtype=[("a", [("x", "<i4"), ("y", "<f4", (2,))]), ("b", "u1")])
    nested["a"]["y"] = [[1, 2], [3, 4]]
    back = pc.call("identity", nested)
    assert back.dtype == nested.dtype
    np.testing.assert_array_equal(back["a"]["y"], [[1, 2], [3, 4]])


def test_a_module_that_prints_at_import_still_lists_its_ops(pydaemon):
    # pyops_mod prints at import; its pool is available and has its ops.
    assert pool_status(pydaemon, "py")["status"] == "ready"
    assert "pyops_mod: imported" in pydaemon.log()
