"""Python ops of the spare-worker tests (python/tests/test_spares.py): who serves a job, a job
that hangs past any cancel, a cooperative spin, and a short piece of work whose answer is
checked."""

import os
import time

import gpuq


@gpuq.op("whoami")
def whoami():
    return {"pid": os.getpid(), "worker": gpuq.context().worker_id}


@gpuq.op("hang")
def hang():
    time.sleep(3600)  # ignores its flag: only a forced stop ends it


@gpuq.op("spin")
def spin():
    while not gpuq.cancelled():
        time.sleep(0.001)
    raise gpuq.Cancelled("stopped")


@gpuq.op("work")
def work(x, *, ms=0):
    if ms:
        time.sleep(ms / 1000)
    return x * 2, os.getpid()
