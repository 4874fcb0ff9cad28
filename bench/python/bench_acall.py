"""What Client.acall costs (docs/web.md, "acall: how it waits"): its round trip against call()
and ``await submit_call()``, and, with the pool's ring full, the CPU its waiting calls burn,
how long the event loop is held up meanwhile, and how soon they are sent once room appears.

Against a private gpuqd with one Python pool of 1 worker and a ring of 1 cell
(queue_factor 1), whose op ``scale`` (python/tests/pyops/pyops_async.py) returns its array
times a factor:

- round trip: N sequential calls of a 4-element array from one client, idle pool; p50 and p99
  of ``client.call``, ``await client.submit_call`` and ``await client.acall``;
- waiting: the worker held by a long job of another client and the ring's cell taken, W
  ``acall`` tasks wait for room for S seconds while a 10 ms ticker runs on the same loop; the
  process's CPU time over those S seconds (the feeder thread's tries, every 2 ms, and
  everything else of the process) and the ticker's largest gap;
- release: the holding job stopped, the time until the first waiting call has its answer, and
  until all have (one worker runs them one after another).

    GPUQ_GPUQD=build/daemon/gpuqd python bench/python/bench_acall.py [--calls N] [--waiting W]
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import statistics
import sys
import time

import numpy as np

import gpuq
import gpuq.testing

OPS = pathlib.Path(__file__).resolve().parents[2] / "python" / "tests" / "pyops"
CONFIG = {"pools": [{"name": "py", "kind": "cpu", "workers": 1,
                     "python": {"interpreter": sys.executable, "modules": ["pyops_async"],
                                "path": [str(OPS)]}}],
          "queue_factor": 1, "client_queue_share": 1.0}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def us(x: float) -> str:
    return f"{x * 1e6:.0f} us"


async def round_trips(client: gpuq.Client, n: int):
    x = np.ones(4)
    out = {}
    for name in ("call", "await submit_call", "acall"):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            if name == "call":
                client.call("scale", x, pool="py")
            elif name == "await submit_call":
                await client.submit_call("scale", x, pool="py")
            else:
                await client.acall("scale", x, pool="py")
            times.append(time.perf_counter() - t0)
        out[name] = (statistics.median(times), pct(times, 0.99))
    return out


async def waiting(client: gpuq.Client, other: gpuq.Client, w: int, seconds: float):
    hold = other.submit("sleep", us=60_000_000, pool="py")  # the sleep op's longest
    while not hold.running():
        if hold.done():
            hold.result()  # raises why
        await asyncio.sleep(0.005)
    filler = other.try_submit("sleep", us=1, pool="py")
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.monotonic())
            await asyncio.sleep(0.01)

    tick = asyncio.create_task(ticker())
    calls = [asyncio.ensure_future(client.acall("scale", np.full(4, float(i)), pool="py"))
             for i in range(w)]
    await asyncio.sleep(0.2)  # all waiting now
    cpu0, t0 = time.process_time(), time.monotonic()
    await asyncio.sleep(seconds)
    cpu = time.process_time() - cpu0
    span = time.monotonic() - t0
    gap = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert not any(c.done() for c in calls)
    released = time.monotonic()
    hold.stop()
    first = None
    for c in asyncio.as_completed(calls):
        await c
        if first is None:
            first = time.monotonic() - released
    last = time.monotonic() - released
    tick.cancel()
    filler.result(timeout=30)
    return cpu / span, gap, first, last


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--waiting", type=int, default=200)
    p.add_argument("--seconds", type=float, default=5.0, help="at most 50")
    a = p.parse_args()
    with gpuq.testing.Daemon(CONFIG) as d, gpuq.connect(d.runtime_dir) as client, \
            gpuq.connect(d.runtime_dir) as other:
        rt = asyncio.run(round_trips(client, a.calls))
        print(f"round trip, {a.calls} sequential calls, idle pool of 1 worker (p50, p99):")
        for name, (p50, p99) in rt.items():
            print(f"  {name:18} {us(p50):>8} {us(p99):>8}")
        cpu, gap, first, last = asyncio.run(waiting(client, other, a.waiting, a.seconds))
        print(f"{a.waiting} acalls waiting for room for {a.seconds:g} s: the process used "
              f"{cpu * 100:.1f}% of a CPU; the loop's largest tick gap {gap * 1e3:.1f} ms "
              f"(period 10 ms)")
        print(f"room back (holding job stopped): first answer after {first * 1e3:.1f} ms, all "
              f"{a.waiting} after {last * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
