"""Step ops (docs/python.md, "Step-level batching"; docs/design/streams.md): a real gpuqd whose
Python worker runs the step ops of python/tests/pyops/pyops_steps.py. Sequences of one op share
each step's call; a job joins at the next step and leaves when done, cancelled or out of time;
32 client processes joining and leaving get exactly the sequences the model makes for each alone;
a failing start or step, a killed caller and a killed worker end what they should."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import pathlib
import random
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
sys.path.insert(0, OPS_DIR)
import pyops_steps  # noqa: E402 - the model's reference, run here alone

CONFIG = {
    "pools": [
        {
            "name": "py",
            "kind": "cpu",
            "workers": 1,
            "python": {
                "interpreter": sys.executable,
                "modules": ["pyops_steps"],
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
    with gpuq.connect(daemon.runtime_dir, name="pytest-steps") as c:
        yield c


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def py_pool(daemon):
    return next(p for p in daemon.status()["pools"] if p["name"] == "py")


def test_call_answers_with_the_parts_and_stream_gets_each_at_its_step(client):
    # As a generator op called: its parts together (numbers as a tuple of numpy scalars).
    assert list(client.call("count_up", 4, timeout=30)) == [0, 1, 2, 3]
    with client.stream("count_up", 5, delay=0.2) as s:
        assert s.next(timeout=30) == 0
        assert not s.done()  # the sequence has four steps to go, 0.2 s each
        assert [*s] == [1, 2, 3, 4]
        assert s.info(timeout=30).value == 5  # its parts
    parts = client.call("count_up", 3, width=4, timeout=30)
    assert [p.tolist() for p in parts] == [[i] * 4 for i in range(3)]


def test_a_part_larger_than_its_cell_names_the_part_bytes_to_ask(client):
    s = client.stream("count_up", 3, width=2, part_bytes=1024)
    assert s.next(timeout=30).tolist() == [0, 0]
    s.close()
    with pytest.raises(gpuq.InvalidArgument, match=r"part 0 of the stream .* part_bytes=\d+"):
        list(client.stream("count_up", 3, width=100_000, part_bytes=1024))


def test_the_pool_status_says_it_is_a_step_op(daemon):
    batching = py_pool(daemon)["python"]["batching"]
    assert batching["gen"] == {"max_batch_size": 32, "max_queue_delay_us": 0, "step": True}
    assert "plain" not in batching


def test_a_job_joins_at_the_next_step_and_short_ones_do_not_wait(client):
    long = client.stream("count_up", 40, delay=0.02)
    assert long.next(timeout=30) == 0
    t0 = time.monotonic()
    assert list(client.call("count_up", 2, timeout=30)) == [0, 1]  # joined the live one
    took = time.monotonic() - t0
    assert took < 0.4, f"a 2-step sequence waited {took:.2f} s for a 40-step one"
    assert not long.done()
    assert [*long] == list(range(1, 40))


def test_32_clients_get_exactly_the_sequences_the_model_makes_alone(daemon, client):
    seen_before = len(client.call("gen_steps_seen", timeout=30))
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(32, mp_context=ctx) as ex:
        results = list(ex.map(_one_client, [(daemon.runtime_dir, i) for i in range(32)]))
    for got, want in results:
        assert got == want
    sizes = client.call("gen_steps_seen", timeout=30)[seen_before:]
    assert sizes.max() > 1, "no step served more than one sequence"
    assert sizes.max() <= 32  # max_batch_size
    # Sequences came and went: the steps' sizes changed many times.
    assert np.count_nonzero(np.diff(sizes)) > 10


def _one_client(arg):
    """A client process: sequences of 4 to 64 steps, streamed or called, some cancelled part
    way (their parts so far must still be the model's), each against the model alone."""
    runtime_dir, i = arg
    rng = random.Random(i)
    got, want = [], []
    with gpuq.connect(runtime_dir, name=f"steps-{i}") as c:
        for j in range(3):
            seed, length = rng.randrange(1 << 30), rng.randrange(4, 65)
            reference = pyops_steps.alone(seed, length)
            if j == 0:
                got.append(list(c.call("gen", seed, length, timeout=120)))
                want.append(reference)
            elif j == 1 or i % 4 != 0:
                got.append(list(c.stream("gen", seed, length, window=2)))
                want.append(reference)
            else:  # leaves part way
                s = c.stream("gen", seed, length, window=2)
                head = [s.next(timeout=120) for _ in range(3)]
                s.cancel()
                got.append(head)
                want.append(reference[:3])
            time.sleep(rng.random() * 0.01)
    return got, want


def test_a_cancelled_sequence_leaves_and_the_others_go_on(client):
    keep = client.stream("count_up", 30, delay=0.01)
    stop = client.stream("count_up", 1_000_000, delay=0.01, window=2)
    assert stop.next(timeout=30) == 0
    assert stop.cancel()
    with pytest.raises(gpuq.Cancelled):
        for _ in stop:
            pass
    assert [*keep] == list(range(30))


def test_a_time_limit_ends_its_own_sequence_only(client):
    keep = client.submit_call("count_up", 40, delay=0.01)
    with pytest.raises(gpuq.TimedOut):
        client.call("count_up", 1_000_000, delay=0.01, time_limit=0.2, timeout=30)
    assert list(keep.result(timeout=30)) == list(range(40))


def test_a_failing_start_fails_its_job_alone(client):
    keep = client.stream("count_up", 20, delay=0.01)
    with pytest.raises(gpuq.OpFailed, match="cannot count to -1") as e:
        client.call("count_up", -1, timeout=30)
    assert e.value.remote_type == "ValueError"
    assert [*keep] == list(range(20))


def test_a_failing_step_fails_the_sequences_of_that_step_after_their_parts(client):
    s = client.stream("count_up", 10, fail_at=3)
    assert [s.next(timeout=30) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(gpuq.OpFailed, match="boom at step 3") as e:
        s.next(timeout=30)
    assert e.value.remote_type == "ValueError"
    assert "count_step" in (e.value.remote_traceback or "")
    assert list(client.call("count_up", 2, timeout=30)) == [0, 1]  # the op serves on


def test_a_step_that_returns_the_wrong_shape_says_what_it_must_return(client):
    with pytest.raises(gpuq.OpFailed, match=r"one \(part, done\) per state"):
        client.call("bad_shape", 2, timeout=30)
    with pytest.raises(gpuq.OpFailed, match=r"\(part, done\) pair"):
        client.call("bad_shape", 1, timeout=30)


def test_a_reader_that_stops_reading_pauses_only_its_own_sequence(client):
    slow = client.stream("count_up", 1000, window=1)
    assert slow.next(timeout=30) == 0
    # It reads nothing more; a sequence beside it runs to its end meanwhile.
    t0 = time.monotonic()
    assert list(client.call("count_up", 50, timeout=30)) == list(range(50))
    assert time.monotonic() - t0 < 0.45  # before the reader's timeout (0.5 s) freed anything
    time.sleep(0.7)  # past that timeout: the slow sequence has left (its one cell unread)
    with pytest.raises(gpuq.Cancelled, match="stream_reader_timeout_ms"):
        slow.next(timeout=30)


def test_a_caller_killed_mid_sequence_frees_its_place(daemon, client):
    # Two sequences of ~3 hours each: a stream, and a call() whose parts no reader paces.
    child = textwrap.dedent(
        f"""
        import os, gpuq
        c = gpuq.connect({daemon.runtime_dir!r})
        called = c.submit_call("count_up", 1_000_000, delay=0.01)
        s = c.stream("count_up", 1_000_000, delay=0.01, window=2)
        for _ in range(3):
            s.next(timeout=30)
        os._exit(0)  # no clean-up: as if it crashed mid-stream
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=120)
    # Another op runs once both sequences have left: they end when their client is gone.
    assert client.call("plain", 5, timeout=30) == 10


def test_a_worker_killed_mid_sequence_fails_every_live_one(daemon, client):
    a = client.stream("count_up", 1_000_000, delay=0.01, window=2)
    b = client.submit_call("count_up", 1_000_000, delay=0.01)
    assert a.next(timeout=30) == 0
    os.kill(py_pool(daemon)["workers"][0]["pid"], signal.SIGKILL)
    with pytest.raises(gpuq.WorkerDied):
        for _ in a:
            pass
    with pytest.raises(gpuq.WorkerDied):
        b.result(timeout=30)
    wait_for(lambda: py_pool(daemon)["status"] == "ready")
    assert list(client.call("count_up", 2, timeout=30)) == [0, 1]


def test_bad_step_op_declarations_are_refused():
    with pytest.raises(TypeError, match="start must be a function"):
        gpuq.step_op("x", start=None)
    with pytest.raises(ValueError, match="max_batch_size"):
        gpuq.step_op("x", start=lambda: 0, max_batch_size=0)
    with pytest.raises(ValueError, match="not a valid op name"):
        gpuq.step_op("Bad-Name", start=lambda: 0)
