"""The caller's side of a streaming job (docs/python.md, "Streaming"; docs/design/streams.md):
:class:`Stream`, what :meth:`gpuq.Client.stream` returns. Its job's output buffer in this
client's segment is cut into ``window`` cells; the worker writes each part the op yields into
the next cell and publishes it, and :class:`Stream` hands each part out, decoded and copied out
of its cell, as soon as it is published. Reading a part gives its cell back to the worker."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Iterator, Optional

import numpy as np

from . import _errors, _native, _options, _remote
from ._future import JobInfo

DEFAULT_WINDOW = 4
DEFAULT_PART_BYTES = 64 << 10  # each cell: room for one part's answer
MAX_WINDOW = _native.MAX_STREAM_WINDOW
_END = object()  # the end of a stream, through an executor


def _copied(value: Any) -> Any:
    """``value`` with its arrays copied out of their cell (the cell is the worker's again
    once the next part is read)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    return value


class Stream:
    """The parts of one streaming job, in order, each as soon as its op has made it: iterate
    it (``for part in stream``, or ``async for``), or call :meth:`next`. Each part is what the
    op yielded (arrays come back as numpy arrays, copied out of the segment). The iteration
    ends when the op's generator returns; if the job fails, is cancelled or passes its time
    limit, the parts made before come first, then the job's error is raised (an op's
    exception as :class:`gpuq.OpFailed` with its remote traceback, as a call's).

    :meth:`cancel` stops the op: its generator sees ``GeneratorExit`` at its next ``yield``.
    Dropping the stream (or leaving its ``with`` block) before its end cancels it too. One
    reader at a time: a lock makes concurrent readers take turns."""

    def __init__(self, job: Any, out: np.ndarray, kept: Any, op: str, window: int) -> None:
        self._job = job
        self._out = out  # the cells; keeps the job's block of the segment
        self._base = out.ctypes.data  # where they start (a part's address is read against it)
        self._kept = kept  # arrays passed in place: alive until the job has ended
        self._op = op
        self._window = window
        self._cell = _native.stream_cell_bytes(len(out), window)
        self._lock = threading.Lock()
        self._read = 0  # parts handed out
        self._ended = False
        self._error: Optional[BaseException] = None
        self._info: Optional[JobInfo] = None  # the job's end, once the stream has ended

    # ---- reading ---------------------------------------------------------------------------

    def next(self, timeout: Optional[float] = None) -> Any:
        """The next part, waiting up to ``timeout`` seconds (None: as long as it takes) for
        it. Raises StopIteration at the end of the stream, :class:`gpuq.Timeout` when no part
        came in time (the stream goes on: call again), or the job's error."""
        timeout_ns = _options.seconds_to_ns(timeout, "timeout")
        with self._lock:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StopIteration
            try:
                got = self._job.next_part(timeout_ns)
            except _errors.Error as e:
                self._error = self._remote_error(e)
                self._finish()
                raise self._error from None
            if got is None:
                raise _errors.Timeout(f"no part of the {self._op} stream came within {timeout} s")
            index, address, size = got
            if index < 0:
                self._ended = True
                self._finish()
                raise StopIteration
            offset = address - self._base
            if not 0 <= offset <= len(self._out) - size or index != self._read:
                raise _errors.Internal(
                    f"part {index} of the {self._op} stream lies outside its cells"
                )
            self._read += 1
            return _copied(_native.answer_value(self._out[offset : offset + size], size))

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        return self.next()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        # The wait for a part happens off the event loop (the GIL released meanwhile).
        part = await asyncio.get_running_loop().run_in_executor(None, self._next_or_end)
        if part is _END:
            raise StopAsyncIteration
        return part

    def _next_or_end(self) -> Any:
        try:
            return self.next()
        except StopIteration:  # cannot cross into an asyncio future
            return _END

    # ---- its job -----------------------------------------------------------------------------

    @property
    def parts(self) -> int:
        """How many parts have been read."""
        return self._read

    def done(self) -> bool:
        """True once the job has ended (its parts may still be unread)."""
        return self._job is None or self._job.poll() >= 2

    def cancel(self) -> bool:
        """Stops the op (queued: at once; running: at its next part). False if the job had
        ended already."""
        job = self._job
        if job is None:
            return False
        try:
            job.cancel()
            return True
        except _errors.NotCancellable:
            return False

    def info(self, timeout: Optional[float] = None) -> JobInfo:
        """The job's end (status, code, message, ...; ``value``: the parts it made), waiting
        up to ``timeout`` for it; its parts need not have been read."""
        if self._info is not None:
            return self._info
        job = self._job
        if job is None:
            raise _errors.InvalidArgument("the stream was closed before its end")
        t = job.wait(_options.seconds_to_ns(timeout, "timeout"))
        if t is None:
            raise _errors.Timeout(f"the {self._op} stream has not ended")
        return JobInfo(t)

    def close(self) -> None:
        """Cancels the job if it has not ended, and lets go of its cells."""
        with self._lock:
            if self._job is not None and not self._ended and self._error is None:
                self.cancel()
            self._release()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "ended" if self._ended else "failed" if self._error else "open"
        return f"<gpuq.Stream {self._op!r} {state}, {self._read} parts read>"

    # ---- inside ------------------------------------------------------------------------------

    def _finish(self) -> None:
        """The stream has ended (its end or its error read): keeps the job's end, lets go."""
        job = self._job
        if job is not None:
            t = job.wait(0)
            if t is not None:
                self._info = JobInfo(t)
        self._release()

    def _release(self) -> None:
        # Dropping the native job cancels it if it still runs (gpuq::Job's destructor), and
        # frees its slot; the block goes with the last reference to `_out`.
        self._job = None
        self._kept = None

    def _remote_error(self, exc: BaseException) -> BaseException:
        """The job's error, with its op's remote traceback when the worker left a record (in
        the cell the next part would have taken)."""
        try:
            t = self._job.wait(0)
        except _errors.Error:
            return exc
        if t is None:
            return exc
        info = JobInfo(t)
        start = (self._read % self._window) * self._cell
        if info.output_size > self._cell:
            return exc
        return _remote.named_error(info, exc, self._out[start : start + self._cell])
