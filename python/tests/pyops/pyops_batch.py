"""Batched Python ops for python/tests/test_batching.py (docs/python.md, "Dynamic batching").

Each returns, beside its rows, a `meta` array with one row per input row, [call id, rows of the
call], so a test can tell which jobs shared a call."""

import itertools
import os
import time

import numpy as np

import gpuq

_calls = itertools.count()
_RNG = np.random.default_rng(1234)
W1 = _RNG.standard_normal((8, 16)).astype(np.float32)
W2 = _RNG.standard_normal((16, 3)).astype(np.float32)


def mlp_numpy(x, scale=1.0):
    """The model: what every op below computes, row by row."""
    return (np.maximum(np.asarray(x, np.float32) @ W1, 0) @ W2 * np.float32(scale)).astype(
        np.float32)


def _meta(rows):
    call = os.getpid() * 1_000_000 + next(_calls)
    return np.tile(np.array([[call, rows]], dtype=np.int64), (rows, 1))


def _model(x, scale, pause):
    if pause:
        time.sleep(pause)
    return mlp_numpy(x, scale), _meta(x.shape[0])


@gpuq.op("bmlp", max_batch_size=64, max_queue_delay_us=2000)
def bmlp(x, *, scale=1.0, pause=0.0):
    """The model, batched."""
    return _model(x, scale, pause)


@gpuq.op("umlp")
def umlp(x, *, scale=1.0, pause=0.0):
    """The model, one job per call."""
    return _model(x, scale, pause)


@gpuq.op("bwait", max_batch_size=64, max_queue_delay_us=1_000_000)
def bwait(x, *, scale=1.0):
    """The model, batched with a long delay: a batch stays open while a test acts on it."""
    return _model(x, scale, 0.0)


@gpuq.op("bsleep", max_batch_size=64, max_queue_delay_us=0)
def bsleep(x, *, seconds=0.0, cooperative=True):
    """Sleeps, looking at gpuq.cancelled() when cooperative, then returns x and its meta."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cooperative and gpuq.cancelled():
            raise gpuq.Cancelled("bsleep: stopped")
        time.sleep(0.005)
    return np.array(x), _meta(x.shape[0])


@gpuq.op("bfail", max_batch_size=64, max_queue_delay_us=0)
def bfail(x):
    """Raises when any row's first value is negative (the whole call fails)."""
    if (np.asarray(x)[:, 0] < 0).any():
        raise ValueError("bfail: a negative row")
    return np.array(x), _meta(x.shape[0])


@gpuq.op("bbad", max_batch_size=64, max_queue_delay_us=0)
def bbad(x):
    """Returns one row whatever it was given: wrong for a batch of several rows."""
    return np.asarray(x)[:1].copy()


@gpuq.op("bsmall", max_batch_size=4, max_queue_delay_us=0)
def bsmall(x):
    """The model, batched 4 rows at most: its calls show where the limit holds."""
    return _model(x, 1.0, 0.0)


@gpuq.op("block")
def block(seconds=0.0):
    """Holds its worker for `seconds`: the jobs sent meanwhile queue up behind it."""
    time.sleep(seconds)
    return None
