"""Rolling restarts (``gpuqctl restart POOL``, ``gpuq.restart_pool``; docs/design/live_changes.md)
with a real gpuqd and real Python workers: client processes call an op without pause while the
pool's module is changed and the pool rolled, again and again; every call is answered, none
fails, and once a rollout has returned every answer is the new version's (while it runs, old
and new workers both answer). A version whose
module does not import is refused, with its traceback, and the old workers serve on. The same
with a spare as the seat; a pool with no seat is told how to get one."""

from __future__ import annotations

import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import time

import pytest

import gpuq
import gpuq.testing

ROLLOUTS = int(os.environ.get("GPUQ_TEST_ROLLOUTS", "20"))
CLIENTS = int(os.environ.get("GPUQ_TEST_ROLLOUT_CLIENTS", "32"))

MODULE = '''
import os, gpuq

VERSION = {version}
{extra}

@gpuq.op("version")
def version(x=0):
    return {{"version": VERSION, "pid": os.getpid(), "x": x}}
'''


def write_module(directory: pathlib.Path, version: int, extra: str = "") -> None:
    # Written whole, then renamed in: a worker importing it meanwhile sees one version or the
    # other, never half a file.
    tmp = directory / "rollmod.py.tmp"
    tmp.write_text(MODULE.format(version=version, extra=extra))
    os.replace(tmp, directory / "rollmod.py")


def pool(directory: pathlib.Path, workers=2, **extra):
    return {"name": "py", "kind": "cpu", "workers": workers, "cpus": [0, 1],
            "python": {"interpreter": sys.executable, "modules": ["rollmod"],
                       "path": [str(directory)], "env": {"PYTHONDONTWRITEBYTECODE": "1"}},
            **extra}


def pool_status(daemon):
    return next(p for p in daemon.status()["pools"] if p["name"] == "py")


def _caller(runtime_dir, index, stop, out):
    """Calls `version` until told to stop; reports (calls, failures, versions seen in order)."""
    calls, failures, seen = 0, [], []
    try:
        with gpuq.connect(runtime_dir, name=f"rollout-client-{index}") as c:
            while not stop.is_set():
                try:
                    r = c.call("version", calls, pool="py", timeout=60)
                    assert r["x"] == calls
                    if not seen or seen[-1] != r["version"]:
                        seen.append(r["version"])
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    failures.append(repr(e))
                calls += 1
    except BaseException as e:  # noqa: BLE001
        failures.append(repr(e))
    out.put((index, calls, failures, seen))


def _roll_under_load(daemon, directory, rollouts):
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_caller, args=(daemon.runtime_dir, i, stop, out))
             for i in range(CLIENTS)]
    for p in procs:
        p.start()
    try:
        time.sleep(0.5)
        with gpuq.connect(daemon.runtime_dir, name="rollout-checker") as c:
            for v in range(2, rollouts + 2):
                write_module(directory, v)
                g = gpuq.restart_pool("py", runtime_dir=daemon.runtime_dir, timeout=120)
                assert g == pool_status(daemon)["generation"]
                # Every worker runs the new version now: the next answers are its.
                for _ in range(20):
                    assert c.call("version", pool="py")["version"] == v
    finally:
        stop.set()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(60)
    failures = [(i, f) for i, _, fs, _ in results for f in fs]
    assert not failures, failures[:5]
    assert all(calls > 0 for _, calls, _, _ in results)
    # While a rollout runs, old and new workers both answer (a client may see 1, 2, 1, 2);
    # once the last one has returned, only the last version does: every client ends on it.
    for _, _, _, seen in results:
        assert seen[-1] == rollouts + 1, seen
    return results


@pytest.mark.parametrize("seat", ["surge", "spare"])
def test_rollouts_under_load_answer_every_call(tmp_path, seat):
    write_module(tmp_path, 1)
    extra = {"spare_workers": 1, "rollout_surge_workers": 0} if seat == "spare" else {}
    with gpuq.testing.Daemon({"pools": [pool(tmp_path, **extra)]}) as d:
        _roll_under_load(d, tmp_path, ROLLOUTS)
        st = pool_status(d)
        assert st["generation"] == ROLLOUTS + 1
        assert st["rollout"]["state"] == "done" and st["rollout"]["completed"] == ROLLOUTS
        workers = [w for w in st["workers"] if w["role"] == "active"]
        assert len(workers) == 2 and all(w["generation"] == ROLLOUTS + 1 for w in workers)
        assert st["workers_ready"] == 2
        assert not any(w["role"] == "surge" for w in st["workers"])  # dormant again
        if seat == "spare":
            assert st["spares_total"] == 1


