"""A Python pool module whose on_start never returns (test_python_ops.py: start_timeout_ms)."""
import sys
import time

import gpuq


@gpuq.op("hang_start_op")
def hang_start_op():
    return 0


@gpuq.on_start
def _load():
    print("pyops_hang_start: on_start hangs on purpose", file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)
