"""gpuq.Future with concurrent.futures and asyncio; backpressure, timeouts, expiry, cancel."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import pathlib
import sys
import threading
import time

import pytest

import gpuq
import gpuq.testing

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import mp_tasks  # noqa: E402

LONG_US = 400_000  # a sleep job that keeps a worker busy long enough to fill the queue


def test_future_is_a_concurrent_future(client):
    f = client.submit("sleep", us=1000)
    assert isinstance(f, cf.Future)
    assert f.result(10) == 1000 and f.done() and not f.cancelled() and not f.running()


def test_wait_and_as_completed(client):
    fs = [client.submit("sleep", us=us) for us in (30_000, 1_000, 20_000, 2_000)]
    done, pending = cf.wait(fs, timeout=30, return_when=cf.FIRST_COMPLETED)
    assert done and all(f.done() for f in done)
    done, pending = cf.wait(fs, timeout=30)
    assert len(done) == 4 and not pending
    fs = [client.submit("sleep", us=us) for us in (40_000, 1_000, 20_000)]
    order = [f.result() for f in cf.as_completed(fs, timeout=30)]
    assert sorted(order) == [1_000, 20_000, 40_000]
    assert order[0] == 1_000


def test_as_completed_with_finished_futures(client):
    fs = [client.submit("noop") for _ in range(10)]
    fs[0].result(10)
    assert len(list(cf.as_completed(fs, timeout=30))) == 10


def test_add_done_callback(client):
    seen = []
    ev = threading.Event()
    f = client.submit("sleep", us=5000)
    f.add_done_callback(lambda fut: (seen.append(fut.result()), ev.set()))
    assert ev.wait(10) and seen == [5000]
    # On a finished future the callback runs at once, in this thread.
    f.add_done_callback(lambda fut: seen.append("again"))
    assert seen == [5000, "again"]


def test_watcher_sleeps_until_a_job_ends(client):
    """The watcher sleeps on the connection's event: a job that runs 1.5 s costs it a wake-up
    a second (to check the daemon), not one every slice of a poll; a job handed to it while it
    sleeps is watched at once."""
    ended = []
    long_done = threading.Event()
    short_done = threading.Event()
    slow = client.submit("sleep", us=1_500_000)
    slow.add_done_callback(lambda f: (ended.append("slow"), long_done.set()))
    watcher = client._c().watcher
    time.sleep(0.2)  # the watcher is asleep on `slow`
    t0 = time.monotonic()
    quick = client.submit("sleep", us=10_000)
    quick.add_done_callback(lambda f: (ended.append("quick"), short_done.set()))
    assert short_done.wait(10)
    assert time.monotonic() - t0 < 1.0, "a job added while the watcher slept waited for its wake"
    before = watcher.wakeups
    assert long_done.wait(10)
    assert ended == ["quick", "slow"]
    # From the quick job's end to the slow one's (about 1.3 s): its end and at most two
    # liveness checks. A 20 ms poll would have woken some 60 times.
    assert watcher.wakeups - before <= 3, watcher.wakeups - before


def test_watched_futures_fail_disconnected_when_the_daemon_dies():
    with gpuq.testing.Daemon({"pools": [{"name": "cpu", "workers": 1}]}) as d:
        c = gpuq.connect(d.runtime_dir)
        f = c.submit("sleep", us=20_000_000)
        errors = []
        ev = threading.Event()
        f.add_done_callback(lambda fut: (errors.append(fut.exception()), ev.set()))
        time.sleep(0.2)
        d.proc.kill()
        assert ev.wait(10), "the callback did not run after the daemon died"
        assert isinstance(errors[0], gpuq.Disconnected)


def test_asyncio(client):
    async def main():
        one = await client.submit("sleep", us=2000)
        many = await asyncio.gather(*[client.submit("sleep", us=100 * i) for i in range(50)])
        return one, many

    threads_before = threading.active_count()
    one, many = asyncio.run(main())
    assert one == 2000 and many == [100 * i for i in range(50)]
    # One watcher thread for the connection, not one per job.
    assert threading.active_count() <= threads_before + 1


def test_asyncio_wait_for_timeout_cancels_the_job(client):
    job = client.submit("sleep", us=LONG_US)

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.ensure_future(job), 0.05)

    asyncio.run(main())
    # The awaiting task was cancelled, and with it the job (sleep looks at its cancel flag).
    with pytest.raises(gpuq.Cancelled):
        job.result(10)


def test_result_timeout_leaves_job_running(client):
    f = client.submit("sleep", us=200_000)
    with pytest.raises(cf.TimeoutError):
        f.result(timeout=0.01)
    assert f.result(10) == 200_000


def fill(client, n_long=2, queued=8):
    """Both workers busy with long sleeps and the ring (4 x 2 cells) full of queued jobs."""
    busy = [client.submit("sleep", us=LONG_US) for _ in range(n_long)]
    time.sleep(0.05)
    waiting = [client.submit("sleep", us=1) for _ in range(queued)]
    return busy, waiting


def test_queue_full_and_blocked_submit_resumes(client):
    busy, waiting = fill(client)
    with pytest.raises(gpuq.QueueFull):
        client.try_submit("noop")
    with pytest.raises(gpuq.Timeout):
        client.submit("noop", timeout=0.05)
    got = []
    t = threading.Thread(target=lambda: got.append(client.submit("noop").result(30)))
    t0 = time.monotonic()
    t.start()
    t.join(30)
    assert got == [0]
    assert time.monotonic() - t0 > 0.1  # it waited for room (the long sleeps to end)
    for f in busy + waiting:
        f.result(30)


def test_expire_after(client):
    busy = [client.submit("sleep", us=LONG_US) for _ in range(2)]
    time.sleep(0.05)
    f = client.submit("noop", expire_after=0.02)
    with pytest.raises(gpuq.Expired):
        f.result(30)
    assert f.info.status == "expired"
    for b in busy:
        b.result(30)


def test_time_limit_is_checked_and_converted(client, default_env):
    from gpuq._options import time_limit_ms as _time_limit_ms

    # Seconds to whole milliseconds, rounded up; anything above 0 is at least 1 ms.
    assert _time_limit_ms(None) == 0 and _time_limit_ms(0) == 0 and _time_limit_ms(0.0) == 0
    assert _time_limit_ms(0.2) == 200 and _time_limit_ms(1.1) == 1100 and _time_limit_ms(3) == 3000
    assert _time_limit_ms(0.0015) == 2 and _time_limit_ms(1e-7) == 1
    assert _time_limit_ms(float("inf")) == 0
    assert _time_limit_ms(4294967.295) == 0xFFFFFFFF
    # Refused before anything is queued, naming the argument.
    x = client.zeros((2, 2))  # a tensor helper checks time_limit before its operands
    bad = (-1, -0.001, float("nan"), "1", True, 4294967.296, 1e30)
    for value in bad:
        with pytest.raises(gpuq.InvalidArgument, match="time_limit"):
            client.submit("noop", time_limit=value)
        with pytest.raises(ValueError, match="time_limit"):
            client.try_submit("noop", time_limit=value)
        with pytest.raises(gpuq.InvalidArgument, match="time_limit"):
            client.gemm(x, x, time_limit=value)
        with pytest.raises(gpuq.InvalidArgument, match="time_limit"):
            client.run("noop", time_limit=value)
        with pytest.raises(gpuq.InvalidArgument, match="time_limit"):
            gpuq.submit("noop", time_limit=value)
    # Accepted everywhere a submit takes its options.
    assert client.submit("noop", time_limit=None).result(30) == 0
    assert client.submit("noop", time_limit=0).result(30) == 0
    assert client.try_submit("noop", time_limit=5).result(30) == 0
    assert client.run("sleep", us=100, time_limit=5) == 100
    assert gpuq.submit("noop", time_limit=5).result(30) == 0
    assert gpuq.try_submit("noop", time_limit=5).result(30) == 0


def test_cancel_queued_and_running(client):
    busy = [client.submit("sleep", us=LONG_US) for _ in range(2)]
    time.sleep(0.05)
    queued = client.submit("sleep", us=1)
    assert queued.cancel() is True
    assert queued.cancelled() and queued.done()
    with pytest.raises(gpuq.Cancelled):
        queued.result()
    with pytest.raises(cf.CancelledError):
        queued.result()
    # A running job: cancel() leaves it alone, as concurrent.futures does; stop() asks it to
    # stop, and its end (Cancelled, the sleep op looks at its flag) comes later.
    assert busy[0].cancel() is False
    assert busy[0].running() and not busy[0].cancelled()
    assert busy[0].stop() is False
    with pytest.raises(gpuq.Cancelled):
        busy[0].result(10)
    busy[1].result(30)
    assert busy[1].cancel() is False  # finished


def test_many_threads_share_a_client(client):
    errors = []

    def work():
        try:
            for _ in range(200):
                assert client.submit("noop").result(30) == 0
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors


def test_run_timeout_covers_the_whole_call(client):
    busy, waiting = fill(client)
    t0 = time.monotonic()
    with pytest.raises((gpuq.Timeout, cf.TimeoutError)):
        client.run("noop", timeout=0.1)
    assert time.monotonic() - t0 < 0.3
    for f in busy + waiting:
        f.result(30)


EXIT_WITH_PENDING = """
import concurrent.futures as cf, sys, gpuq
c = gpuq.connect(sys.argv[1])
fs = [c.submit("sleep", us=2_000_000) for _ in range(2)]
cf.wait(fs, timeout=0.05)               # the watcher thread now waits on them
fs[0].add_done_callback(lambda f: None)
print("exiting", flush=True)
"""


def test_exit_with_watched_jobs_pending(daemon):
    import subprocess
    import sys

    for _ in range(3):
        r = subprocess.run([sys.executable, "-c", EXIT_WITH_PENDING, daemon.runtime_dir],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "exiting" in r.stdout, r.stderr


# ---- regressions found in review -------------------------------------------------------------


def test_a_waiting_thread_does_not_hold_up_others(client):
    slow = client.submit("sleep", us=3_000_000)
    t = threading.Thread(target=lambda: pytest.raises(gpuq.Cancelled, slow.result))
    t.start()  # waits on `slow` in its own thread
    time.sleep(0.1)
    slow.add_done_callback(lambda f: None)  # the watcher's oldest job is now `slow`
    ev = threading.Event()
    t0 = time.monotonic()
    client.submit("sleep", us=50_000).add_done_callback(lambda f: ev.set())
    assert ev.wait(10) and time.monotonic() - t0 < 1.0
    # A second waiter on the same job keeps its own timeout.
    t0 = time.monotonic()
    with pytest.raises(cf.TimeoutError):
        slow.result(timeout=0.05)
    assert time.monotonic() - t0 < 1.0
    slow.stop()
    t.join(10)


def test_done_then_result_without_waiting(client):
    for _ in range(50):
        f = client.submit("sleep", us=200)
        f.add_done_callback(lambda f: None)  # watched
        while not f.done():
            pass
        assert f.result(0) == 200


def test_garbage_collected_pending_future_in_a_cycle(client):
    import gc

    class Holder:
        pass

    g = client.submit("sleep", us=100_000)
    gc.collect()
    old = gc.get_threshold()
    gc.set_threshold(1)  # collect on nearly every allocation, inside the watcher's lock too
    try:
        h = Holder()
        h.self = h
        h.f = client.submit("sleep", us=300_000)
        del h
        done = threading.Event()
        g.add_done_callback(lambda f: done.set())
        assert done.wait(10)
    finally:
        gc.set_threshold(*old)


def test_close_while_another_thread_waits_for_room(daemon):
    victim = gpuq.connect(daemon.runtime_dir, name="victim")
    busy = [victim.submit("sleep", us=LONG_US) for _ in range(2)]
    waiting = []
    while True:  # this client's share of the ring full
        try:
            waiting.append(victim.try_submit("sleep", us=1))
        except gpuq.QueueFull:
            break
    raised = []

    def blocked():
        try:
            victim.submit("noop", timeout=0.25)
        except gpuq.Error as e:
            raised.append(type(e))

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.1)
    victim.close()  # must not free the connection under the waiting submit
    t.join(10)
    # Timeout, or room came first (jobs earlier tests left may end meanwhile); either way the
    # process is alive (it crashed here before the fix) and the thread has ended.
    assert not t.is_alive() and raised in ([], [gpuq.Timeout])
    for f in busy + waiting:  # its jobs run on after the close
        f.result(30)


def test_signal_interrupts_result(client):
    import signal

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted()

    old = signal.signal(signal.SIGALRM, handler)
    f = client.submit("sleep", us=3_000_000)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        t0 = time.monotonic()
        with pytest.raises(Interrupted):
            f.result()
        assert time.monotonic() - t0 < 1.5
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    f.stop()
    with pytest.raises(gpuq.Cancelled):
        f.result(10)


def test_forked_child_waiting_on_a_watched_parent_job(client):
    f = client.submit("sleep", us=300_000)
    f.add_done_callback(lambda fut: None)  # watched in the parent
    # The parent's job is not the child's own.
    assert mp_tasks.raises_in_forked_child(f, gpuq.ForkedClient, 5)
    assert f.result(10) == 300_000


def test_ten_thousand_futures_held_before_any_is_read(client):
    # More futures than job slots (64 here): finished jobs give their slots back to the submits
    # that need them, their results kept for their futures; a submit with none finished waits.
    assert client.slot_count == 64
    futures = [client.submit("sleep", us=i % 5) for i in range(10_000)]
    assert [f.result(timeout=60) for f in futures] == [i % 5 for i in range(10_000)]
    assert all(f.info.status == "done" for f in futures)


def test_ten_thousand_futures_awaited_together(client):
    async def main():
        return await asyncio.gather(*(client.submit("sleep", us=i % 3) for i in range(10_000)))

    assert asyncio.run(main()) == [i % 3 for i in range(10_000)]


def test_try_submit_with_every_slot_running_is_queue_full():
    cfg = {"pools": [{"name": "cpu", "workers": 2}], "max_jobs_per_client": 4}
    with gpuq.testing.Daemon(cfg) as d, gpuq.connect(d.runtime_dir) as c:
        assert c.slot_count == 4
        running = [c.submit("sleep", us=300_000) for _ in range(c.slot_count)]
        with pytest.raises(gpuq.QueueFull, match="job slots"):
            c.try_submit("noop")
        with pytest.raises(gpuq.Timeout):
            c.submit("noop", timeout=0.001)
        assert c.submit("noop").result(timeout=30) == 0  # waited for a slot
        assert [f.result(timeout=30) for f in running] == [300_000] * c.slot_count
