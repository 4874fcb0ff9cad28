"""Ops of bench_spares.py's pool: a module that imports torch (what makes a worker's start take
seconds), a job that reports who served it, one that hangs past any cancel, and one that runs
until it is cancelled (to keep the other worker busy)."""

import os
import time

import torch

import gpuq

_warm = []


@gpuq.on_start
def _start():
    # One op before ready, as a model's warm-up would.
    _warm.append(float(torch.ones(16).sum()))


@gpuq.op("serve")
def serve():
    return {"pid": os.getpid(), "sum": float(torch.ones(4).sum())}


@gpuq.op("hang")
def hang():
    time.sleep(3600)  # ignores its flag: only a forced stop (or a kill) ends it


@gpuq.op("busy")
def busy():
    while not gpuq.cancelled():
        time.sleep(0.001)
    raise gpuq.Cancelled("stopped")
