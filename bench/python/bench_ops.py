"""The Python ops of bench_python.py's Python pool (``--systems pyop``): gpuqd's Python workers
import this module (the pool's ``python.path`` is this directory). They mirror the peers'
module-level functions in bench_python.py: ``nothing`` returns None (``noop`` is taken: it is
a built-in op's name), ``identity`` its argument (the worker gets the caller's array as a
read-only view and writes it into the job's answer)."""

import gpuq


@gpuq.op("nothing")
def nothing():
    return None


@gpuq.op("identity")
def identity(x):
    return x
