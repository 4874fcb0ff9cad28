"""A Python pool module whose on_start fails its first N calls (test_python_ops.py): each call
appends a line to the file $GPUQ_TEST_START_COUNTER and fails while the file has at most
$GPUQ_TEST_START_FAILS lines."""
import os

import gpuq


@gpuq.op("flaky_start_op")
def flaky_start_op(x):
    return x + 1


@gpuq.on_start
def _load():
    path = os.environ["GPUQ_TEST_START_COUNTER"]
    with open(path, "a") as f:
        f.write("start\n")
    with open(path) as f:
        starts = sum(1 for _ in f)
    fails = int(os.environ["GPUQ_TEST_START_FAILS"])
    if starts <= fails:
        raise RuntimeError(f"on_start fails on purpose ({starts} of {fails})")
