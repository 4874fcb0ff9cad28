"""What the scale-out tests' Ray and Dask tasks run (docs/scale-out.md): the recipe's task body.

Ray and Dask processes import this module by reference (the tests put this folder on the
``PYTHONPATH`` of ``ray start``, ``dask scheduler`` and ``dask worker``). Each task calls op
``score`` (examples/scale-out/node_ops.py) on its node's gpuqd, the one ``$GPUQ_RUNTIME_DIR``
of its engine worker names, and returns that directory with the result, so a test can tell
which daemon served it. A task that finds its node's gpuqd gone records the failure in
``$GPUQ_SCALEOUT_FAILURES`` (one line per attempt) and raises ``gpuq.Disconnected`` for the
engine to retry: on Ray after ``BACKOFF_S`` with its client closed (``score_on_node``, as
examples/ray/ray_tasks.py does), on Dask through the workers' preload
examples/dask/gpuq_resource.py.
"""

from __future__ import annotations

import os
import time
from typing import Tuple

import numpy as np

import gpuq

# How long a Ray task that found no gpuqd holds its worker before it raises: long enough that a
# node without a daemon cannot fail the queue's tasks faster than the others run them.
BACKOFF_S = 0.5


def inputs(i: int) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(i)
    return (rng.standard_normal((4, 16), dtype=np.float32),
            rng.standard_normal((16, 8), dtype=np.float32))


def expected(i: int) -> np.ndarray:
    x, w = inputs(i)
    return np.tanh(x @ w)


def score_on_node(i: int) -> Tuple[str, np.ndarray]:
    """Task i: ``score`` of its inputs on this node's gpuqd; (the daemon's directory, result)."""
    x, w = inputs(i)
    client = None
    try:
        client = gpuq.default_client()
        return os.environ["GPUQ_RUNTIME_DIR"], client.call("score", x, w)
    except gpuq.Disconnected as e:
        record_failure(i, e)
        if client is not None:
            client.close()  # the next task connects anew: to a restarted gpuqd, or fails at once
        time.sleep(BACKOFF_S)
        raise


def record_failure(i: int, e: BaseException) -> None:
    path = os.environ.get("GPUQ_SCALEOUT_FAILURES")
    if path:
        line = f"{os.environ.get('GPUQ_RUNTIME_DIR')} {type(e).__name__} {i}\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one short O_APPEND write: lines never interleave
        finally:
            os.close(fd)


# What a Ray task does besides its gpuq call. Tasks of a few hundred microseconds would nearly
# all run on the head's two leased workers before the other node's leases come through.
RAY_TASK_WORK_S = 0.005


def ray_task(i: int) -> Tuple[str, str, np.ndarray]:
    """Task i on Ray: (the Ray node's id, the daemon's directory, the result)."""
    import ray

    time.sleep(RAY_TASK_WORK_S)
    return (ray.get_runtime_context().get_node_id(), *score_on_node(i))


def dask_task(i: int) -> Tuple[str, str, np.ndarray]:
    """Task i on Dask: (the worker's name, the daemon's directory, the result). Calls gpuq
    through the workers' preload examples/dask/gpuq_resource.py, which takes the worker's
    "gpuq" resource away when its node's gpuqd is gone."""
    import gpuq_resource
    from distributed import get_worker

    try:
        y = gpuq_resource.call("score", *inputs(i))
    except gpuq.Disconnected as e:
        record_failure(i, e)
        raise
    return get_worker().name, os.environ["GPUQ_RUNTIME_DIR"], y


class Scorer:
    """An actor's state: a client of its node's gpuqd of its own, made once."""

    def __init__(self) -> None:
        self.client = gpuq.connect(name="ray-actor")

    def score(self, i: int) -> Tuple[str, np.ndarray]:
        return os.environ["GPUQ_RUNTIME_DIR"], self.client.call("score", *inputs(i))
