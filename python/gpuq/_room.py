"""Room in a client's segment for its Python calls and arrays.

Each Python call (submit_call, the Executor) takes one block of the segment: its header, the
arguments copied in, and the room of its answer. The block goes back when the call's future
has read the answer and nothing else holds it (an answer of at most
_future.COPY_ANSWER_BYTES is read from a copy). A future nobody has read yet still holds its
block after the job ends: when an allocation finds no room, those are read now (from copies),
and while there is still none, the allocation waits for a pending call to end.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from . import _errors
from ._future import QUEUED, RUNNING


def settle_finished(conn: Any) -> int:
    """Finishes the futures of this connection's Python calls whose jobs have ended but which
    nobody has read yet, each from a copy of its answer, so that their blocks go back to the
    segment; returns how many."""
    settled = 0
    for f in list(conn.holders):
        job = f._job
        if job is None:
            conn.holders.discard(f)
            continue
        if job.poll() in (QUEUED, RUNNING):
            continue
        t = job.wait(0)
        if t is None:
            continue
        f._finish(t, job, copy_answer=True)
        if f._state == "PENDING":  # it went on with a next job (a spilled result's piece)
            continue
        conn.holders.discard(f)
        settled += 1
    return settled


def allocate(conn: Any, nbytes: int, timeout: Optional[float]) -> np.ndarray:
    """A block of ``nbytes`` of the segment for one call. When there is no room: the calls
    that have ended but not been read give theirs back (settle_finished); while there is
    still none, this waits for a pending call to end, up to ``timeout`` seconds (None: as long
    as it takes), as a submit waits for room in the ring. OutOfMemory when nothing pending
    could make room (the segment is held by arrays and results the caller keeps) or when the
    timeout passes."""
    try:
        return conn.native.allocate(nbytes)
    except _errors.OutOfMemory as e:
        error = e
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if settle_finished(conn) == 0:
            pending = [f for f in list(conn.holders) if f._job is not None]
            if not pending:
                raise error
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise _errors.OutOfMemory(
                    f"{error} (waited {timeout} s for {len(pending)} "
                    "pending calls to give room back)"
                ) from None
            job = pending[0]._job
            if job is not None:  # read again: another thread may have finished it meanwhile
                job.wait(int((0.01 if left is None else min(0.01, left)) * 1e9))
        try:
            return conn.native.allocate(nbytes)
        except _errors.OutOfMemory as e:
            error = e
