"""dask.distributed: client.map over tasks that run a Python op on their own node's gpuqd
(docs/scale-out.md, "Dask").

Each node runs a gpuqd whose Python pool imports examples/scale-out/node_ops.py (op "score"),
and `dask worker` processes whose environment leads to it (the system service's /run/gpuq, or
$GPUQ_RUNTIME_DIR, which the worker inherits), started with the preload gpuq_resource.py and
the resource "gpuq". The tasks ask for the resource and retries: a task whose node's gpuqd is
gone raises gpuq.Disconnected, its worker gives up "gpuq", and Dask retries the task on a
worker whose node has a gpuqd. Run:

    DASK_SCHEDULER_ADDRESS=tcp://HOST:8786 python examples/dask/dask_map.py [--tasks N]
    python examples/dask/dask_map.py      # no scheduler address: a LocalCluster of its own
"""
import argparse
import collections
import os

import dask
import numpy as np
from distributed import Client, get_worker

PRELOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpuq_resource.py")
W = np.random.default_rng(0).standard_normal((16, 8), dtype=np.float32)


def rows(i):
    return np.random.default_rng(i + 1).standard_normal((4, 16), dtype=np.float32)


def score(x, w):
    import gpuq_resource                    # the workers' preload

    return get_worker().name, gpuq_resource.call("score", x, w)   # this node's gpuqd


def connect():
    if dask.config.get("scheduler-address", None):   # DASK_SCHEDULER_ADDRESS
        return Client()
    # No cluster given: a LocalCluster whose workers are set up as a node's are.
    return Client(n_workers=2, threads_per_worker=2, resources={"gpuq": 2}, preload=[PRELOAD])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    n = ap.parse_args().tasks
    with connect() as client:
        futures = client.map(score, [rows(i) for i in range(n)], [W] * n,
                             resources={"gpuq": 1}, retries=3, pure=False)
        results = client.gather(futures)
    for i, (_, y) in enumerate(results):
        np.testing.assert_allclose(y, np.tanh(rows(i) @ W), rtol=1e-5, atol=1e-6)
    per_worker = collections.Counter(name for name, _ in results)
    print(f"{n} tasks right, per Dask worker: {dict(per_worker)}")
    print("ok")
