"""Streaming ops for test_streams.py: generator functions (docs/python.md, "Streaming")."""

from __future__ import annotations

import asyncio
import time

import numpy as np

import gpuq


def _mark(path, text):
    if path:
        with open(path, "a") as f:
            f.write(text + "\n")


@gpuq.op("tokens")
def tokens(n, delay=0.0, marker=None):
    """n strings, ``delay`` seconds apart; ``marker``: a file told how the generator ended."""
    try:
        for i in range(n):
            if i and delay:
                time.sleep(delay)
            yield f"tok{i}"
        _mark(marker, "returned")
    except GeneratorExit:
        _mark(marker, f"closed after {i}")
        raise


@gpuq.op("rows")
def rows(n, width):
    """n arrays of ``width`` int64s, the i-th all i."""
    for i in range(n):
        yield np.full((width,), i, dtype=np.int64)


@gpuq.op("agen")
async def agen(n):
    """An async generator: n ints, each after an await."""
    for i in range(n):
        await asyncio.sleep(0)
        yield i


@gpuq.op("fails_after")
def fails_after(k):
    for i in range(k):
        yield i
    raise ValueError(f"boom after {k}")


@gpuq.op("big_part")
def big_part(nbytes):
    yield np.zeros((nbytes,), dtype=np.uint8)


@gpuq.op("plain")
def plain(x):
    return x * 2
