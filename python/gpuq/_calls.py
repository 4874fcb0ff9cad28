"""Submitting Python-op jobs (Client.call, gpuq.Executor): the caller's side of the wire format
(python/src/call_codec.hpp, in gpuq._native). Arrays already in the client's segment are passed
in place; everything else is copied, with the job's header, into one block of the segment."""

from __future__ import annotations

import concurrent.futures
import functools
import pickle
import time
import weakref
from concurrent.futures.process import _RemoteTraceback as _StdlibRemoteTraceback
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _args, _errors, _native, _pyops, _room, _spill
from ._backlog import Backlog
from ._future import DONE, Continue, Future, JobInfo

_OUTPUT_SLACK = 64 << 10  # room for the answer's header and small results


class RemoteTraceback(_StdlibRemoteTraceback):
    """The traceback of an exception raised in a worker: the ``__cause__`` of the exception a
    failed Python op raises in the caller (as in ``concurrent.futures.ProcessPoolExecutor``,
    whose class this one derives from; a gpuq.Executor task's cause is that class itself)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def submit_python(
    client: Any,
    op: str,
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    pool: Optional[str],
    output_bytes: Optional[int],
    timeout: Optional[float],
    expire_after: Optional[float],
    retryable: bool,
    time_limit: Optional[float],
    try_only: bool,
    callable_job: bool,
    flags: int = 0,
    future: Optional[Future] = None,
    on_error: Any = None,
    origin: Optional[Tuple[Any, Optional[str]]] = None,
) -> Future:
    """Submits a Python op's job: the native codec lays ``args`` and ``kwargs`` out in one block
    of the segment (call_codec.hpp), with the room for the answer after them. ``callable_job``:
    gpuq.Executor's (its arrays copied, which the worker may change in place). ``future``: a
    future made before its job (an Executor's backlog), which gets it; ``on_error``: what
    turns a failure into the exception to raise (default: the op's remote error);
    ``origin``: a callable job's ``(client, pool)``, where a spilled result's pieces are
    fetched from (made once by its Executor, not per call)."""
    limit_ms = _args.time_limit_ms(time_limit)
    output_bytes = _output_bytes(args, kwargs, output_bytes)
    conn = client._c()
    timeout_ns = -1 if timeout is None else _args.seconds_to_ns(timeout, "timeout")
    expire_ns = -1 if expire_after is None else _args.seconds_to_ns(expire_after, "expire_after")
    job, out, kept = _lay_out(
        conn,
        op,
        pool,
        args,
        kwargs,
        output_bytes,
        flags,
        callable_job,
        expire_ns,
        retryable,
        limit_ms,
        timeout_ns,
        try_only,
        timeout,
    )
    # The future keeps the block (its header, copies and answer room: `out` owns it) and the
    # arrays passed in place until the job has ended, also when it is dropped before.
    keep = out if kept is None else (out, kept)
    convert = _callable_result if callable_job else _named_result
    if on_error is None:
        on_error = _callable_error if callable_job else _named_error
    if future is None:
        f = Future(job, keep, convert, conn.watcher)
        f._on_error = on_error
        f._out = out
    else:
        f = future
        if not f._attach(job, keep, convert, on_error, out):
            job.cancel_queued()  # it ended (cancelled) meanwhile: so does its job
    if callable_job:
        f._origin = origin if origin is not None else (client, pool)
    conn.holders.add(f)
    return f


def _output_bytes(
    args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]], output_bytes: Optional[int]
) -> int:
    """The answer's room: ``output_bytes`` checked, or by default the arguments' array bytes
    plus 64 KiB."""
    if output_bytes is None:
        return (
            _OUTPUT_SLACK
            + sum(a.nbytes for a in args if isinstance(a, np.ndarray))
            + (sum(a.nbytes for a in kwargs.values() if isinstance(a, np.ndarray)) if kwargs else 0)
        )
    if type(output_bytes) is not int or output_bytes < 64:
        raise _errors.InvalidArgument(
            f"output_bytes: must be an int of at least 64, not {output_bytes!r}"
        )
    return output_bytes


# ---- calls that never wait in the caller's thread (Client.asubmit_call, acall) ------------------
#
# The caller's thread (an event loop's) only ever tries the submit, without waiting
# (try_only, and no wait for room in the segment). When there is no room (the ring, this
# client's share of it, its job slots or its segment are full) the call waits in a Backlog of
# its connection and pool, in order, and that backlog's one feeder thread sends it when room
# appears: it sleeps on this connection's pending jobs (the end of one wakes it at once) for at
# most 2 ms between tries, since room also appears when a worker takes a queued job or another
# client's job leaves the ring, which nothing here is woken by. One thread per waiting pool,
# not one per waiting call; no polling while nothing waits. The future exists at once, with no
# job (``Future._queue``); cancelling it while it waits takes the call out: nothing is sent.


class Waiting:
    """A call waiting in the client for room (asubmit_call): submit_python's arguments, and
    when the call was made (its ``timeout`` and ``expire_after`` count from then)."""

    __slots__ = (
        "op",
        "args",
        "kwargs",
        "output_bytes",
        "timeout",
        "expire_after",
        "retryable",
        "time_limit",
        "start",
    )

    def __init__(
        self,
        op: str,
        args: Tuple[Any, ...],
        kwargs: Optional[Dict[str, Any]],
        output_bytes: Optional[int],
        timeout: Optional[float],
        expire_after: Optional[float],
        retryable: bool,
        time_limit: Optional[float],
        start: float,
    ) -> None:
        self.op = op
        self.args = args
        self.kwargs = kwargs
        self.output_bytes = output_bytes
        self.timeout = timeout
        self.expire_after = expire_after
        self.retryable = retryable
        self.time_limit = time_limit
        self.start = start


def _late(pool: str, w: Waiting, now: float) -> Optional[BaseException]:
    """Why ``w`` may not wait any longer, or None."""
    waited = now - w.start
    if w.timeout is not None and waited >= w.timeout:
        return _errors.Timeout(
            f"pool {pool!r} had no room for the call within {w.timeout:.3g} s "
            "(timeout); it was not sent"
        )
    if w.expire_after is not None and waited >= w.expire_after:
        return _errors.Expired(
            f"{w.op}: expire_after ({w.expire_after} s) passed while the call "
            f"waited for room in pool {pool!r}; it was not sent"
        )
    return None


def _in_flight(conn: Any) -> List[Any]:
    """Unfinished jobs of this connection, which give room back when they end (at most 64: the
    feeder's wait_any). Not the ended ones whose futures nobody has read: a wait on those
    would return at once, every time."""
    jobs: List[Any] = []
    try:
        for f in conn.holders:
            job = f._job
            if job is not None and _unfinished(job):
                jobs.append(job)
                if len(jobs) >= 64:
                    break
    except RuntimeError:  # the set changed meanwhile (another thread's submit): try later
        pass
    return jobs


def _unfinished(job: Any) -> bool:
    try:
        return job.poll() < DONE
    except _errors.Error:  # a connection gone: nothing to wait for
        return False


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
        expire = None if w.expire_after is None else max(1e-9, w.expire_after - (now - w.start))
        submit_python(
            c,
            w.op,
            w.args,
            w.kwargs,
            pool,
            w.output_bytes,
            0.0,
            expire,
            w.retryable,
            w.time_limit,
            True,
            False,
            future=future,
        )

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
    pool: str,
    output_bytes: Optional[int],
    timeout: Optional[float],
    expire_after: Optional[float],
    retryable: bool,
    time_limit: Optional[float],
) -> Future:
    """Client.asubmit_call: a named op's call that never waits in this thread (see above).
    Arguments are checked here, so a malformed call raises from the call either way."""
    start = time.monotonic()
    if timeout is not None:
        _args.seconds_to_ns(timeout, "timeout")
    conn = client._c()
    backlog = conn.backlogs.get(pool)
    if backlog is None or not len(backlog):
        # Nothing waits before it: try now. Only a lack of room sends it to the backlog.
        try:
            return submit_python(
                client,
                op,
                args,
                kwargs,
                pool,
                output_bytes,
                0.0,
                expire_after,
                retryable,
                time_limit,
                True,
                False,
            )
        except (_errors.QueueFull, _errors.OutOfMemory):
            pass
    else:
        # Calls wait before it (in order): check what the submit would check, then join them.
        _args.time_limit_ms(time_limit)
        if expire_after is not None:
            _args.seconds_to_ns(expire_after, "expire_after")
        conn.native.call_block_bytes(
            args, kwargs, _output_bytes(args, kwargs, output_bytes), 0, False
        )
    f = Future(None, None, None, conn.watcher)
    _backlog(client, conn, pool).add(
        f,
        Waiting(
            op, args, kwargs, output_bytes, timeout, expire_after, retryable, time_limit, start
        ),
    )
    return f


def _lay_out(
    conn: Any,
    op: str,
    pool: Optional[str],
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    output_bytes: int,
    flags: int,
    callable_job: bool,
    expire_ns: int,
    retryable: bool,
    limit_ms: int,
    timeout_ns: int,
    try_only: bool,
    timeout: Optional[float],
) -> Tuple[Any, Any, Any]:
    """The native submit of a Python call: (job, answer room, arrays passed in place)."""
    # Everything but the block: the first try lays the call out where the segment has room, the
    # second in the block made for it.
    call = (op, pool or "", args, kwargs, output_bytes, flags, callable_job, not callable_job,
            expire_ns, retryable, limit_ms, timeout_ns, try_only)  # fmt: skip
    try:
        return conn.native.submit_call(*call, None)
    except _errors.OutOfMemory:
        # No room: make some (finished calls give their blocks back, or wait for pending ones),
        # then lay the call out in the block made.
        need = conn.native.call_block_bytes(args, kwargs, output_bytes, flags, callable_job)
        block = _room.allocate(conn, need, timeout)
        return conn.native.submit_call(*call, block)


def _fetch_next(fetch: _spill.Fetch, future: Future) -> None:
    """Submits the job of a spilled result's next piece (gpuq._spill) and gives it to
    ``future`` (Continue); its converter keeps the piece and goes on, or ends with the
    result."""
    client, pool = future._origin
    offset, length, last = fetch.next_piece()
    conn = client._c()
    job, out, kept = _lay_out(
        conn,
        _pyops.CALL_OP,
        pool,
        (fetch.token, offset, length, last),
        None,
        length + _OUTPUT_SLACK,
        _native.CALL_FLAG_FETCH_SPILLED,
        True,
        -1,
        False,
        0,
        -1,
        False,
        None,
    )
    convert = functools.partial(_fetched_piece, fetch)
    if future._attach(job, out if kept is None else (out, kept), convert, _callable_error, out):
        conn.holders.add(future)
    else:
        job.cancel_queued()


def _fetched_piece(fetch: _spill.Fetch, nbytes: int, out: np.ndarray) -> Any:
    if not fetch.take(_pyops.read_answer(out, nbytes)["arrays"][0]):
        raise Continue(functools.partial(_fetch_next, fetch))
    return fetch.result()


def _named_result(nbytes: int, out: np.ndarray) -> Any:
    return _native.answer_value(out, nbytes)


def _callable_result(nbytes: int, out: np.ndarray) -> Any:
    h = _pyops.read_answer(out, nbytes)
    if "spill" in h:  # larger than the answer's room: fetched in pieces (gpuq._spill)
        raise Continue(functools.partial(_fetch_next, _spill.Fetch(h)))
    arrays = h["arrays"]
    return pickle.loads(arrays[0], buffers=arrays[1:])


def _named_error(info: JobInfo, exc: BaseException, out: np.ndarray) -> BaseException:
    return _remote_error(out, info, exc, False)


def _callable_error(info: JobInfo, exc: BaseException, out: np.ndarray) -> BaseException:
    return _remote_error(out, info, exc, True)


def _remote_error(
    out: np.ndarray, info: JobInfo, exc: BaseException, callable_job: bool
) -> BaseException:
    """The exception a failed Python op raises: with its remote type and traceback; for a
    callable, the worker's exception itself when it could be pickled (a named op's answer is
    never unpickled: its worker may serve clients this one does not trust)."""
    if info.output_size < 8:
        return exc
    try:
        h = _pyops.read_answer(out, info.output_size)
    except Exception:  # noqa: BLE001 - not a record: the plain error
        return exc
    rec = h.get("error") or {}
    tb = rec.get("traceback") or ""
    if callable_job and rec.get("initializer"):
        # As ProcessPoolExecutor says when a worker's initializer raised.
        broken = concurrent.futures.BrokenExecutor(
            f"a worker's initializer raised {rec.get('type')}: {rec.get('message')}; the "
            "executor is broken: make a new one"
        )
        broken.__cause__ = RemoteTraceback(tb)
        return broken
    if callable_job and h.get("kind") == "exception" and h["arrays"]:
        try:
            original = pickle.loads(h["arrays"][0].tobytes())
            if isinstance(original, BaseException):
                # ProcessPoolExecutor's own cause, as it makes it (code written for it may
                # look for that class).
                original.__cause__ = _StdlibRemoteTraceback(f'\n"""\n{tb}"""')
                return original
        except Exception:  # noqa: BLE001 - an exception class the caller cannot import
            pass
    if isinstance(exc, _errors.Error):
        exc.remote_type = rec.get("type")  # type: ignore[attr-defined]
        exc.remote_traceback = tb  # type: ignore[attr-defined]
        if "needed" in rec:
            exc.needed = rec["needed"]  # type: ignore[attr-defined]
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return exc


def python_pools(client: Any, refresh: bool = False) -> List[Dict[str, Any]]:
    """The daemon's Python pools (name, ops, allow_callables), from its status; cached."""
    cached = getattr(client, "_py_pools", None)
    if cached is not None and not refresh and time.monotonic() - cached[0] < 5.0:
        return cached[1]
    # Available ones first: an unavailable pool (no GPU, an import error) is only a last resort
    # (its jobs fail at once, naming why).
    listed = [p for p in client.status().get("pools", []) if "python" in p]
    listed.sort(key=lambda p: p.get("status") == "unavailable")
    pools = [
        {
            "name": p["name"],
            "ops": p["python"].get("ops", []),
            "allow_callables": bool(p["python"].get("allow_callables")),
        }
        for p in listed
    ]
    client._py_pools = (time.monotonic(), pools)
    return pools


def pool_for(client: Any, op: str, pool: Optional[str]) -> str:
    if pool:
        return pool
    for attempt in (False, True):
        for p in python_pools(client, refresh=attempt):
            if op in p["ops"]:
                return p["name"]
    raise no_pool(op)


def cached_pool(client: Any, op: str) -> Tuple[Optional[str], bool]:
    """(the first Python pool that has ``op`` in the cache of python_pools, or None; whether
    that cache is fresh), without asking the daemon."""
    cached = getattr(client, "_py_pools", None)
    if cached is None:
        return None, False
    fresh = time.monotonic() - cached[0] < 5.0
    for p in cached[1]:
        if op in p["ops"]:
            return p["name"], fresh
    return None, fresh


def no_pool(op: str) -> BaseException:
    return _errors.UnknownOp(
        f"no Python pool of this daemon has op {op!r} (a @gpuq.op function "
        "in one of its python.modules); gpuqctl status lists each pool's ops"
    )
