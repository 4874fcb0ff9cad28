"""Every gpuq error class, raised where it should be."""

from __future__ import annotations

import os
import pathlib
import signal
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing
from gpuq import _errors, _native

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import mp_tasks  # noqa: E402

def test_one_class_per_error_code():
    # The codes as the C++ enum defines them (gpuq::ErrorCode, exported by _native): each has
    # its class, numbered from it.
    codes = _native.ERROR_CODES
    assert len(codes) == _native.MAX_ERROR_CODE and sorted(codes.values()) == list(
        range(1, _native.MAX_ERROR_CODE + 1))
    assert codes["InvalidArgument"] == 1 and codes["PoolDown"] == 23  # the C ABI's numbers
    for name, code in codes.items():
        cls = getattr(gpuq, name)
        assert issubclass(cls, gpuq.Error) and cls.code == code and cls.code_name == name
        e = _errors.error_for(code, "the daemon's words")
        assert type(e) is cls and str(e) == "the daemon's words" and e.message == str(e)
    assert type(_errors.error_for(999, "x")) is gpuq.Error
    assert issubclass(gpuq.InvalidArgument, ValueError)
    assert issubclass(gpuq.Timeout, TimeoutError)
    assert issubclass(gpuq.OutOfMemory, MemoryError)
    # TimedOut (the job was stopped at its limit) is a TimeoutError, but not a Timeout (a wait
    # that gave up while the job went on).
    assert issubclass(gpuq.TimedOut, TimeoutError)
    assert not issubclass(gpuq.TimedOut, gpuq.Timeout)
    assert not issubclass(gpuq.Timeout, gpuq.TimedOut)


def test_unknown_op_and_pool(client):
    with pytest.raises(gpuq.UnknownOp, match="'nope' is not registered"):
        client.submit("nope")
    with pytest.raises(gpuq.UnknownPool, match="gpu7"):
        client.submit("noop", pool="gpu7")


def test_invalid_argument(client):
    with pytest.raises(gpuq.InvalidArgument, match="param us: must be an int, float or str"):
        client.submit("sleep", us=[1])
    with pytest.raises(gpuq.InvalidArgument, match="timeout"):
        client.submit("noop", timeout=-1)
    with pytest.raises(gpuq.InvalidArgument, match="takes one input"):
        client.submit("echo", b"a", b"b")
    # Checked by the worker: the job fails with the worker's message.
    with pytest.raises(gpuq.InvalidArgument, match="us"):
        client.submit("sleep", us=-5).result(10)
    with pytest.raises(gpuq.InvalidArgument, match="output buffer"):
        client.submit("echo", b"0123456789", out=client.empty(4, np.uint8)).result(10)


def busy_worker_pid(daemon, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in daemon.status()["pools"][0]["workers"]:
            if w["busy"]:
                return w["pid"]
        time.sleep(0.01)
    raise AssertionError("no worker became busy")


def test_worker_died(client, daemon):
    f = client.submit("sleep", us=5_000_000)
    os.kill(busy_worker_pid(daemon), signal.SIGKILL)
    with pytest.raises(gpuq.WorkerDied):
        f.result(30)
    # The worker comes back, and the daemon serves on.
    assert client.submit("noop").result(30) == 0


def test_timed_out(client):
    # sleep looks at its cancel flag, which the daemon raises at the job's time limit.
    t0 = time.monotonic()
    f = client.submit("sleep", us=5_000_000, time_limit=0.2)
    with pytest.raises(gpuq.TimedOut) as e:
        f.result(30)
    assert time.monotonic() - t0 < 4.0, "the job was not stopped at its limit"
    assert e.value.code == 22 and isinstance(e.value, TimeoutError)
    assert f.info.status == "failed" and f.info.code == 22
    assert 0.15e9 <= f.info.run_ns < 4e9
    # A job within its limit is untouched, and the worker serves on.
    assert client.submit("sleep", us=1000, time_limit=30).result(30) == 1000


def test_forked_client_job_in_child(client):
    f = client.submit("sleep", us=200_000)
    # The parent's job is not the child's own.
    assert mp_tasks.raises_in_forked_child(f, gpuq.ForkedClient, 10)
    assert f.result(10) == 200_000  # the parent's job is untouched


def test_no_device():
    config = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1},
                        {"name": "gpu", "kind": "gpu", "gpus": [0]}]}
    with gpuq.testing.Daemon(config) as d, gpuq.connect(d.runtime_dir) as c:
        gpu = [p for p in c.pools if p["name"] == "gpu"][0]
        if gpu["available"]:
            pytest.skip("this machine has a GPU")
        with pytest.raises(gpuq.NoDevice, match="gpu"):
            c.submit("noop", pool="gpu")


