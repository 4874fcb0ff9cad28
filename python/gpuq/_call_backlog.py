"""Calls that never wait in the caller's thread (Client.asubmit_call, acall).

The caller's thread (an event loop's) only ever tries the submit, without waiting (try_only,
and no wait for room in the segment). When there is no room (the ring, this client's share of
it, its job slots or its segment are full) the call waits in a Backlog of its connection and
pool, in order, and that backlog's one feeder thread sends it when room appears: it sleeps on
this connection's pending jobs (the end of one wakes it at once) for at most 2 ms between
tries, since room also appears when a worker takes a queued job or another client's job leaves
the ring, which nothing here is woken by. One thread per waiting pool, not one per waiting
call; no polling while nothing waits. The future exists at once, with no job
(``Future._queue``); cancelling it while it waits takes the call out: nothing is sent."""

from __future__ import annotations

import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from . import _errors, _options
from ._backlog import Backlog
from ._calls import output_bytes_for, submit_python
from ._future import Future, unfinished
from ._options import JobOptions


class Waiting:
    """A call waiting in the client for room (asubmit_call): submit_python's arguments, and
    when the call was made (its options' timeout and expire_ns count from then)."""

    __slots__ = ("op", "args", "kwargs", "options", "output_bytes", "start")

    def __init__(
        self,
        op: str,
        args: Tuple[Any, ...],
        kwargs: Optional[Dict[str, Any]],
        options: JobOptions,
        output_bytes: Optional[int],
        start: float,
    ) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.options = options
        self.output_bytes = output_bytes
        self.start = start


def _late(pool: str, w: Waiting, now: float) -> Optional[BaseException]:
    """Why ``w`` may not wait any longer, or None."""
    waited = now - w.start
    timeout = _options.seconds(w.options.timeout_ns)
    expire_after = _options.seconds(w.options.expire_ns)
    if timeout is not None and waited >= timeout:
        return _errors.Timeout(
            f"pool {pool!r} had no room for the call within {timeout:.3g} s "
            "(timeout); it was not sent"
        )
    if expire_after is not None and waited >= expire_after:
        return _errors.Expired(
            f"{w.op}: expire_after ({expire_after:.9g} s) passed while the call "
            f"waited for room in pool {pool!r}; it was not sent"
        )
    return None


def _sent(options: JobOptions, waited_ns: int) -> JobOptions:
    """The options a waiting call is sent with: no wait for room in the sender's thread, and
    what is left of its expire_after."""
    expire_ns = options.expire_ns
    if expire_ns >= 0 and waited_ns > 0:
        expire_ns = max(1, expire_ns - waited_ns)
    return _options.replace(options, timeout_ns=0, expire_ns=expire_ns, try_only=True)


def _in_flight(conn: Any) -> List[Any]:
    """Unfinished jobs of this connection, which give room back when they end (at most 64: the
    feeder's wait_any). Not the ended ones whose futures nobody has read: a wait on those
    would return at once, every time."""
    jobs: List[Any] = []
    try:
        for f in conn.holders:
            job = f._job
            if job is not None and unfinished(job):
                jobs.append(job)
                if len(jobs) >= 64:
                    break
    except RuntimeError:  # the set changed meanwhile (another thread's submit): try later
        pass
    return jobs


def _backlog(client: Any, conn: Any, pool: str) -> Backlog:
    backlog = conn.backlogs.get(pool)
    if backlog is not None:
        return backlog
    # Weakly: the connection holds the backlog, which must not keep the client alive.
    client_ref = weakref.ref(client)

    def send(future: Future, w: Waiting) -> None:
        c = client_ref()
        if c is None:
            raise _errors.ClientClosed("the gpuq client of this call is gone")
        now = time.monotonic()
        error = _late(pool, w, now)
        if error is not None:
            raise error
        options = _sent(w.options, int((now - w.start) * 1e9))
        submit_python(c, w.op, w.args, w.kwargs, options, w.output_bytes, future=future)

    made = Backlog(
        send,
        lambda: False,
        lambda: _in_flight(conn),
        late=lambda w, now: _late(pool, w, now),
        name="gpuq-call-feeder",
    )
    return conn.backlogs.setdefault(pool, made)  # atomic: one backlog per pool, whoever wins


def submit_nowait(
    client: Any,
    op: str,
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    options: JobOptions,
    output_bytes: Optional[int],
) -> Future:
    """Client.asubmit_call: a named op's call that never waits in this thread (see above).
    ``options``: the call's, checked (their pool given, their timeout the bound of its wait
    here). A malformed call raises from this function either way."""
    start = time.monotonic()
    pool = options.pool
    conn = client._c()
    backlog = conn.backlogs.get(pool)
    if backlog is None or not len(backlog):
        # Nothing waits before it: try now. Only a lack of room sends it to the backlog.
        try:
            return submit_python(client, op, args, kwargs, _sent(options, 0), output_bytes)
        except (_errors.QueueFull, _errors.OutOfMemory):
            pass
    else:
        # Calls wait before it (in order): check what the submit would check, then join them.
        need = output_bytes_for(args, kwargs, output_bytes)
        conn.native.call_block_bytes(args, kwargs, need, 0, False)
    f = Future(None, None, None, conn.watcher)
    _backlog(client, conn, pool).add(f, Waiting(op, args, kwargs, options, output_bytes, start))
    return f
