"""gpuq's exceptions: one class per error code, under gpuq.Error, with e.code and e.message.

Some are raised by the call itself (nothing was queued), others by result() of a job that
failed. Run (gpuqd running, $GPUQ_RUNTIME_DIR set if needed):

    python examples/python/errors.py
"""
import numpy as np

import gpuq


def show(what, e):
    print(f"{what:30} {type(e).__name__} (code {e.code} {e.code_name}): {e.message}")


client = gpuq.connect()
try:
    client.submit("no_such_op")                      # refused by the call: nothing queued
    raise AssertionError("not raised")
except gpuq.UnknownOp as e:                          # also a LookupError
    show("unknown op", e)
try:
    client.gemm(np.ones((4, 3), np.float32), np.ones((4, 3), np.float32))
    raise AssertionError("not raised")
except ValueError as e:                              # gpuq.InvalidArgument is a ValueError
    assert isinstance(e, gpuq.InvalidArgument)
    show("gemm, shapes that disagree", e)
try:
    client.submit("sleep", us=-1).result()           # queued; the worker refused it
    raise AssertionError("not raised")
except gpuq.InvalidArgument as e:
    show("sleep us=-1 (from the job)", e)
fut = client.submit("sleep", us=1000, expire_after=0)
assert isinstance(fut.exception(), gpuq.Expired)    # exception() returns it, result() raises it
show("expire_after=0", fut.exception())
print("   its JobInfo:", fut.info)
try:
    client.empty(2 * client.segment_bytes, np.uint8)
    raise AssertionError("not raised")
except MemoryError as e:                             # gpuq.OutOfMemory is a MemoryError
    show("array larger than the segment", e)
client.close()
try:
    client.submit("noop")
    raise AssertionError("not raised")
except gpuq.Error as e:                              # every gpuq exception
    assert isinstance(e, gpuq.ClientClosed)
    show("after close()", e)
print("ok")