def test_too_many_clients():
    with gpuq.testing.Daemon({"max_clients": 1, "pools": [{"name": "cpu", "workers": 1}]}) as d:
        with gpuq.connect(d.runtime_dir):
            with pytest.raises(gpuq.TooManyClients, match=r'max_clients = 1 clients; raise '
                                                          r'"max_clients" in its config \(at most '
                                                          r'1022'):
                gpuq.connect(d.runtime_dir)


def test_permission_denied():
    config = {"allowed_users": ["nobody"], "pools": [{"name": "cpu", "workers": 1}]}
    with gpuq.testing.Daemon(config) as d:
        with pytest.raises(gpuq.PermissionDenied):
            gpuq.connect(d.runtime_dir)
        with pytest.raises(gpuq.PermissionDenied):
            gpuq.status(d.runtime_dir)


def test_shutting_down_and_disconnected():
    with gpuq.testing.Daemon({"pools": [{"name": "cpu", "workers": 1}]}) as d:
        c = gpuq.connect(d.runtime_dir)
        running = c.submit("sleep", us=1_000_000)
        busy_worker_pid(d)
        d.proc.send_signal(signal.SIGTERM)  # drain: the running job finishes, no new ones
        deadline = time.monotonic() + 10
        while "draining" not in d.log():
            assert time.monotonic() < deadline, "the daemon did not start draining"
            time.sleep(0.005)
        with pytest.raises(gpuq.ShuttingDown, match="draining"):
            c.submit("noop")
        assert running.result(30) == 1_000_000
        assert d.proc.wait(30) == 0
        with pytest.raises(gpuq.Disconnected):
            c.submit("noop").result(10)
        with pytest.raises(gpuq.Disconnected):
            gpuq.connect(d.runtime_dir)


def test_connect_waits_for_a_starting_daemon():
    """``gpuq.connect(wait=...)``: `gpuqd & python app.py` finds the daemon once its socket is
    there; without wait, or past it, no daemon is Disconnected."""
    import threading

    d = gpuq.testing.Daemon({"pools": [{"name": "cpu", "workers": 1}]})
    with pytest.raises(gpuq.Disconnected):
        gpuq.connect(d.runtime_dir)
    t0 = time.monotonic()
    with pytest.raises(gpuq.Disconnected):
        gpuq.connect(d.runtime_dir, wait=0.3)
    assert time.monotonic() - t0 >= 0.3
    with pytest.raises(gpuq.InvalidArgument, match="wait"):
        gpuq.connect(d.runtime_dir, wait=-1)
    starter = threading.Timer(0.5, d.start)
    starter.start()
    try:
        with gpuq.connect(d.runtime_dir, wait=30) as c:
            assert c.submit("noop").result(30) == 0
    finally:
        starter.join()
        d.stop()


def test_reconnect_after_the_daemon_restarts():
    d = gpuq.testing.Daemon({"pools": [{"name": "cpu", "workers": 1}]})
    with d:
        c = gpuq.connect(d.runtime_dir)
        x = c.array(np.arange(4.0))
        assert c.submit("noop").result(30) == 0
        epoch = c._c().native.epoch
        d.stop()
        with pytest.raises(gpuq.Disconnected):
            c.submit("noop").result(10)
        with pytest.raises(gpuq.Disconnected):  # no daemon: the client stays as it was
            c.reconnect()
        d.start()  # a new daemon on the same runtime directory, as systemd restarts one
        c.reconnect(wait=30)
        assert c._c().native.epoch != epoch
        assert c.submit("noop").result(30) == 0
        # An array of the old segment is still readable, and a call copies it in.
        assert not c.in_segment(x)
        np.testing.assert_array_equal(c.submit("echo", x, out=c.empty(4, np.float64)).result(30),
                                      np.arange(4.0))
        with pytest.raises(gpuq.InvalidArgument, match="wait"):
            c.reconnect(wait=-1)
        c.close()
        with pytest.raises(gpuq.ClientClosed):
            c.reconnect()
