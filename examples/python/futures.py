"""gpuq futures with concurrent.futures: wait, as_completed, add_done_callback, result(timeout).

Every submit returns a gpuq.Future, a concurrent.futures.Future. The jobs here are `sleep` jobs
(param us: microseconds) on the default pool. Run (gpuqd running, $GPUQ_RUNTIME_DIR if needed):

    python examples/python/futures.py
"""
import concurrent.futures as cf
import threading

import gpuq

client = gpuq.connect()

# wait(): returns when the first job ends; the others go on.
futs = [client.submit("sleep", us=us) for us in (100_000, 400_000, 300_000)]
done, not_done = cf.wait(futs, return_when=cf.FIRST_COMPLETED)
assert [f.result() for f in done] == [100_000] and len(not_done) == 2

# as_completed(): the rest, in the order they end (a sleep job's result is its `us`).
assert sorted(f.result() for f in cf.as_completed(not_done)) == [300_000, 400_000]

# add_done_callback(): called in the client's watcher thread when the job ends.
ended = threading.Event()
seen = []
fut = client.submit("sleep", us=50_000)
fut.add_done_callback(lambda f: (seen.append((f.result(), threading.current_thread().name)),
                                 ended.set()))
assert ended.wait(10) and seen == [(50_000, "gpuq-watcher")]

# result(timeout): concurrent.futures.TimeoutError if still pending; the job goes on.
fut = client.submit("sleep", us=300_000)
try:
    fut.result(timeout=0.05)
    raise AssertionError("a 300 ms job ended within 50 ms")
except cf.TimeoutError:
    print("still pending after 50 ms; running:", fut.running())
assert fut.result() == 300_000

# info: what the daemon reported for the finished job.
print(fut.info)
assert fut.info.status == "done" and fut.info.run_ns >= 300_000_000
print("ok")
