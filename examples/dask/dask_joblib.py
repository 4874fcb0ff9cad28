"""joblib on Dask (joblib.parallel_backend("dask")): each call runs on a Dask worker, which
uses its own node's gpuqd (docs/scale-out.md, "Dask"; the workers as dask_map.py says). Run:

    DASK_SCHEDULER_ADDRESS=tcp://HOST:8786 python examples/dask/dask_joblib.py [--tasks N]
"""
import argparse
import collections
import os

import dask
import numpy as np
from distributed import Client, get_worker
from joblib import Parallel, delayed, parallel_backend

PRELOAD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpuq_resource.py")


def inputs(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 16), dtype=np.float32),
            rng.standard_normal((16, 8), dtype=np.float32))


def score(seed):
    import gpuq_resource                    # the workers' preload

    return get_worker().name, gpuq_resource.call("score", *inputs(seed))


def connect():
    if dask.config.get("scheduler-address", None):   # DASK_SCHEDULER_ADDRESS
        return Client()
    return Client(n_workers=2, threads_per_worker=2, resources={"gpuq": 2}, preload=[PRELOAD])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    n = ap.parse_args().tasks
    # The backend passes resources= and retries= on to each client.submit.
    with connect(), parallel_backend("dask", resources={"gpuq": 1}, retries=3):
        results = Parallel()(delayed(score)(seed) for seed in range(n))
    for seed, (_, y) in enumerate(results):
        x, w = inputs(seed)
        np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    per_worker = collections.Counter(name for name, _ in results)
    print(f"{n} joblib calls right, per Dask worker: {dict(per_worker)}")
    print("ok")
