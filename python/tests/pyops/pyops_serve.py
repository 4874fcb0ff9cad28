"""The ops of the pool `gpuq serve` starts in python/tests/test_serve.py."""
import time

import gpuq


@gpuq.op("triple")
def triple(x):
    """x times 3."""
    return x * 3


@gpuq.op("nap")
def nap(seconds):
    """Sleeps, then returns what it slept: a job still running when the drain begins."""
    time.sleep(seconds)
    return seconds
