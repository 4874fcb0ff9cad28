"""Streaming ops (docs/python.md, "Streaming"; docs/design/streams.md): a real gpuqd whose Python
worker runs the generator ops of python/tests/pyops/pyops_stream.py, read with Client.stream.
Parts arrive in order and before the generator ends; cancel, the time limit, a reader that stops
reading, a caller that dies and a worker that dies each end the stream and free the worker."""

from __future__ import annotations

import asyncio
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
OPS_DIR = str(HERE / "pyops")

CONFIG = {
    "pools": [
        {
            "name": "py",
            "kind": "cpu",
            "workers": 1,
            "python": {
                "interpreter": sys.executable,
                "modules": ["pyops_stream"],
                "path": [OPS_DIR],
            },
        }
    ],
    "stream_reader_timeout_ms": 500,
    "cancel_grace_ms": 500,
    "restart_backoff_initial_ms": 10,
}


@pytest.fixture(scope="module")
def daemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture
def client(daemon):
    with gpuq.connect(daemon.runtime_dir, name="pytest-streams") as c:
        yield c


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def marker_lines(path):
    return path.read_text().splitlines() if path.exists() else []


def test_parts_arrive_in_order_before_the_generator_ends(client):
    with client.stream("tokens", 5, delay=0.2) as s:
        first = s.next(timeout=30)
        assert first == "tok0"
        assert not s.done()  # the generator is still making the others, 0.2 s apart
        assert [first, *s] == [f"tok{i}" for i in range(5)]
        assert s.parts == 5
        info = s.info(timeout=30)
        assert info.status == "done" and info.value == 5  # the parts it made


def test_array_parts_are_copied_out_of_their_cells(client):
    # 12 parts through 2 cells: a part handed out as a view of its cell would be overwritten.
    parts = list(client.stream("rows", 12, 1000, window=2, part_bytes=16384))
    assert len(parts) == 12
    for i, p in enumerate(parts):
        assert p.dtype == np.int64 and p.shape == (1000,)
        assert (p == i).all()


def test_async_generator_op_and_async_iteration(client):
    async def read():
        return [x async for x in client.stream("agen", 6)]

    assert asyncio.run(read()) == list(range(6))


def test_a_generator_op_called_answers_with_the_list(client):
    assert client.call("tokens", 3) == ["tok0", "tok1", "tok2"]
    assert [p.tolist() for p in client.call("rows", 2, 3)] == [[0, 0, 0], [1, 1, 1]]


def test_a_plain_op_streams_one_part(client):
    assert list(client.stream("plain", 21)) == [42]


def test_an_error_ends_the_stream_after_its_parts(client):
    s = client.stream("fails_after", 3)
    assert [s.next(timeout=30) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(gpuq.OpFailed, match="boom after 3") as e:
        s.next(timeout=30)
    assert e.value.remote_type == "ValueError"
    assert "fails_after" in (e.value.remote_traceback or "")
    with pytest.raises(gpuq.OpFailed):  # and stays failed
        next(s)


def test_a_part_larger_than_its_cell_names_the_size_to_ask(client):
    with pytest.raises(gpuq.InvalidArgument, match="part_bytes=100"):
        list(client.stream("big_part", 100000, part_bytes=1024))


def test_cancel_stops_the_generator_at_its_yield(client, tmp_path):
    marker = tmp_path / "marker"
    s = client.stream("tokens", 1_000_000, delay=0.01, marker=str(marker), window=2)
    assert [s.next(timeout=30) for _ in range(3)] == ["tok0", "tok1", "tok2"]
    assert s.cancel()
    with pytest.raises(gpuq.Cancelled):
        for _ in s:  # the parts made before the cancel, then the end
            pass
    wait_for(lambda: any(line.startswith("closed after") for line in marker_lines(marker)))
    assert client.call("plain", 1, timeout=30) == 2  # the worker serves on


def test_the_time_limit_covers_the_whole_stream(client):
    s = client.stream("tokens", 1_000_000, delay=0.01, time_limit=0.3)
    n = 0
    with pytest.raises(gpuq.TimedOut):
        for _ in s:
            n += 1
    assert n > 5
    assert client.call("plain", 2, timeout=30) == 4


def test_a_reader_that_stops_reading_frees_the_worker(client, tmp_path):
    marker = tmp_path / "marker"
    s = client.stream("tokens", 1000, marker=str(marker), window=2)
    assert s.next(timeout=30) == "tok0"
    # Reads nothing more: after stream_reader_timeout_ms (0.5 s) the worker stops waiting.
    assert client.call("plain", 3, timeout=30) == 6
    wait_for(lambda: any(line.startswith("closed after") for line in marker_lines(marker)))
    assert s.next(timeout=30) == "tok1"  # made before it stopped
    with pytest.raises(gpuq.Cancelled, match="stream_reader_timeout_ms"):
        s.next(timeout=30)


def test_bad_stream_arguments_are_refused(client):
    for window in (0, 9, "2"):
        with pytest.raises(gpuq.InvalidArgument, match="window"):
            client.stream("tokens", 1, window=window)
    with pytest.raises(gpuq.InvalidArgument, match="part_bytes"):
        client.stream("tokens", 1, part_bytes=10)
    with pytest.raises(gpuq.UnknownOp):
        client.stream("no_such_op", 1, pool="py")


def test_a_caller_killed_mid_stream_frees_the_worker(daemon, client, tmp_path):
    marker = tmp_path / "marker"
    child = textwrap.dedent(
        f"""
        import os, gpuq
        c = gpuq.connect({daemon.runtime_dir!r})
        s = c.stream("tokens", 1_000_000, delay=0.01, marker={str(marker)!r}, window=2)
        for _ in range(3):
            s.next(timeout=30)
        os._exit(0)  # no clean-up: as if it crashed mid-stream
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    wait_for(lambda: any(line.startswith("closed after") for line in marker_lines(marker)))
    assert client.call("plain", 5, timeout=30) == 10


def test_a_worker_killed_mid_stream_fails_it_after_its_parts(daemon, client):
    s = client.stream("tokens", 1_000_000, delay=0.01, window=2)
    assert s.next(timeout=30) == "tok0"
    pool = next(p for p in daemon.status()["pools"] if p["name"] == "py")
    os.kill(pool["workers"][0]["pid"], signal.SIGKILL)
    with pytest.raises(gpuq.WorkerDied):
        for _ in s:
            pass
    wait_for(
        lambda: next(p for p in daemon.status()["pools"] if p["name"] == "py")["status"] == "ready"
    )
    assert client.call("plain", 4, timeout=30) == 8