def test_a_version_that_does_not_import_is_refused_and_the_old_one_serves(tmp_path):
    write_module(tmp_path, 1)
    with gpuq.testing.Daemon({"pools": [pool(tmp_path)]}) as d:
        with gpuq.connect(d.runtime_dir) as c:
            assert c.call("version", pool="py")["version"] == 1
            write_module(tmp_path, 2, extra="raise RuntimeError('the weights file is missing')")
            with pytest.raises(gpuq.WorkerDied, match="the weights file is missing") as e:
                gpuq.restart_pool("py", runtime_dir=d.runtime_dir, timeout=120)
            assert "the old workers serve on" in str(e.value)
            for _ in range(20):
                assert c.call("version", pool="py")["version"] == 1
            st = pool_status(d)
            assert st["rollout"]["state"] == "failed"
            assert "the weights file is missing" in st["rollout"]["error"]
            assert st["workers_ready"] == 2
            # Mended, the next rollout goes through and clears the failure.
            write_module(tmp_path, 3)
            gpuq.restart_pool("py", runtime_dir=d.runtime_dir, timeout=120)
            assert c.call("version", pool="py")["version"] == 3
            st = pool_status(d)
            assert st["rollout"]["state"] == "done" and st["rollout"]["error"] is None
            assert st["rollout"]["failed"] == 1


def test_ops_added_and_removed_by_a_rollout_reach_connected_clients(tmp_path):
    """A rollout lists the pool's ops anew: an op the new version adds is callable by a client
    connected before it (no reconnect), and one it drops is gone from that client's list."""
    twice = '@gpuq.op("twice")\ndef twice(x):\n    return 2 * x\n'
    write_module(tmp_path, 1)
    with gpuq.testing.Daemon({"pools": [pool(tmp_path)]}) as d:
        with gpuq.connect(d.runtime_dir) as c:
            ops_before = set(c.ops)
            assert "twice" not in ops_before
            with pytest.raises(gpuq.UnknownOp):
                c.call("twice", 21, pool="py")
            write_module(tmp_path, 2, extra=twice)
            gpuq.restart_pool("py", runtime_dir=d.runtime_dir, timeout=120)
            assert c.call("twice", 21, pool="py") == 42
            assert set(c.ops) == ops_before | {"twice"}
            assert "twice" in pool_status(d)["python"]["ops"]
            # Another client connected before, which has not looked since, finds it too.
            write_module(tmp_path, 3)
            gpuq.restart_pool("py", runtime_dir=d.runtime_dir, timeout=120)
            assert set(c.ops) == ops_before
            with pytest.raises(gpuq.UnknownOp):
                c.call("twice", 21, pool="py")
            assert c.call("version", pool="py")["version"] == 3
            # Listed again later: the op gets back its id (ids are never reused for another).
            write_module(tmp_path, 4, extra=twice)
            gpuq.restart_pool("py", runtime_dir=d.runtime_dir, timeout=120)
            assert c.call("twice", 4, pool="py") == 8


def test_gpuqctl_restart(tmp_path):
    write_module(tmp_path, 1)
    with gpuq.testing.Daemon({"pools": [pool(tmp_path)]}) as d:
        gpuqctl = str(pathlib.Path(gpuq.testing.find_gpuqd()).parent.parent / "tools" / "gpuqctl")
        if not os.path.exists(gpuqctl):
            pytest.skip(f"{gpuqctl} not built")
        write_module(tmp_path, 2)
        r = subprocess.run([gpuqctl, "--runtime-dir", d.runtime_dir, "restart", "py"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "every worker runs generation 2" in r.stdout
        r = subprocess.run([gpuqctl, "--runtime-dir", d.runtime_dir, "restart", "nope"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and "no pool named 'nope'" in r.stderr
        r = subprocess.run([gpuqctl, "--runtime-dir", d.runtime_dir, "restart"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "which pool?" in r.stderr


def test_a_pool_with_no_seat_is_told_how_to_get_one(tmp_path):
    write_module(tmp_path, 1)
    with gpuq.testing.Daemon({"pools": [pool(tmp_path, rollout_surge_workers=0)]}) as d:
        with pytest.raises(gpuq.InvalidArgument, match="rollout_surge_workers"):
            gpuq.restart_pool("py", runtime_dir=d.runtime_dir, timeout=60)
        with gpuq.connect(d.runtime_dir) as c:
            assert c.call("version", pool="py")["version"] == 1
        with pytest.raises(gpuq.UnknownPool):
            gpuq.restart_pool("nope", runtime_dir=d.runtime_dir)
