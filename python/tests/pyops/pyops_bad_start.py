"""A Python pool module whose on_start fails (test_python_ops.py)."""
import gpuq


@gpuq.op("bad_start_op")
def bad_start_op():
    return 0


@gpuq.on_start
def _load():
    raise RuntimeError("on_start fails on purpose")
