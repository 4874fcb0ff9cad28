"""Python ops of the test pools (python/tests/test_python_ops.py): gpuqd's Python workers
import this module (its directory is in the pool's python.path)."""

import os
import time

import numpy as np

import gpuq

_started = []
print("pyops_mod: imported (a module that prints at import: the op listing must not mind)")


@gpuq.on_start
def _start():
    _started.append(os.getpid())


@gpuq.op("double")
def double(x, *, factor=2):
    """x times factor."""
    return x * factor


@gpuq.op("add")
def add(a, b):
    return a + b


@gpuq.op("identity")
def identity(x):
    return x


@gpuq.op("stats")
def stats(x):
    return x.mean(), x.max(), np.int32(7)


@gpuq.op("kwargs")
def kwargs(**kw):
    return kw


@gpuq.op("nothing")
def nothing():
    return None


@gpuq.op("fail")
def fail(msg="boom"):
    raise ValueError(msg)


@gpuq.op("crash")
def crash():
    os.abort()


@gpuq.op("write_input")
def write_input(x):
    x[0] = 1
    return x


@gpuq.op("big")
def big(n):
    return np.zeros(n, np.uint8)


@gpuq.op("spin")
def spin():
    while not gpuq.cancelled():
        time.sleep(0.001)
    raise gpuq.Cancelled("stopped")


@gpuq.op("sleep_forever")
def sleep_forever():
    time.sleep(3600)


@gpuq.op("whoami")
def whoami():
    c = gpuq.context()
    return {"pid": os.getpid(), "pool": c.pool_id, "worker": c.worker_id,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "env": os.environ.get("GPUQ_TEST_ENV"), "started": len(_started)}


@gpuq.op("oom")
def oom(msg="out of memory"):
    raise MemoryError(msg)


@gpuq.op("alloc")
def alloc(nbytes):
    """A numpy allocation of nbytes (past what the machine can give: numpy's MemoryError)."""
    return int(np.empty(int(nbytes), np.uint8).nbytes)
