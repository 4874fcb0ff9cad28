"""Ray tasks and actors running a Python op on their own node's gpuqd (docs/scale-out.md).

Each node runs a gpuqd whose Python pool imports examples/scale-out/node_ops.py (op "score").
A Ray worker reaches its node's daemon with the ordinary client: the system service's
/run/gpuq, or $GPUQ_RUNTIME_DIR in the environment of that node's `ray start`, which Ray's
workers inherit. A task whose node has no gpuqd gets gpuq.Disconnected, and Ray retries it
(retry_exceptions) where there is room. Run:

    RAY_ADDRESS=HEAD:6379 python examples/ray/ray_tasks.py [--tasks N]
    python examples/ray/ray_tasks.py      # no RAY_ADDRESS: a one-node Ray of its own
"""
import argparse
import collections
import time

import numpy as np
import ray

import gpuq

W = np.random.default_rng(0).standard_normal((16, 8), dtype=np.float32)


def rows(i):
    return np.random.default_rng(i + 1).standard_normal((4, 16), dtype=np.float32)


@ray.remote(max_retries=3, retry_exceptions=[gpuq.Disconnected])
def score(x, w):
    client = None
    try:
        client = gpuq.default_client()      # this node's gpuqd, connected once per Ray worker
        return ray.get_runtime_context().get_node_id(), client.call("score", x, w)
    except gpuq.Disconnected:
        if client is not None:
            client.close()                  # the next task connects anew (a restarted gpuqd)
        time.sleep(1.0)                     # so that a node without gpuqd cannot eat the queue
        raise                               # Ray retries it


@ray.remote
class Scorer:
    """An actor with a gpuq client of its own, for work that keeps state between calls."""

    def __init__(self):
        self.client = gpuq.connect(name="ray-actor")

    def score(self, x, w):
        return ray.get_runtime_context().get_node_id(), self.client.call("score", x, w)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=200)
    n = ap.parse_args().tasks
    ray.init()                              # RAY_ADDRESS, else a local one-node Ray

    results = ray.get([score.remote(rows(i), W) for i in range(n)])
    for i, (_, y) in enumerate(results):
        np.testing.assert_allclose(y, np.tanh(rows(i) @ W), rtol=1e-5, atol=1e-6)
    per_node = collections.Counter(node[:8] for node, _ in results)
    print(f"{n} tasks right, per Ray node: {dict(per_node)}")

    # One actor per node (SPREAD places them apart where there are several nodes).
    actors = [Scorer.options(scheduling_strategy="SPREAD").remote()
              for _ in range(len(ray.nodes()))]
    calls = [actors[i % len(actors)].score.remote(rows(i), W) for i in range(n)]
    for i, (_, y) in enumerate(ray.get(calls)):
        np.testing.assert_allclose(y, np.tanh(rows(i) @ W), rtol=1e-5, atol=1e-6)
    per_node = collections.Counter(node[:8] for node, _ in ray.get(calls))
    print(f"{n} actor calls right, per Ray node: {dict(per_node)}")
    print("ok")
