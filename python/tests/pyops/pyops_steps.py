"""Step ops for test_steps.py (docs/python.md, "Step-level batching").

``gen`` is a tiny autoregressive model in integers, so that a batched step computes exactly
what a step alone would (no floating-point differences between batch sizes): a sequence's state
is a hidden vector and its last token; each step mixes the hidden vectors of every live sequence
in one matrix product, and each sequence's next token depends only on its own row.
:func:`alone` runs the same model for one sequence, outside any worker: the reference."""

from __future__ import annotations

import time

import numpy as np

import gpuq

P = 1_000_003  # the arithmetic is modulo this prime: exact in int64
H = 8  # hidden size
V = 50  # tokens
_rng = np.random.default_rng(1234)
A = _rng.integers(0, 1000, size=(H, H), dtype=np.int64)
B = _rng.integers(0, 1000, size=(V, H), dtype=np.int64)

# What each step of this worker's ``gen`` took: how many sequences (for the test's look at
# joining and leaving).
step_sizes: list = []


def gen_start(seed, length):
    if not 1 <= length <= 1000:
        raise ValueError(f"length {length} is not 1 to 1000")
    h = np.random.default_rng(seed).integers(0, P, size=H, dtype=np.int64)
    return {"h": h, "token": int(seed) % V, "left": int(length)}


def _advance(hs, tokens):
    return (hs @ A.T + B[tokens]) % P


@gpuq.step_op("gen", start=gen_start, max_batch_size=32)
def gen_step(states):
    """One token for each live sequence."""
    step_sizes.append(len(states))
    hs = _advance(np.stack([s["h"] for s in states]), np.array([s["token"] for s in states]))
    out = []
    for s, h in zip(states, hs):
        s["h"] = h
        s["token"] = int(h.sum() % V)
        s["left"] -= 1
        out.append((s["token"], s["left"] == 0))
    return out


def alone(seed, length):
    """The tokens ``gen`` makes for one sequence, stepped on its own."""
    s = gen_start(seed, length)
    tokens = []
    done = False
    while not done:
        ((token, done),) = gen_step([s])
        tokens.append(token)
    return tokens


@gpuq.op("gen_steps_seen")
def gen_steps_seen():
    """The sizes of the steps ``gen`` took in this worker so far."""
    return np.array(step_sizes, dtype=np.int64)


def count_start(n, delay=0.0, fail_at=-1, width=0):
    if n < 0:
        raise ValueError(f"cannot count to {n}")
    return {"i": 0, "n": n, "delay": delay, "fail_at": fail_at, "width": width}


@gpuq.step_op("count_up", start=count_start, max_batch_size=8)
def count_step(states):
    """0, 1, ... n-1, a part a step (``width``: each an array of that many); ``delay`` seconds
    per step (the longest asked); a state's ``fail_at`` step raises (failing every sequence of
    that step)."""
    delay = max(s["delay"] for s in states)
    if delay:
        time.sleep(delay)
    for s in states:
        if s["i"] == s["fail_at"]:
            raise ValueError(f"boom at step {s['i']}")
    out = []
    for s in states:
        part = np.full((s["width"],), s["i"], dtype=np.int64) if s["width"] else s["i"]
        s["i"] += 1
        out.append((part, s["i"] >= s["n"]))
    return out


@gpuq.step_op("bad_shape", start=lambda n: {"n": n})
def bad_shape(states):
    """Returns a result too few (or, for n == 1, a bare value)."""
    if states[0]["n"] == 1:
        return [7 for _ in states]
    return [(0, True)] * (len(states) - 1)


@gpuq.op("plain")
def plain(x):
    return x * 2
