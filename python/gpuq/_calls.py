"""Submitting Python-op jobs (Client.call, gpuq.Executor): the caller's side of the wire format
in _pyops. Arrays already in the client's segment are passed in place; everything else is
copied, with the job's header, into one block of the segment."""

from __future__ import annotations

import json
import pickle
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _args, _errors, _pyops, _room
from ._future import Future, JobInfo

_OUTPUT_SLACK = 64 << 10  # room for the answer's header and small results


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker: the ``__cause__`` of the exception a
    failed Python op raises in the caller (as in ``concurrent.futures.ProcessPoolExecutor``)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def _c_array(a: Any) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.hasobject:
        raise _errors.InvalidArgument(
            f"an argument is an array of dtype {a.dtype} (Python objects); Python ops take "
            "arrays of plain numbers")
    return a


def build_header(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], List[np.ndarray]]:
    """The header (arrays' offsets as their index, resolved later) and the arrays."""
    arrays: List[np.ndarray] = []

    def enc(v: Any, what: str) -> Dict[str, Any]:
        if _pyops.is_array(v):
            arrays.append(_c_array(v))
            return {"nd": len(arrays) - 1}
        try:
            return {"js": _pyops._json_value(v, what)}
        except TypeError as e:
            raise _errors.InvalidArgument(str(e)) from None

    header = {"args": [enc(a, f"argument {i}") for i, a in enumerate(args)],
              "kwargs": {k: enc(v, f"keyword {k}") for k, v in kwargs.items()}}
    return header, arrays


def _header_bytes(header: Dict[str, Any]) -> bytes:
    hb = json.dumps(header).encode()
    if len(hb) > _pyops.MAX_HEADER_BYTES:
        raise _errors.InvalidArgument(
            f"the call's JSON arguments take {len(hb)} bytes, more than "
            f"{_pyops.MAX_HEADER_BYTES}: pass large data as numpy arrays")
    return hb


def _place(client: Any, conn: Any, header: Dict[str, Any], arrays: List[np.ndarray],
           keep: list, copy_all: bool, output_bytes: int,
           timeout: Optional[float]) -> Tuple[int, int, int, int, np.ndarray, int]:
    """Lays the header, the arrays and the room for the answer out in the segment, in one
    block: (span offset, span length, header offset within the span, header length, the
    answer's room as a uint8 array, its offset). ``copy_all``: copy even arrays already in the
    segment (a callable's arguments, which its worker may change in place)."""
    if not arrays:
        # No arrays: the header is final as it is (a no-op call's whole cost is this path).
        hb = _header_bytes(header)
        room = _pyops.align(len(hb))
        block = _room.allocate(conn, room + output_bytes, timeout)
        keep.append(block)
        memoryview(block)[:len(hb)] = hb
        block_off = block.ctypes.data - conn.base
        return block_off, room, 0, len(hb), block[room:], block_off + room
    in_place: Dict[int, int] = {}
    copies: List[int] = []
    for i, a in enumerate(arrays):
        off = client._offset(conn, a) if a.flags.c_contiguous and not copy_all else None
        if off is None:
            copies.append(i)
        else:
            in_place[i] = off
            keep.append(a)
    # The header's size depends on the offsets: leave room for the largest.
    sized = json.dumps(header).encode()
    hdr_room = _pyops.align(len(sized) + 64 + sum(_pyops.spec_bound(a) for a in arrays))
    block_bytes = hdr_room + sum(_pyops.align(arrays[i].nbytes) for i in copies)
    # The native allocation itself (a uint8 array): client.empty's checks cost more than it.
    block = _room.allocate(conn, block_bytes + output_bytes, timeout)
    out = block[block_bytes:]
    keep.append(block)
    block_off = block.__array_interface__["data"][0] - conn.base
    where: Dict[int, int] = dict(in_place)
    at = hdr_room
    for i in copies:
        a = arrays[i]
        if a.nbytes:
            np.copyto(block[at:at + a.nbytes].view(a.dtype).reshape(a.shape), a, casting="no")
        where[i] = block_off + at
        at += _pyops.align(a.nbytes)
    ends = [block_off + block_bytes] + [where[i] + arrays[i].nbytes for i in range(len(arrays))]
    start = min([block_off] + list(where.values()))
    end = max(ends)

    def resolve(e: Dict[str, Any]) -> Dict[str, Any]:
        if "nd" not in e:
            return e
        a = arrays[e["nd"]]
        return {"nd": [_pyops.dtype_spec(a.dtype), list(a.shape), where[e["nd"]] - start]}

    if "args" in header:
        header = {"args": [resolve(e) for e in header["args"]],
                  "kwargs": {k: resolve(e) for k, e in header["kwargs"].items()}}
    else:  # a callable's: the pickle and its buffers, by index
        header = {"pickle": [where[header["pickle"]] - start, arrays[header["pickle"]].nbytes],
                  "buffers": [[where[i] - start, arrays[i].nbytes] for i in header["buffers"]]}
    hb = _header_bytes(header)
    if len(hb) > hdr_room:  # spec_bound is wrong: a bug here, never the caller's
        raise _errors.Internal(f"a Python op's header ({len(hb)} bytes) outgrew its room "
                               f"({hdr_room})")
    block[:len(hb)] = np.frombuffer(hb, dtype=np.uint8)
    return start, end - start, block_off - start, len(hb), out, block_off + block_bytes


