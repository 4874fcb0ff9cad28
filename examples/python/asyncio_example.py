"""gpuq futures in asyncio: await one, gather several, time out and cancel one.

A gpuq.Future is awaitable; the client's one watcher thread finishes it, with no thread per
job. Run (gpuqd running, $GPUQ_RUNTIME_DIR set if needed):

    python examples/python/asyncio_example.py
"""
import asyncio
import time

import numpy as np

import gpuq


async def main(client: gpuq.Client) -> None:
    # await: the job's result (a sleep job's is its `us`).
    assert await client.submit("sleep", us=10_000) == 10_000

    # gather: several jobs at once; results in the order given.
    t0 = time.monotonic()
    results = await asyncio.gather(*(client.submit("sleep", us=us)
                                     for us in (200_000, 100_000, 150_000)))
    assert results == [200_000, 100_000, 150_000]
    print(f"gather: 3 sleep jobs in {time.monotonic() - t0:.3f} s")

    # Tensor helpers return futures too.
    x = client.array(np.linspace(-2, 2, 8, dtype=np.float32))
    y = await client.activation(x, "relu")
    assert np.array_equal(y, np.maximum(x, 0))

    # wait_for: on timeout asyncio cancels the future, which cancels the job.
    fut = client.submit("sleep", us=5_000_000)
    try:
        await asyncio.wait_for(fut, timeout=0.1)
    except asyncio.TimeoutError:
        pass
    try:
        fut.result(timeout=5)
    except gpuq.Cancelled as e:                  # also a concurrent.futures.CancelledError
        print("cancelled:", e)
    assert fut.info.status == "cancelled"


with gpuq.connect() as client:
    asyncio.run(main(client))
print("ok")
