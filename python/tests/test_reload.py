"""Config reload (``gpuqctl reload``, SIGHUP, ``gpuq.reload_config``; docs/design/live_changes.md)
with a real gpuqd and real Python workers: while 32 client processes call a Python pool without
pause, a reload points the pool at a new version of its module (the pool is rolled: every call
answered, none failed, answers switch to the new version), adds a pool (a client connected
before calls it) and removes another (its callers get UnknownPool once it is gone, never an
answer after its drain); the same with a spare as the rollout's seat. A reload that asks for what cannot change live, a file that does not parse, and a
new version that does not import are refused, and the daemon serves on unchanged. SIGHUP and
gpuqctl do the same."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

import gpuq
import gpuq.testing

CLIENTS = int(os.environ.get("GPUQ_TEST_RELOAD_CLIENTS", "32"))

MODULE = '''
import os, gpuq

VERSION = {version}
{extra}

@gpuq.op("version")
def version(x=0):
    return {{"version": VERSION, "pid": os.getpid(), "x": x}}
'''


def write_module(directory: pathlib.Path, version: int, extra: str = "") -> pathlib.Path:
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "relmod.py.tmp"
    tmp.write_text(MODULE.format(version=version, extra=extra))
    os.replace(tmp, directory / "relmod.py")
    return directory


def pool(name, directory, workers=2, **extra):
    return {"name": name, "kind": "cpu", "workers": workers, "cpus": [0, 1],
            "python": {"interpreter": sys.executable, "modules": ["relmod"],
                       "path": [str(directory)], "env": {"PYTHONDONTWRITEBYTECODE": "1"}},
            **extra}


def pool_status(daemon, name):
    return next(p for p in daemon.status()["pools"] if p["name"] == name)


def _caller(runtime_dir, index, pool_name, stop, started, out):
    """Calls `version` on `pool_name` until told to stop, or until the pool is gone (an
    UnknownPool ends a removed pool's caller); reports (pool, calls, failures, versions seen,
    answers after UnknownPool)."""
    calls, failures, seen, gone, after_gone = 0, [], [], False, 0
    try:
        with gpuq.connect(runtime_dir, name=f"reload-client-{index}") as c:
            while not stop.is_set():
                try:
                    r = c.call("version", calls, pool=pool_name, timeout=60)
                    assert r["x"] == calls
                    after_gone += gone
                    if not seen:
                        started.put(index)
                    if not seen or seen[-1] != r["version"]:
                        seen.append(r["version"])
                except gpuq.UnknownPool:
                    gone = True
                    time.sleep(0.01)
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    failures.append(repr(e))
                calls += 1
    except BaseException as e:  # noqa: BLE001
        failures.append(repr(e))
    out.put((pool_name, calls, failures, seen, gone, after_gone))


@contextlib.contextmanager
def callers(runtime_dir, names):
    """One client process per name in `names`, each calling `version` on that pool without
    pause (_caller); the block runs once every one has had an answer. Yields the list that gets
    their reports, one per process, when the block ends."""
    ctx = mp.get_context("spawn")
    stop, started, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_caller, args=(runtime_dir, i, n, stop, started, out))
             for i, n in enumerate(names)]
    for p in procs:
        p.start()
    results = []
    try:
        for _ in procs:  # every client has had an answer: the block comes mid-stream
            started.get(timeout=120)
        yield results
    finally:
        stop.set()
        results.extend(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(60)


@pytest.mark.parametrize("seat", ["surge", "spare"])
def test_a_reload_rolls_one_pool_and_removes_another_under_load(tmp_path, seat):
    v1 = write_module(tmp_path / "v1", 1)
    v2 = write_module(tmp_path / "v2", 2)
    extra = {"spare_workers": 1, "rollout_surge_workers": 0} if seat == "spare" else {}
    before = {"pools": [pool("py", v1, **extra), pool("old", v1, workers=1)]}
    after = {"pools": [pool("py", v2, **extra), pool("new", v2, workers=1)]}
    with gpuq.testing.Daemon(before) as d:
        with callers(d.runtime_dir, ["py"] * CLIENTS + ["old"] * 4) as results:
            with gpuq.connect(d.runtime_dir, name="reload-checker") as c:
                assert {p["name"] for p in c.pools} == {"py", "old"}
                lines = d.reload(after)
                assert "pool py: python.path changed: rolling restart" in lines, lines
                assert any(line.startswith("pool old: removed") for line in lines), lines
                assert "pool new: added, 1 workers" in lines, lines
                # The added pool serves this client, connected before it existed.
                assert c.call("version", pool="new")["version"] == 2
                assert pool_status(d, "new")["status"] == "ready"
                # The rollout has ended: only the new version answers.
                for _ in range(20):
                    assert c.call("version", pool="py")["version"] == 2
                # The removed pool drains, then its workers stop; it is no longer offered.
                deadline = time.monotonic() + 60
                while pool_status(d, "old")["reason"] != "removed by a config reload":
                    assert time.monotonic() < deadline, pool_status(d, "old")
                    time.sleep(0.05)
                assert pool_status(d, "old")["status"] == "removed"
                with pytest.raises(gpuq.UnknownPool):
                    c.call("version", pool="old")
                assert {p["name"] for p in c.pools} == {"py", "new"}
                assert pool_status(d, "py")["generation"] == 2
                time.sleep(0.5)
    failures = [(n, f) for n, _, fs, _, _, _ in results for f in fs]
    assert not failures, failures[:5]
    for name, calls, _, seen, gone, after_gone in results:
        assert calls > 0
        if name == "py":
            assert not gone and seen[-1] == 2, seen
        else:
            # Answered by version 1 until removed, then UnknownPool only: never an answer after.
            assert gone and seen == [1] and after_gone == 0


@pytest.mark.parametrize("seat", ["surge", "spare"])
def test_a_reload_resizes_a_pool_under_load(tmp_path, seat):
    """A cpu pool grows to its max_workers and shrinks back while clients call it: every call
    answered; the new workers serve; the retired ones end their job and their entries go
    dormant (no spare takes their place)."""
    v1 = write_module(tmp_path / "v1", 1)
    extra = {"spare_workers": 1, "rollout_surge_workers": 0} if seat == "spare" else {}

    def cfg(workers):
        return {"pools": [pool("py", v1, workers=workers, max_workers=3, **extra)]}

    with gpuq.testing.Daemon(cfg(1)) as d:
        with callers(d.runtime_dir, ["py"] * (CLIENTS // 2)) as results:
            with gpuq.connect(d.runtime_dir, name="resize-checker") as c:
                assert d.reload(cfg(3)) == ["pool py: workers changed, in effect now (3 workers)"]
                deadline = time.monotonic() + 120
                while pool_status(d, "py")["workers_ready"] != 3:
                    assert time.monotonic() < deadline, pool_status(d, "py")
                    time.sleep(0.05)
                pids = {c.call("version", i, pool="py")["pid"] for i in range(200)}
                assert len(pids) >= 2, pids  # the new workers serve
                d.reload(cfg(1))
                while True:
                    st = pool_status(d, "py")
                    if st["workers_total"] == 1 and len(st["workers"]) == 1 + bool(extra):
                        break
                    assert time.monotonic() < deadline, st
                    time.sleep(0.05)
                assert st["workers_ready"] == 1
                if extra:
                    assert st["spares_total"] == 1 and st["spare_promotions"] == 0
                assert c.call("version", pool="py")["version"] == 1
    failures = [f for _, _, fs, _, _, _ in results for f in fs]
    assert not failures, failures[:5]
    assert all(calls > 0 for _, calls, _, _, _, _ in results)


def test_a_reload_moves_a_pool_to_other_cpus(tmp_path):
    """New cpus: a rollout starts the new workers there; once it returns, every worker (and
    its process's affinity) is on them."""
    v1 = write_module(tmp_path / "v1", 1)
    with gpuq.testing.Daemon({"pools": [pool("py", v1, cpus=[0])]}) as d:
        with gpuq.connect(d.runtime_dir) as c:
            lines = d.reload({"pools": [pool("py", v1, cpus=[1])]})
            assert lines == ["pool py: cpus changed: rolling restart"], lines
            st = pool_status(d, "py")
            assert st["generation"] == 2
            for w in st["workers"]:
                assert w["cpus"] == [1], st["workers"]
                assert os.sched_getaffinity(w["pid"]) == {1}
            assert c.call("version", pool="py")["version"] == 1


def test_the_default_pool_removed_a_call_naming_none_goes_to_the_new_default(tmp_path):
    """A job that names no pool goes to the first pool the daemon offers (a Python op's: the
    first Python pool that has it). When a reload removes that pool, such jobs from a client
    connected before go to the next one, although the client's view still names the removed
    pool: never UnknownPool for a pool the caller did not name. A job that names the removed
    pool gets it."""
    v = [write_module(tmp_path / f"v{i}", i) for i in (1, 2, 3)]
    pools = [pool(name, v[i], workers=1) for i, name in enumerate(("first", "second", "third"))]
    with gpuq.testing.Daemon({"pools": pools}) as d:
        with gpuq.connect(d.runtime_dir) as c:
            assert c.call("version")["version"] == 1
            c.submit("noop").result(30)  # a built-in op, to the default pool
            d.reload({"pools": pools[1:]})
            # The client's view of which pool has the op still says "first" (kept 5 s: made
            # fresh here, so that a slow machine does not let it expire first).
            c._py_pools = (time.monotonic(), c._py_pools[1])
            c.submit("noop").result(30)
            for i in range(20):
                assert c.call("version", i)["version"] == 2
            with pytest.raises(gpuq.UnknownPool, match="'first'"):
                c.call("version", pool="first")
            d.reload({"pools": pools[2:]})
            c._py_pools = (time.monotonic(), c._py_pools[1])
            assert [p["name"] for p in c._py_pools[1]] == ["second", "third"]
            assert asyncio.run(c.acall("version"))["version"] == 3
            assert [p["name"] for p in c.pools] == ["third"]


def test_what_cannot_change_live_is_refused_and_nothing_changes(tmp_path):
    v1 = write_module(tmp_path / "v1", 1)
    bad = write_module(tmp_path / "bad", 2, extra="raise RuntimeError('the weights file is missing')")
    def cfg(*pools, **keys):  # added_pool_workers pinned: the same on any machine
        return {"added_pool_workers": 4, "pools": list(pools), **keys}

    with gpuq.testing.Daemon(cfg(pool("py", v1))) as d:
        with gpuq.connect(d.runtime_dir) as c:
            with pytest.raises(gpuq.InvalidArgument, match=r"queue_factor \(it sizes"):
                d.reload(cfg(pool("py", v1), queue_factor=4))
            with pytest.raises(gpuq.InvalidArgument, match=r"pools\[py\]\.workers \(more than"):
                d.reload(cfg(pool("py", v1, workers=3)))
            with pytest.raises(gpuq.InvalidArgument, match=r"pools\[big\] \(a new pool: 6 worker entries.*added_pool_workers, 4"):
                d.reload(cfg(pool("py", v1), pool("big", v1, workers=4, spare_workers=1)))
            with pytest.raises(gpuq.InvalidArgument,
                               match=r"pools\[0\]\.job_time_limit_ms.*; nothing changed"):
                d.reload(cfg(pool("py", v1, job_time_limit_ms="soon")))
            assert c.call("version", pool="py")["version"] == 1
            st = pool_status(d, "py")
            assert st["generation"] == 1 and st["job_time_limit_ms"] is None
            # A new version that does not import: refused, the old one serves, the pool's
            # settings are back, so the same file reloads once mended.
            with pytest.raises(gpuq.WorkerDied, match="the weights file is missing"):
                d.reload(cfg(pool("py", bad)))
            for _ in range(10):
                assert c.call("version", pool="py")["version"] == 1
            # A new pool whose module does not import is not added.
            with pytest.raises(gpuq.WorkerDied, match="pool extra not added"):
                d.reload(cfg(pool("py", v1), pool("extra", bad)))
            assert [p["name"] for p in d.status()["pools"]] == ["py"]
            with pytest.raises(gpuq.UnknownPool):
                c.call("version", pool="extra")
            write_module(bad, 3)
            lines = d.reload(cfg(pool("py", bad)))
            assert "pool py: python.path changed: rolling restart" in lines
            assert c.call("version", pool="py")["version"] == 3
            assert d.reload(cfg(pool("py", bad))) == ["nothing changed"]


def test_sighup_and_gpuqctl_reload(tmp_path):
    v1 = write_module(tmp_path / "v1", 1)
    with gpuq.testing.Daemon({"pools": [pool("py", v1)]}) as d:
        path = os.path.join(d.tmp, "gpuqd.json")
        pathlib.Path(path).write_text(
            '{"cancel_grace_ms": 500, "pools": [' + _json(pool("py", v1, job_time_limit_ms=900)) + "]}")
        d.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while pool_status(d, "py")["job_time_limit_ms"] != 900:
            assert time.monotonic() < deadline, d.log()[-2000:]
            time.sleep(0.05)
        assert "config reload: pool py: job_time_limit_ms changed, in effect now" in d.log()
        gpuqctl = str(pathlib.Path(gpuq.testing.find_gpuqd()).parent.parent / "tools" / "gpuqctl")
        if not os.path.exists(gpuqctl):
            pytest.skip(f"{gpuqctl} not built")
        r = subprocess.run([gpuqctl, "--runtime-dir", d.runtime_dir, "reload"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout == "nothing changed\n", (r.stdout, r.stderr)
        pathlib.Path(path).write_text('{"max_clients": 300, "pools": [' + _json(pool("py", v1)) + "]}")
        r = subprocess.run([gpuqctl, "--runtime-dir", d.runtime_dir, "reload"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 1 and "max_clients" in r.stderr, (r.stdout, r.stderr)
        assert pool_status(d, "py")["job_time_limit_ms"] == 900  # nothing changed


def test_a_daemon_without_a_config_file_says_so():
    with gpuq.testing.Daemon() as d:
        with pytest.raises(gpuq.InvalidArgument, match="without --config"):
            gpuq.reload_config(runtime_dir=d.runtime_dir)


def _json(value) -> str:
    import json

    return json.dumps(value)