def submit_python(client: Any, op: str, header: Dict[str, Any], arrays: List[np.ndarray],
                  pool: Optional[str], output_bytes: Optional[int], timeout: Optional[float],
                  expire_after: Optional[float], retryable: bool, time_limit: Optional[float],
                  try_only: bool, callable_job: bool) -> Future:
    limit_ms = _args.time_limit_ms(time_limit)
    if output_bytes is None:
        output_bytes = sum(a.nbytes for a in arrays) + _OUTPUT_SLACK
    elif not isinstance(output_bytes, int) or output_bytes < 64:
        raise _errors.InvalidArgument(f"output_bytes: must be an int of at least 64, not "
                                      f"{output_bytes!r}")
    conn = client._c()
    keep: list = []
    in_off, in_len, h_off, h_len, out, out_off = _place(client, conn, header, arrays, keep,
                                                        callable_job, output_bytes, timeout)
    timeout_ns = -1 if timeout is None else _args.seconds_to_ns(timeout, "timeout")
    expire_ns = -1 if expire_after is None else _args.seconds_to_ns(expire_after, "expire_after")
    params = [("py.h", h_off), ("py.n", h_len)]
    if not callable_job:
        # For a batched op's worker, which counts rows while it gathers jobs (it checks the
        # real shapes): the first axis the arrays share, 0 when they share none.
        rows = arrays[0].shape[0] if arrays and arrays[0].ndim else 0
        if any(a.ndim == 0 or a.shape[0] != rows for a in arrays):
            rows = 0
        params.append(("py.r", rows))
    job = conn.native.submit(op, in_off, in_len, out_off, output_bytes, pool or "", params,
                             expire_ns, bool(retryable), limit_ms, timeout_ns, try_only)
    convert = (lambda info, out=out: _callable_result(out, info)) if callable_job else \
        (lambda info, out=out: _pyops.result_value(_pyops.read_answer(out, info.output_size)))
    f = Future(job, keep, convert, conn.watcher)
    f._on_error = lambda info, exc, out=out: _remote_error(out, info, exc, callable_job)
    f._out = out
    conn.holders.add(f)
    return f


def _callable_result(out: np.ndarray, info: JobInfo) -> Any:
    h = _pyops.read_answer(out, info.output_size)
    arrays = h["arrays"]
    return pickle.loads(arrays[0], buffers=arrays[1:])


def _remote_error(out: np.ndarray, info: JobInfo, exc: BaseException,
                  callable_job: bool) -> BaseException:
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
    if callable_job and h.get("kind") == "exception" and h["arrays"]:
        try:
            original = pickle.loads(h["arrays"][0].tobytes())
            if isinstance(original, BaseException):
                original.__cause__ = RemoteTraceback(tb)
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
    pools = [{"name": p["name"], "ops": p["python"].get("ops", []),
              "allow_callables": bool(p["python"].get("allow_callables"))} for p in listed]
    client._py_pools = (time.monotonic(), pools)
    return pools


def pool_for(client: Any, op: str, pool: Optional[str]) -> str:
    if pool:
        return pool
    for attempt in (False, True):
        for p in python_pools(client, refresh=attempt):
            if op in p["ops"]:
                return p["name"]
    raise _errors.UnknownOp(f"no Python pool of this daemon has op {op!r} (a @gpuq.op function "
                            "in one of its python.modules); gpuqctl status lists each pool's ops")
