"""Backpressure: try_submit raises gpuq.QueueFull, submit(timeout=) waits for room, expire_after.

Each client may queue queue_factor x workers jobs in a pool (20 with the default config on 2
CPUs), in a lane of its own; the pool serves the clients in turn. Run (gpuqd running,
$GPUQ_RUNTIME_DIR if needed):

    python examples/python/backpressure.py
"""
import time

import gpuq

clients = [gpuq.connect()]
pool = clients[0].pools[0]                      # the default pool
print(f"pool {pool['name']}: {pool['capacity']} jobs per client's lane, share {pool['client_share']}")
jobs = []                                       # 0.4 s sleep jobs, until there is no room
for _ in range(2):                              # the second pass refills what the workers took
    try:
        while True:
            try:
                jobs.append(clients[-1].try_submit("sleep", us=400_000))
            except gpuq.QueueFull as e:
                if "job slots" not in str(e):   # the ring (or this client's share) is full
                    raise
                clients.append(gpuq.connect())  # its 64 job slots all hold unfinished jobs:
                                                # many CPUs, a share larger than that
    except gpuq.QueueFull as e:                 # at once, never waits
        print(f"QueueFull after {len(jobs)} jobs: {e}")
    time.sleep(0.05)
client = clients[-1]
t0 = time.monotonic()
try:
    client.submit("noop", timeout=0.1)
    raise AssertionError("there should be no room")
except gpuq.Timeout as e:                       # also a TimeoutError
    print(f"submit(timeout=0.1) gave up after {time.monotonic() - t0:.2f} s: {e}")

# Without try_, submit waits for room; expire_after counts from the call.
t0 = time.monotonic()
late = client.submit("noop", expire_after=0.5)
print(f"submit waited {time.monotonic() - t0:.2f} s for room")
try:
    late.result()                               # the queued sleep jobs are ahead of it
    raise AssertionError("the job should have expired in the queue")
except gpuq.Expired as e:
    print(f"expired after {time.monotonic() - t0:.2f} s: {e}")
for j in jobs:                                  # stop what is left, to end quickly
    j.stop()
    try:
        j.result()
    except gpuq.Cancelled:                      # a concurrent.futures.CancelledError too
        pass
ended = [j.info.status for j in jobs]
print("ok; the sleep jobs ended", {s: ended.count(s) for s in sorted(set(ended))})
