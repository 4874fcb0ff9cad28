"""Ops of python/tests/test_acall.py's pool: a call that leaves a trace (a file), so that the
test can tell a call that never reached the worker from one that ran."""

import gpuq


@gpuq.op("touch")
def touch(path, value=0):
    """Creates ``path`` (the trace that this call ran) and returns ``value`` doubled."""
    with open(path, "w") as f:
        f.write(str(value))
    return value * 2


@gpuq.op("scale")
def scale(x, *, factor=2):
    return x * factor
