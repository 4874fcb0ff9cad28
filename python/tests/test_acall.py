"""Client.acall / asubmit_call (docs/web.md, "Never block the event loop"): with the pool's ring
full, a call waits for room in the client, not in the event loop, which keeps running; it is
sent once room frees; cancelled (or timed out) while it waits, it is never sent."""

from __future__ import annotations

import asyncio
import os
import pathlib
import sys
import time

import numpy as np
import pytest

import gpuq
import gpuq.testing

OPS_DIR = str(pathlib.Path(__file__).resolve().parent / "pyops")

# One worker, lanes of one cell: a held worker and the jobs a client queues make it full.
CONFIG = {"pools": [{"name": "py", "kind": "cpu", "workers": 1,
                     "python": {"interpreter": sys.executable, "modules": ["pyops_async"],
                                "path": [OPS_DIR]}}],
          "queue_factor": 1, "client_queue_share": 1.0, "cancel_grace_ms": 500}
TICK = 0.01


@pytest.fixture(scope="module")
def daemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture
def client(daemon):
    with gpuq.connect(daemon.runtime_dir, name="pytest-acall") as c:
        yield c


class FullRing:
    """The pool's worker held by a job of another client and `client`'s room in the queue
    taken by jobs of its own (each client queues into lanes of its own: another client's jobs
    take none of its room): no room for it until release()."""

    def __init__(self, daemon, client=None):
        self.other = gpuq.connect(daemon.runtime_dir, name="pytest-acall-filler")
        self.hold = self.other.submit("sleep", us=60_000_000, pool="py")
        deadline = time.monotonic() + 30
        while not self.hold.running():
            assert time.monotonic() < deadline, "the worker never took the holding job"
            time.sleep(0.005)
        self.queued = []
        if client is not None:
            with pytest.raises(gpuq.QueueFull):
                for _ in range(10):
                    self.queued.append(client.try_submit("sleep", us=1, pool="py"))

    def release(self):
        self.hold.stop()

    def close(self):
        self.hold.stop()
        for f in (self.hold, *self.queued):
            try:
                f.result(timeout=30)
            except gpuq.Cancelled:
                pass
        self.other.close()


@pytest.fixture
def full_ring(daemon, client):
    ring = FullRing(daemon, client)
    yield ring
    ring.close()


@pytest.fixture
def held_worker(daemon):
    """The worker held, the queue's room free: a call is sent and stays queued."""
    ring = FullRing(daemon)
    yield ring
    ring.close()


async def ticker(ticks):
    while True:
        ticks.append(time.monotonic())
        await asyncio.sleep(TICK)


def gaps(ticks):
    return [b - a for a, b in zip(ticks, ticks[1:])]


def test_the_sync_call_would_wait_in_the_callers_thread(client, full_ring):
    # What acall avoids: submit_call waits for room in the thread that calls it.
    t0 = time.monotonic()
    with pytest.raises(gpuq.Timeout):
        client.submit_call("scale", np.ones(4), pool="py", timeout=0.2)
    assert time.monotonic() - t0 >= 0.2


def test_acall_waits_for_room_without_blocking_the_loop(client, full_ring):
    x = np.arange(8.0)

    async def main():
        ticks = []
        tick_task = asyncio.create_task(ticker(ticks))
        call = asyncio.create_task(client.acall("scale", x, factor=3))
        await asyncio.sleep(0.5)
        assert not call.done(), "the call should still wait for room"
        waiting = list(ticks)
        released = time.monotonic()
        full_ring.release()
        result = await asyncio.wait_for(call, 30)
        took = time.monotonic() - released
        tick_task.cancel()
        return waiting, result, took

    waiting, result, took = asyncio.run(main())
    np.testing.assert_array_equal(result, x * 3)
    # 0.5 s at a 10 ms period: about 50 ticks; never a gap that a blocked loop would make.
    assert len(waiting) >= 25, len(waiting)
    assert max(gaps(waiting)) < 0.15, max(gaps(waiting))
    assert took < 10, took


def test_many_calls_wait_in_order_and_all_complete(client, full_ring):
    async def main():
        ticks = []
        tick_task = asyncio.create_task(ticker(ticks))
        calls = [asyncio.ensure_future(client.acall("scale", np.full(3, float(i)), factor=2))
                 for i in range(200)]
        await asyncio.sleep(0.3)
        assert not any(c.done() for c in calls)
        full_ring.release()
        results = await asyncio.wait_for(asyncio.gather(*calls), 60)
        tick_task.cancel()
        return ticks, results

    ticks, results = asyncio.run(main())
    for i, r in enumerate(results):
        np.testing.assert_array_equal(r, np.full(3, 2.0 * i))
    assert max(gaps(ticks)) < 0.25, max(gaps(ticks))


def test_a_call_cancelled_while_waiting_for_room_is_never_sent(client, full_ring, tmp_path):
    trace = tmp_path / "cancelled"
    after = tmp_path / "after"

    async def main():
        call = asyncio.create_task(client.acall("touch", str(trace)))
        await asyncio.sleep(0.2)
        assert not call.done()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        full_ring.release()
        # Sent after the cancelled one: had that one been sent, the one worker would have run
        # it first.
        return await asyncio.wait_for(client.acall("touch", str(after), value=4), 30)

    assert asyncio.run(main()) == 8
    assert after.exists() and not trace.exists()


