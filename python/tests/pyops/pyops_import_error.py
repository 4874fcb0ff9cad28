"""A Python pool module that fails to import (test_python_ops.py)."""
import gpuq


@gpuq.op("never")
def never():
    return 0


raise RuntimeError("this module fails to import on purpose")
