"""gpuq.Executor and the joblib backend keep concurrent.futures' and joblib's contracts
(docs/python.md, "gpuq.Executor"): submit never blocks, cancel leaves running calls alone,
initializers, pickling errors in the future, SystemExit as an outcome, work finished at exit,
nested gpuq. The peers' own suites run in tests/compat; these are gpuq's own checks of the same
promises, some of which those suites cannot make (a script that imports gpuq by name)."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pathlib
import subprocess
import sys
import textwrap
import time

import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
OPS_DIR = str(HERE / "pyops")
sys.path.insert(0, OPS_DIR)
import pyops_helpers  # noqa: E402 - a module the workers import too (python.path)

# Two workers, a ring of 2 x 2 jobs: a few sleeps fill it.
CONFIG = {"pools": [{"name": "py", "kind": "cpu", "workers": 2,
                     "python": {"interpreter": sys.executable, "path": [OPS_DIR],
                                "allow_callables": True}}],
          "queue_factor": 2, "client_queue_share": 1.0, "restart_backoff_initial_ms": 10,
          "cancel_grace_ms": 500}


@pytest.fixture(scope="module")
def daemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture(autouse=True)
def env(daemon, monkeypatch):
    """gpuq.Executor() with no client finds this module's daemon, as a user's finds theirs."""
    monkeypatch.setenv("GPUQ_RUNTIME_DIR", daemon.runtime_dir)


@pytest.fixture
def ex(daemon):
    with gpuq.connect(daemon.runtime_dir) as c, gpuq.Executor(client=c) as e:
        yield e


def test_submit_never_blocks_on_a_full_queue_and_cancel_futures_cancels_the_rest(ex):
    fs = [ex.submit(time.sleep, 0.2) for _ in range(40)]  # the ring holds 4
    # submit returned before the tasks could run: a submit that waited for room would leave
    # at most the ring's 4 and the workers' 2 unfinished.
    assert sum(not f.done() for f in fs) >= 30
    ex.shutdown(wait=True, cancel_futures=True)
    cancelled = [f for f in fs if f.cancelled()]
    assert len(cancelled) >= 30
    assert all(f.done() and f.exception() is None for f in fs if not f.cancelled())


def test_a_backlogged_task_runs_and_its_future_works_with_wait_and_callbacks(ex):
    fs = [ex.submit(pyops_helpers.scale, i, 2) for i in range(30)]
    seen = []
    fs[-1].add_done_callback(lambda f: seen.append(f.result()))
    done, _ = concurrent.futures.wait(fs, timeout=60)
    assert len(done) == 30 and [f.result() for f in fs] == [2 * i for i in range(30)]
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [58]


def test_max_workers_bounds_tasks_in_the_daemon(daemon):
    with gpuq.Executor(max_workers=1) as e:
        spans = sorted(f.result(timeout=30) for f in
                       [e.submit(pyops_helpers.span, 0.05) for _ in range(4)])
    # One at a time, though the pool has two workers: no task started before the last ended.
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="max_workers must be greater than 0"):
        gpuq.Executor(max_workers=0)
    with pytest.raises(TypeError, match="max_workers must be an int"):
        gpuq.Executor(max_workers="2")
    with pytest.raises(ValueError, match="max_tasks_per_child"):
        gpuq.Executor(max_tasks_per_child=3)


def test_cancel_leaves_a_running_call_alone_and_stop_stops_it(ex):
    f = ex.submit(pyops_helpers.nap, 0.5)
    deadline = time.monotonic() + 10
    while not f.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert f.cancel() is False and not f.cancelled()
    assert f.result(timeout=10) == 0.5  # it ran to its end
    g = ex.submit(pyops_helpers.nap, 30)
    while not g.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    g.stop()
    with pytest.raises(gpuq.Cancelled):
        g.result(timeout=10)


def test_initializer_runs_once_per_worker_and_a_failing_one_breaks_the_executor(daemon):
    with gpuq.Executor(initializer=pyops_helpers.set_flag, initargs=("ready",)) as e:
        assert {e.submit(pyops_helpers.get_flag).result() for _ in range(6)} == {"ready"}
    with gpuq.Executor(initializer=pyops_helpers.fail) as e:
        with pytest.raises(concurrent.futures.BrokenExecutor, match="initializer raised"):
            e.submit(pyops_helpers.get_flag).result()
        with pytest.raises(concurrent.futures.BrokenExecutor):
            e.submit(pyops_helpers.get_flag)


def test_a_pickling_error_fails_the_future_not_submit(ex):
    f = ex.submit(id, pyops_helpers.Unpicklable())
    with pytest.raises(TypeError, match="cannot pickle"):
        f.result()


def test_sys_exit_is_the_task_outcome_and_the_worker_goes_on(ex, daemon):
    pid = ex.submit(os.getpid).result()
    with pytest.raises(SystemExit):
        ex.submit(sys.exit, 3).result()
    assert ex.submit(os.getpid).result() in {w["pid"] for p in daemon.status()["pools"]
                                             for w in p["workers"]}
    assert isinstance(pid, int)


def test_an_executor_inside_a_worker_of_its_pool_runs_its_tasks_there(ex):
    # Every worker runs a parent that submits to the same pool and waits: run in place, the
    # nested tasks cannot wait for busy workers.
    fs = [ex.submit(pyops_helpers.nested_executor, 5) for _ in range(4)]
    assert [f.result(timeout=60) for f in fs] == [(True, 15)] * 4


def test_a_worker_keeps_only_the_functions_a_client_reuses(daemon):
    # A callable pickled anew for each task (a partial, a joblib batch: it holds its data) is
    # unpickled for its task alone; a worker that kept it would hold every task's data.
    import functools
    with gpuq.Executor(max_workers=1) as e:
        for i in range(10):
            assert e.submit(functools.partial(pyops_helpers.with_tracked,
                                              pyops_helpers.Tracked()), i).result() == i
        assert e.submit(pyops_helpers.tracked_live).result() == 0


def test_worker_died_is_a_broken_process_pool():
    assert issubclass(gpuq.WorkerDied, concurrent.futures.process.BrokenProcessPool)


def test_manager_proxies_reach_tasks(ex):
    with multiprocessing.Manager() as m:
        d = m.dict()
        ex.submit(pyops_helpers.put, d, "k", 7).result(timeout=30)
        assert d["k"] == 7


def _script(daemon, body):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=daemon.env(),
                          capture_output=True, text=True, timeout=120)


def test_work_submitted_and_not_waited_for_is_finished_at_exit(daemon, tmp_path):
    done = tmp_path / "done"
    r = _script(daemon, f"""
        import sys, gpuq
        sys.path.insert(0, {OPS_DIR!r})
        import pyops_helpers
        ex = gpuq.Executor()
        for i in range(6):
            ex.submit(pyops_helpers.touch_after, {str(done)!r} + str(i), 0.2)
        """)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"done{i}" for i in range(6)]


def test_wait_at_exit_false_abandons_and_submit_after_exit_raises(daemon, tmp_path):
    r = _script(daemon, f"""
        import atexit, sys, gpuq
        sys.path.insert(0, {OPS_DIR!r})
        import pyops_helpers
        ex = gpuq.Executor(wait_at_exit=False)
        @atexit.register
        def late():
            try:
                ex.submit(id, 1)
            except RuntimeError as e:
                print("refused:", e)
        ex.submit(pyops_helpers.touch_after, {str(tmp_path / "late")!r}, 3.0)
        """)
    assert r.returncode == 0, r.stderr
    assert "refused: cannot schedule new futures after interpreter shutdown" in r.stdout
    assert not (tmp_path / "late").exists()


def test_joblib_parallel_is_reusable_after_an_exception_and_nested_gpuq_runs(daemon,
                                                                            monkeypatch):
    joblib = pytest.importorskip("joblib")
    monkeypatch.setenv("GPUQ_RUNTIME_DIR", daemon.runtime_dir)
    with joblib.Parallel(n_jobs=2, backend="gpuq") as p:
        with pytest.raises(ZeroDivisionError):
            p(joblib.delayed(pyops_helpers.divide)(1, x) for x in (1, 0, 2))
        assert p(joblib.delayed(pyops_helpers.divide)(6, x) for x in (1, 2, 3)) == [6, 3, 2]
    # Every worker runs an outer call that itself runs Parallel(backend="gpuq"): inside a
    # worker, that runs in the worker, so it cannot wait for the busy pool.
    out = joblib.Parallel(n_jobs=2, backend="gpuq")(
        joblib.delayed(pyops_helpers.nested_sum)(n) for n in (3, 4, 5, 6))
    assert out == [3, 6, 10, 15]
    with joblib.parallel_config(backend="gpuq", initializer=pyops_helpers.set_flag,
                                initargs=("joblib",)):
        assert set(joblib.Parallel(n_jobs=2)(
            joblib.delayed(pyops_helpers.get_flag)() for _ in range(4))) == {"joblib"}


def test_results_of_any_size(ex, daemon, monkeypatch):
    from gpuq import _spill
    before = set(os.listdir(_spill.folder()))
    # 32 MB: more than its 64 KiB answer room, fetched in four 8 MiB pieces, through a wait
    # in this thread, a done-callback (the watcher thread) and as_completed.
    big = ex.submit(pyops_helpers.ones, 4_000_000)
    seen = []
    other = ex.submit(pyops_helpers.ones, 300_000)
    other.add_done_callback(lambda f: seen.append(f.result().sum()))
    assert big.result(timeout=60).sum() == 4_000_000
    assert [f.result().shape for f in concurrent.futures.as_completed([other])] == [(300_000,)]
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [300_000]
    joblib = pytest.importorskip("joblib")
    monkeypatch.setenv("GPUQ_RUNTIME_DIR", daemon.runtime_dir)
    out = joblib.Parallel(n_jobs=2, backend="gpuq")(
        joblib.delayed(pyops_helpers.ones)(100_000 + i) for i in range(8))
    assert [len(o) for o in out] == [100_000 + i for i in range(8)]
    assert set(os.listdir(_spill.folder())) - before == set()  # every spill file fetched
