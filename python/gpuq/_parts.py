"""A streaming op's parts in its worker (docs/design/streams.md, docs/python.md "Streaming"): a
``@gpuq.op`` whose function is a generator (or an async generator) streams. Each value it
yields is written, as an answer is, into the job's next part cell of the caller's segment and
published at once; the caller reads it with :meth:`gpuq.Client.stream`. When every cell holds
an unread part the worker waits for its caller (backpressure on the generator); when the job is
asked to stop (cancelled, its time limit, its caller gone or not reading) the generator is
closed (``GeneratorExit`` at its ``yield``) and the job ends with that reason.

A generator op called without streaming (:meth:`gpuq.Client.call`) answers once: the list of
what it yielded."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, List, Optional, Tuple, cast

from . import _answers, _errors, _native
from ._answers import ResultTooLarge

Outcome = Tuple[int, str, int, int]  # (code, message, output bytes, value), as Runtime.run's

_loop: Optional[asyncio.AbstractEventLoop] = None


def _event_loop() -> asyncio.AbstractEventLoop:
    """The worker's own event loop for async generator ops: made once, run only while one of
    them makes its next value."""
    global _loop
    if _loop is None or _loop.is_closed():
        _loop = asyncio.new_event_loop()
    return _loop


def _values(gen: Any) -> Any:
    """The values of a generator or an async generator, as a plain iterator."""
    if not inspect.isasyncgen(gen):
        yield from gen
        return
    loop = _event_loop()
    try:
        while True:
            try:
                yield loop.run_until_complete(gen.__anext__())
            except StopAsyncIteration:
                return
    finally:
        loop.run_until_complete(gen.aclose())


def _next_cell() -> Tuple[Optional[memoryview], int, str]:
    """The stream's next part cell (the binding's part_cell: a memoryview, or None with why)."""
    cell, code, why = _native.part_cell()
    return cast(Optional[memoryview], cell), code, why


def collect(gen: Any) -> List[Any]:
    """Everything a generator op yields, for a job that did not ask to stream."""
    return list(_values(gen))


def stream(
    name: str, gen: Any, failed: Callable[[str, BaseException, memoryview], Outcome]
) -> Outcome:
    """Runs a generator op's job as a stream: each value a part, published as it is made.
    ``failed`` makes the failure record of an exception (Runtime._failed), written into the
    cell the next part would have taken. The job's outcome (its value: the parts made)."""
    values = _values(gen)
    parts = 0
    try:
        for value in values:
            cell, code, why = _next_cell()
            if cell is None:
                # Asked to stop (cancelled, its time limit, its caller gone or not reading):
                # the generator sees GeneratorExit at its yield.
                values.close()
                return (code, f"{name}: {why}", 0, parts)
            try:
                n = _answers.write_result(cell, value)
            except ResultTooLarge as e:
                e.part = parts
                n = _answers.write_error(cell, "gpuq.ResultTooLarge", str(e), "", needed=e.needed)
                values.close()
                return (_errors.InvalidArgument.code, f"{name}: {e}", n, parts)
            finally:
                cell.release()
            _native.part_publish(n)
            parts += 1
        return (0, "", 0, parts)
    except BaseException as e:  # noqa: BLE001 - the op's failure, reported after its parts
        values.close()
        return _failure(name, e, failed, parts)


def _failure(
    name: str,
    e: BaseException,
    failed: Callable[[str, BaseException, memoryview], Outcome],
    parts: int,
) -> Outcome:
    """The outcome of a stream whose generator raised ``e``: its record in the cell the next
    part would have taken (none when no cell is free: the job was asked to stop)."""
    cell, _, _ = _next_cell()
    if cell is None:
        code, msg, _, _ = failed(name, e, memoryview(bytearray(0)))
        return (code, msg, 0, parts)
    try:
        code, msg, n, _ = failed(name, e, cell)
    finally:
        cell.release()
    return (code, msg, n, parts)