def test_future_cancel_while_waiting_sends_nothing(client, full_ring, tmp_path):
    trace = tmp_path / "cancelled"
    f = client.asubmit_call("touch", str(trace))
    assert not f.done() and not f.running()
    assert f.cancel() and f.cancelled()
    with pytest.raises(gpuq.Cancelled):
        f.result()
    full_ring.release()
    assert client.call("touch", str(tmp_path / "after"), timeout=30) == 0
    assert not trace.exists()


def test_timeout_while_waiting_for_room_is_gpuq_timeout_and_sends_nothing(client, full_ring,
                                                                         tmp_path):
    trace = tmp_path / "late"

    async def main():
        t0 = time.monotonic()
        with pytest.raises(gpuq.Timeout, match="no room"):
            await client.acall("touch", str(trace), timeout=0.2)
        return time.monotonic() - t0

    assert 0.2 <= asyncio.run(main()) < 2
    # asubmit_call's own timeout (no awaiting task to time out): the future fails.
    f = client.asubmit_call("touch", str(trace), timeout=0.1)
    with pytest.raises(gpuq.Timeout):
        f.result(timeout=10)
    full_ring.release()
    assert client.call("touch", str(tmp_path / "after"), timeout=30) == 0
    assert not trace.exists()


def test_expire_after_counts_the_wait_for_room(client, full_ring, tmp_path):
    trace = tmp_path / "expired"
    f = client.asubmit_call("touch", str(trace), expire_after=0.1)
    with pytest.raises(gpuq.Expired):
        f.result(timeout=10)
    full_ring.release()
    assert client.call("touch", str(tmp_path / "after"), timeout=30) == 0
    assert not trace.exists()


def test_an_op_no_pool_has_raises_unknown_op(client):
    with pytest.raises(gpuq.UnknownOp):
        asyncio.run(client.acall("no_such_op", 1))


def test_with_room_it_is_sent_at_once_and_errors_raise_from_the_call(client):
    f = client.asubmit_call("scale", np.ones(2), factor=5)
    assert f._job is not None  # sent in the call: there was room
    np.testing.assert_array_equal(f.result(timeout=30), [5.0, 5.0])
    with pytest.raises(gpuq.UnknownOp):
        client.asubmit_call("no_such_op", 1)
    with pytest.raises(gpuq.InvalidArgument):
        client.asubmit_call("scale", np.array([object()]))
    with pytest.raises(gpuq.UnknownPool):
        client.asubmit_call("scale", np.ones(2), pool="nope")

    async def main():
        return await asyncio.gather(*(client.acall("scale", np.full(2, float(i)), factor=2)
                                      for i in range(100)))

    for i, r in enumerate(asyncio.run(main())):
        np.testing.assert_array_equal(r, [2.0 * i, 2.0 * i])


def test_a_timeout_after_the_call_was_sent_stops_its_job(client, held_worker, tmp_path):
    # Room for the call, the worker held: the call is sent and queued; its timeout passes
    # while it is queued, and the job is stopped, so it never runs once the worker is free.
    trace = tmp_path / "stopped"

    async def main():
        f = client.asubmit_call("touch", str(trace))
        assert f._job is not None  # sent at once
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(f, 0.3)
        return f

    f = asyncio.run(main())
    assert f.cancelled() and f.info is not None and f.info.status == "cancelled"
    held_worker.release()
    assert client.call("touch", str(tmp_path / "after"), timeout=30) == 0
    assert not trace.exists()


def test_acall_timeout_after_sending_raises_asyncio_timeout(client, held_worker, tmp_path):
    trace = tmp_path / "stopped"

    async def main():
        with pytest.raises(asyncio.TimeoutError) as e:
            await client.acall("touch", str(trace), timeout=0.3)
        assert not isinstance(e.value, gpuq.Timeout)  # it was sent: not a wait for room

    asyncio.run(main())
    held_worker.release()
    assert client.call("touch", str(tmp_path / "after"), timeout=30) == 0
    assert not trace.exists()


def test_after_fork_the_child_connects_anew(client):
    client.call("scale", np.ones(1))
    pid = os.fork()
    if pid == 0:
        try:
            r = asyncio.run(client.acall("scale", np.ones(3), factor=4))
            os._exit(0 if list(r) == [4.0, 4.0, 4.0] else 1)
        except BaseException:  # noqa: BLE001
            os._exit(2)
    assert os.waitpid(pid, 0)[1] == 0


def test_waiting_calls_burn_little_cpu_beside_unread_ended_calls(daemon, full_ring):
    """The feeder sleeps on this client's unfinished jobs: ended calls nobody has read (their
    futures still hold their jobs) must not wake it at once, over and over."""
    with gpuq.connect(daemon.runtime_dir, name="pytest-acall-cpu") as c:
        full_ring.release()
        unread = [c.submit_call("scale", np.ones(4), pool="py") for _ in range(3)]
        deadline = time.monotonic() + 30
        while not all(f._job.poll() >= 2 for f in unread):  # DONE, unread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        ring = FullRing(daemon)
        try:
            async def main():
                calls = [asyncio.ensure_future(c.acall("scale", np.ones(2), pool="py"))
                         for _ in range(5)]
                await asyncio.sleep(0.2)
                cpu0 = time.process_time()
                await asyncio.sleep(1.0)
                used = time.process_time() - cpu0
                ring.release()
                await asyncio.wait_for(asyncio.gather(*calls), 30)
                return used

            assert asyncio.run(main()) < 0.3  # a spinning feeder takes the whole second
        finally:
            ring.close()
        assert all(list(f.result()) == [2.0] * 4 for f in unread)
