"""Arrays in the shared segment against plain numpy arrays, and when segment memory comes back.

client.empty/zeros/array make arrays in this client's shared-memory segment: a job reads and
writes them in place. A plain numpy array given as a job's input is copied into the segment
first, once per job. Run (gpuqd running, $GPUQ_RUNTIME_DIR set if needed):

    python examples/python/arrays.py
"""
import numpy as np

import gpuq

client = gpuq.connect()
n = 1 << 20

plain = np.ones(n, np.uint8)                     # ordinary process memory
shared = client.array(plain)                     # a copy in the segment
filled = client.empty(n, np.uint8)               # made in the segment, filled in place
filled[:] = 7
zeros = client.zeros((256, 256), np.float32)
assert not client.in_segment(plain)
assert client.in_segment(shared) and client.in_segment(filled) and client.in_segment(zeros)
assert client.in_segment(filled[10:20])          # a view of a segment array is in it too

out = client.empty(n, np.uint8)                  # outputs must be in the segment
assert client.submit("echo", shared, out=out).result() is out       # no copy
assert client.submit("echo", plain, out=out).result().sum() == n    # copied in for this job
try:
    client.submit("echo", shared, out=np.empty(n, np.uint8))
    raise AssertionError("out= outside the segment should be refused")
except gpuq.InvalidArgument as e:                # also a ValueError
    print("out= outside the segment:", e)

# Segment memory returns when the last array or view over it is gone (and no job uses it).
half = client.segment_bytes // 2 + 4096          # more than half: two cannot coexist
a = client.empty(half, np.uint8)
view = a[:16]
del a
try:
    client.empty(half, np.uint8)
    raise AssertionError("the view should keep the first block alive")
except gpuq.OutOfMemory as e:                    # also a MemoryError
    print("while a view lives:", e)
del view
b = client.empty(half, np.uint8)                 # the first block's memory is free again
print("segment", client.segment_bytes, "bytes; allocated", b.nbytes, "after the view went")
print("ok")
