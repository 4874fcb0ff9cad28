"""joblib on Ray (joblib.parallel_backend("ray")): each call runs in a Ray worker, which uses
its own node's gpuqd (docs/scale-out.md). Run:

    RAY_ADDRESS=HEAD:6379 python examples/ray/ray_joblib.py [--tasks N]
"""
import argparse
import collections

import numpy as np
import ray
from joblib import Parallel, delayed, parallel_backend
from ray.util.joblib import register_ray

import gpuq


def inputs(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((4, 16), dtype=np.float32),
            rng.standard_normal((16, 8), dtype=np.float32))


def score(seed):
    x, w = inputs(seed)                     # Ray's joblib workers are actors: no task retries
    return ray.get_runtime_context().get_node_id(), gpuq.default_client().call("score", x, w)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    n = ap.parse_args().tasks
    ray.init()                              # RAY_ADDRESS, else a local one-node Ray
    register_ray()
    with parallel_backend("ray"):
        results = Parallel(n_jobs=-1)(delayed(score)(seed) for seed in range(n))  # all CPUs
    for seed, (_, y) in enumerate(results):
        x, w = inputs(seed)
        np.testing.assert_allclose(y, np.tanh(x @ w), rtol=1e-5, atol=1e-6)
    per_node = collections.Counter(node[:8] for node, _ in results)
    print(f"{n} joblib calls right, per Ray node: {dict(per_node)}")
    print("ok")
