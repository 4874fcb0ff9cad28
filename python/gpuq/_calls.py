"""Submitting Python-op jobs (Client.call, gpuq.Executor): the caller's side of the wire format
(python/src/call_codec.hpp, in gpuq._native). Arrays already in the client's segment are passed
in place; everything else is copied, with the job's header, into one block of the segment. A
result larger than its answer's room (a callable's) is fetched in pieces (gpuq._spill)."""

from __future__ import annotations

import functools
import pickle
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import _answers, _errors, _native, _options, _remote, _room, _spill
from ._future import Continue, Future
from ._options import JobOptions

OUTPUT_SLACK = 64 << 10  # room for the answer's header and small results


def submit_python(
    client: Any,
    op: str,
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    options: JobOptions,
    output_bytes: Optional[int] = None,
    callable_job: bool = False,
    flags: int = 0,
    future: Optional[Future] = None,
    on_error: Any = None,
    origin: Optional[Tuple[Any, Optional[str]]] = None,
) -> Future:
    """Submits a Python op's job: the native codec lays ``args`` and ``kwargs`` out in one block
    of the segment (call_codec.hpp), with the room for the answer after them. ``options``: the
    job's (gpuq._options), their pool given. ``callable_job``: gpuq.Executor's (its arrays
    copied, which the worker may change in place). ``future``: a future made before its job (a
    backlog's), which gets it; ``on_error``: what turns a failure into the exception to raise
    (default: the op's remote error); ``origin``: a callable job's ``(client, pool)``, where a
    spilled result's pieces are fetched from (made once by its Executor, not per call)."""
    output_bytes = output_bytes_for(args, kwargs, output_bytes)
    conn = client._c()
    job, out, kept = _lay_out(conn, op, args, kwargs, output_bytes, flags, callable_job, options)
    # The future keeps the block (its header, copies and answer room: `out` owns it) and the
    # arrays passed in place until the job has ended, also when it is dropped before.
    keep = out if kept is None else (out, kept)
    convert = _callable_result if callable_job else _named_result
    if on_error is None:
        on_error = _remote.callable_error if callable_job else _remote.named_error
    if future is None:
        f = Future(job, keep, convert, conn.watcher)
        f._on_error = on_error
        f._out = out
    else:
        f = future
        if not f._attach(job, keep, convert, on_error, out):
            job.cancel_queued()  # it ended (cancelled) meanwhile: so does its job
    if callable_job:
        f._origin = origin if origin is not None else (client, options.pool)
    conn.holders.add(f)
    return f


def submit_stream(
    client: Any,
    op: str,
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    options: JobOptions,
    output_bytes: int,
) -> Tuple[Any, Any, Any]:
    """Submits a streaming Python op's job (``options.stream_window`` set): laid out as any
    call's, its answer room the part cells. (job, cells, arrays passed in place)."""
    return _lay_out(client._c(), op, args, kwargs, output_bytes, 0, False, options)


def output_bytes_for(
    args: Tuple[Any, ...], kwargs: Optional[Dict[str, Any]], output_bytes: Optional[int]
) -> int:
    """The answer's room: ``output_bytes`` checked, or by default the arguments' array bytes
    plus 64 KiB."""
    if output_bytes is None:
        return (
            OUTPUT_SLACK
            + sum(a.nbytes for a in args if isinstance(a, np.ndarray))
            + (sum(a.nbytes for a in kwargs.values() if isinstance(a, np.ndarray)) if kwargs else 0)
        )
    if type(output_bytes) is not int or output_bytes < 64:
        raise _errors.InvalidArgument(
            f"output_bytes: must be an int of at least 64, not {output_bytes!r}"
        )
    return output_bytes


def _lay_out(
    conn: Any,
    op: str,
    args: Tuple[Any, ...],
    kwargs: Optional[Dict[str, Any]],
    output_bytes: int,
    flags: int,
    callable_job: bool,
    options: JobOptions,
) -> Tuple[Any, Any, Any]:
    """The native submit of a Python call: (job, answer room, arrays passed in place). The
    first try lays the call out where the segment has room, the second in the block made."""
    try:
        return conn.native.submit_call(
            op, args, kwargs, output_bytes, flags, callable_job, options, None
        )
    except _errors.OutOfMemory:
        # No room: make some (finished calls give their blocks back, or wait for pending ones),
        # then lay the call out in the block made.
        need = conn.native.call_block_bytes(args, kwargs, output_bytes, flags, callable_job)
        block = _room.allocate(conn, need, _options.seconds(options.timeout_ns))
        return conn.native.submit_call(
            op, args, kwargs, output_bytes, flags, callable_job, options, block
        )


def _fetch_next(fetch: _spill.Fetch, future: Future) -> None:
    """Submits the job of a spilled result's next piece (gpuq._spill) and gives it to
    ``future`` (Continue); its converter keeps the piece and goes on, or ends with the
    result."""
    client, pool = future._origin
    offset, length, last = fetch.next_piece()
    conn = client._c()
    job, out, kept = _lay_out(
        conn,
        _native.CALL_OP,
        (fetch.token, offset, length, last),
        None,
        length + OUTPUT_SLACK,
        _native.CALL_FLAG_FETCH_SPILLED,
        True,
        _options.job_options(pool),
    )
    convert = functools.partial(_fetched_piece, fetch)
    if future._attach(
        job, out if kept is None else (out, kept), convert, _remote.callable_error, out
    ):
        conn.holders.add(future)
    else:
        job.cancel_queued()


def _fetched_piece(fetch: _spill.Fetch, nbytes: int, out: np.ndarray) -> Any:
    if not fetch.take(_answers.read_answer(out, nbytes)["arrays"][0]):
        raise Continue(functools.partial(_fetch_next, fetch))
    return fetch.result()


def _named_result(nbytes: int, out: np.ndarray) -> Any:
    return _native.answer_value(out, nbytes)


def _callable_result(nbytes: int, out: np.ndarray) -> Any:
    h = _answers.read_answer(out, nbytes)
    if "spill" in h:  # larger than the answer's room: fetched in pieces (gpuq._spill)
        raise Continue(functools.partial(_fetch_next, _spill.Fetch(h)))
    arrays = h["arrays"]
    return pickle.loads(arrays[0], buffers=arrays[1:])
