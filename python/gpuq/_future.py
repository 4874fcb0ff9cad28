"""gpuq.Future: a submitted job as a ``concurrent.futures.Future``.

How a job's end reaches its future, without a thread per job:

* ``result()`` / ``exception()`` on a future nobody else watches wait on the job itself, in the
  calling thread, with the GIL released (spin, then a futex sleep): the fast path.
* Anything that needs to be told of the end from elsewhere (``add_done_callback``, asyncio's
  ``await``, ``concurrent.futures.wait`` and ``as_completed``, which add a waiter to the future)
  hands the future to its client's one watcher thread, which sleeps on its connection's event
  (every job's end wakes it; no polling) and finishes each future as its job ends.

Either way the future is finished once, under its condition, with exactly one outcome.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import os
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Tuple

from . import _errors, _native

# gpuq::JobStatus values (the native layer's ints), from the C++ enum (_native.JOB_STATUS).
QUEUED = _native.JOB_STATUS["queued"]
RUNNING = _native.JOB_STATUS["running"]
DONE = _native.JOB_STATUS["done"]
FAILED = _native.JOB_STATUS["failed"]
CANCELLED = _native.JOB_STATUS["cancelled"]
EXPIRED = _native.JOB_STATUS["expired"]
_STATUS_NAMES = {value: name for name, value in _native.JOB_STATUS.items()}


def unfinished(job: Any) -> bool:
    """Whether a native job has not ended (False once its connection is gone: a parent's job
    after a fork, a daemon gone, where there is nothing to wait for)."""
    try:
        return job.poll() < DONE
    except _errors.Error:
        return False


# concurrent.futures' state names (module constants of concurrent.futures._base).
_PENDING = "PENDING"
_FINISHED = "FINISHED"
_CANCELLED = "CANCELLED"
_CANCELLED_AND_NOTIFIED = "CANCELLED_AND_NOTIFIED"


class JobInfo:
    """What the daemon reported for a finished job: ``status`` ("done", "failed",
    "cancelled", "expired"), ``code`` and ``message`` of a failure, ``output_size`` (bytes
    written), ``value`` (the op's scalar result), ``worker_id``, ``queued_ns`` and ``run_ns``."""

    __slots__ = (
        "status",
        "code",
        "message",
        "output_size",
        "value",
        "worker_id",
        "queued_ns",
        "run_ns",
    )

    def __init__(self, t: Tuple[int, int, str, int, int, int, int, int]) -> None:
        (
            status,
            self.code,
            self.message,
            self.output_size,
            self.value,
            self.worker_id,
            self.queued_ns,
            self.run_ns,
        ) = t
        self.status = _STATUS_NAMES[status]

    def __repr__(self) -> str:
        return (
            f"JobInfo(status={self.status!r}, code={self.code}, message={self.message!r}, "
            f"output_size={self.output_size}, value={self.value}, worker_id={self.worker_id}, "
            f"queued_ns={self.queued_ns}, run_ns={self.run_ns})"
        )


class _Waiters(list):
    """The future's ``_waiters`` list: concurrent.futures.wait() and as_completed() append
    their waiter to it (holding the future's condition, which its end also takes), and that
    must start the watching. Holds its future weakly, so that a future is freed (and its job
    slot with it) by reference counting alone."""

    __slots__ = ("_future",)

    def __init__(self, future: "Future") -> None:
        super().__init__()
        self._future = weakref.ref(future)

    def append(self, waiter: Any) -> None:
        super().append(waiter)
        f = self._future()
        if f is not None and f._state == _PENDING:
            f._watch()


# A Python op's answer of at most this many bytes is read from a copy (Future._out).
COPY_ANSWER_BYTES = 64 << 10


class Continue(Exception):
    """Raised by a future's converter when its job's answer is not the end: ``submit_next``
    (called with the future) submits the next job and gives it to the future with
    ``Future._attach`` (a spilled result's pieces, gpuq._spill)."""

    def __init__(self, submit_next: Callable[["Future"], None]) -> None:
        super().__init__()
        self.submit_next = submit_next


class _Continuing:
    """A future's ``_queue`` while it is between two jobs of its continuation."""

    @staticmethod
    def cancel(future: Any) -> bool:
        return False


_CONTINUING = _Continuing()


# Guards each future's one PENDING -> finished transition and its lists of waiters and
# callbacks. One lock for all: held for a few attribute writes, never while waiting or calling
# out, and cheaper than a Condition per future (which is made only when a thread waits on one).
_finish_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # Another thread of the parent may have held these at the fork; its threads are gone.
    global _finish_lock
    _finish_lock = threading.Lock()
    for w in list(_watchers):
        w._lock = threading.Lock()
        w._wake = threading.Condition(w._lock)
        w._thread = None
        w._sleeping_on = None
        # The parent's jobs: not this process's to watch (a wait on one raises ForkedClient).
        w._futures = []
        w._orphans = []
        w._adopted.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Future(concurrent.futures.Future):
    """A job submitted to gpuq. Works with ``concurrent.futures.wait``, ``as_completed``,
    ``add_done_callback`` and ``result(timeout)``, and is awaitable in asyncio.

    ``result()`` returns what the call that made it documents (the output array of a tensor
    helper, ``out`` or the op's scalar ``value`` for ``submit``); a failed job raises the
    :class:`gpuq.Error` subclass of its code with the daemon's message. ``info`` holds the
    job's :class:`JobInfo` once it has ended.

    The future keeps the job's input and output arrays alive until the job has ended, so
    their memory stays valid while a worker uses it.
    """

    # Instance state that most futures never change lives on the class (a no-op job's round
    # trip is a few microseconds; every attribute set in __init__ costs a little of it).
    _watched = False
    _cond: Optional[threading.Condition] = None
    _state = _PENDING
    _result: Any = None
    _exception: Optional[BaseException] = None
    _w: Optional["_Waiters"] = None
    _done_callbacks: Optional[List[Callable[[concurrent.futures.Future], Any]]] = None
    _t: Optional[Tuple[int, int, str, int, int, int, int, int]] = None
    # A Python op's job: (info, exc) -> the exception to raise (its remote type and traceback).
    # What turns a failure into the exception raised: (info, exc) or (info, exc, out=answer).
    _on_error: Optional[Callable[..., BaseException]] = None
    # A Python op's job: the room of its answer in the segment (a view of its block). An answer
    # of at most COPY_ANSWER_BYTES is read from a copy, so that its result holds no part of the
    # segment and the block goes back when the job ends; a larger one is read in place (its
    # result's arrays are views of the block, which stays until they are gone).
    _out: Any = None
    # A callable's (gpuq.Executor): (client, pool) where a spilled result's pieces are fetched.
    _origin: Any = None
    # A future made before its job (an Executor's task waiting in the client, gpuq._backlog):
    # the backlog that holds it, until _attach() gives it its job.
    _queue: Any = None

    # Built in Client; never by users.
    def __init__(
        self, job: Any, keep: Any, convert: Optional[Callable[..., Any]], watcher: "Watcher"
    ) -> None:
        # Not concurrent.futures.Future.__init__: its Condition alone would cost a microsecond.
        # What it sets is on the class above, or made on first use (_condition, _waiters).
        self._job = job
        self._keep = keep
        self._convert = convert  # None: the result is the op's value
        self._watcher = watcher

    def __del__(self) -> None:
        # Dropped before its job ended: the job runs on (as an executor's would), and the
        # arrays it reads and writes stay alive until it has ended; the watcher keeps both.
        if self._state != _PENDING:
            return
        job = self.__dict__.get("_job")
        if job is not None:
            try:
                self._watcher.adopt(job, self._keep)
            except Exception:  # noqa: BLE001 - at interpreter exit
                pass

    @property
    def info(self) -> Optional[JobInfo]:
        """The finished job's :class:`JobInfo` (None while it runs, or when the client failed
        to reach it, e.g. Disconnected)."""
        return None if self._t is None else JobInfo(self._t)

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        c = self._cond
        if c is None:
            with _finish_lock:
                if self._cond is None:
                    self._cond = threading.Condition()
                c = self._cond
        return c

    @property
    def _waiters(self) -> _Waiters:  # type: ignore[override]
        w = self._w
        if w is None:
            with _finish_lock:
                if self._w is None:
                    self._w = _Waiters(self)
                w = self._w
        return w

    def __repr__(self) -> str:
        return f"<gpuq.Future state={self._state.lower()}>"

    # ---- finishing ---------------------------------------------------------------------------

    def _finish(
        self, t: Tuple[int, int, str, int, int, int, int, int], job: Any, copy_answer: bool = False
    ) -> None:
        """Records the outcome ``t`` of ``job`` once; later calls, and calls for a job that is
        no longer this future's (one that continued: Continue), do nothing. ``copy_answer``:
        read a Python op's answer from a copy whatever its size (settle_finished)."""
        status = t[0]
        result: Any = None
        exc: Optional[BaseException] = None
        # Read before the job is checked: a continuation drops the job before it changes these.
        out = self._out
        convert = self._convert
        if self._job is not job:
            return
        if out is not None and (copy_answer or t[3] <= COPY_ANSWER_BYTES):
            out = out[: t[3]].copy()  # the answer read from here: the block is let go
        if status == DONE:
            if convert is None:
                result = t[4]
            else:
                try:
                    # A Python op's: (the answer's size, its bytes).
                    result = convert(JobInfo(t)) if out is None else convert(t[3], out)
                except Continue as c:
                    # More to fetch (a spilled result's pieces): the future stays pending on
                    # the next job, which this call submits (once, whoever calls).
                    error = self._continue(job, c)
                    if error is None:
                        return
                    exc = error
                except BaseException as e:  # a conversion bug must still end the future
                    exc = e
        elif status == CANCELLED:
            exc = _errors.Cancelled(t[2] or "the job was cancelled")
        else:
            exc = _errors.error_for(t[1], t[2] or _STATUS_NAMES[status])
            on_error = self._on_error
            if on_error is not None:
                try:
                    exc = (
                        on_error(JobInfo(t), exc)
                        if out is None
                        else on_error(JobInfo(t), exc, out=out)
                    )
                except Exception:  # noqa: BLE001 - the plain error, then
                    pass
        self._end(_CANCELLED_AND_NOTIFIED if status == CANCELLED else _FINISHED, result, exc, t)

    def _continue(self, job: Any, c: "Continue") -> Optional[BaseException]:
        """Swaps ``job`` for the next one ``c`` submits; None once done (or done by another
        thread that finished the same job), else why the next job could not be submitted."""
        with _finish_lock:
            if self._state != _PENDING or self._job is not job:
                return None
            self._job = None  # first: a _finish() in another thread now sees a stale job
            self._queue = _CONTINUING  # waiters wait for the next job (_wait_queued)
        try:
            c.submit_next(self)  # calls self._attach(...)
        except BaseException as e:  # noqa: BLE001 - the future's failure
            return e
        return None

    def _fail(self, exc: BaseException) -> None:
        self._end(_FINISHED, None, exc, None)

    def _end(
        self,
        state: str,
        result: Any,
        exc: Optional[BaseException],
        t: Optional[Tuple[int, int, str, int, int, int, int, int]],
    ) -> None:
        # The end happens under the future's condition when it has one, as in
        # concurrent.futures: wait() and as_completed() look at the state and add their waiter
        # under it, so a waiter is told of an end exactly when it saw the future pending.
        cond = self._cond
        while True:
            if cond is not None:
                cond.acquire()
            try:
                with _finish_lock:
                    made = self._cond
                    if made is cond:
                        if self._state != _PENDING:
                            return
                        self._result = result
                        self._exception = exc
                        self._t = t
                        self._state = state
                        self._job = None  # frees the job's slot in the client
                        self._keep = None
                        self._queue = None
                        # What read the answer: the block goes back once no result holds it.
                        self._convert = None
                        self._on_error = None
                        self._out = None
                        waiters = list(self._w) if self._w else None
                        callbacks = self._done_callbacks
                        self._done_callbacks = None
                if made is cond:
                    if waiters:
                        for w in waiters:
                            self._tell(w)
                    if cond is not None:
                        cond.notify_all()
                    break
            finally:
                if cond is not None:
                    cond.release()
            cond = made  # made meanwhile (once at most): take it and try again
        if callbacks:
            for fn in callbacks:
                self._call(fn)

    def _tell(self, waiter: Any) -> None:
        if self._state == _FINISHED:
            if self._exception is None:
                waiter.add_result(self)
            else:
                waiter.add_exception(self)
        else:
            waiter.add_cancelled(self)

    def _call(self, fn: Callable[[concurrent.futures.Future], Any]) -> None:
        try:
            fn(self)
        except Exception:
            concurrent.futures._base.LOGGER.exception("exception calling callback for %r", self)

    def _watch(self) -> None:
        """Has the client's watcher finish this future (once it has a job: _attach)."""
        with _finish_lock:
            if self._watched or self._state != _PENDING:
                return
            self._watched = True
            if self._job is None and self._queue is not None:
                return
        self._watcher.add(self)

    def _attach(self, job: Any, keep: Any, convert: Any, on_error: Any, out: Any) -> bool:
        """Gives a future made before its job (``_queue`` set) that job; False when the future
        has ended meanwhile (then the job is the caller's to cancel)."""
        with _finish_lock:
            if self._state != _PENDING:
                return False
            self._keep = keep
            self._convert = convert
            self._on_error = on_error
            self._out = out
            self._job = job
            self._queue = None
            watched = self._watched
            cond = self._cond
        if watched:
            self._watcher.add(self)
        if cond is not None:
            with cond:  # a thread in _wait_queued() waits on its job from now on
                cond.notify_all()
        return True

    # ---- concurrent.futures.Future ----------------------------------------------------------

    def _unstarted_job(self) -> Any:
        """For cancel() and stop(): the job to act on, or None when there is none (the future
        has ended, or its task was taken out of an Executor's backlog now, ending it
        cancelled)."""
        if self._state != _PENDING:
            return None
        queue = self._queue
        if queue is not None and queue.cancel(self):
            return None
        return self._job

    def cancel(self) -> bool:
        """Cancels the job if no worker has started it, as ``concurrent.futures`` does: a
        job still queued (in the daemon, or in an Executor's backlog in this process) ends
        cancelled at once and this returns True; a running or finished job is left alone and
        this returns False. To stop a running job, use :meth:`stop`."""
        job = self._unstarted_job()
        if job is None:
            return self.cancelled()
        try:
            if not job.cancel_queued():
                return False
        except _errors.Error as e:
            self._fail(e)
            return False
        t = job.wait(0)
        if t is not None:
            self._finish(t, job)
        return self._state in (_CANCELLED, _CANCELLED_AND_NOTIFIED)

    def stop(self) -> bool:
        """Cancels the job, running or not (gpuq's own; :meth:`cancel` leaves a running job
        alone). A queued job ends cancelled at once and this returns True. A running job is
        asked to stop and this returns False; its result or :class:`gpuq.Cancelled` comes
        later: ops that look at their cancel flag (``gpuq.cancelled()``) end it cancelled, an
        op that finishes first ends it with its result, and the daemon stops (and replaces)
        the worker of an op that does neither within its ``cancel_grace_ms``, ending the job
        cancelled. A finished job: False."""
        job = self._unstarted_job()
        if job is None:
            return self.cancelled()
        try:
            job.cancel()
        except _errors.NotCancellable:
            return False
        except _errors.Error as e:
            self._fail(e)
            return False
        if job.poll() == CANCELLED:
            t = job.wait(0)
            if t is not None:
                self._finish(t, job)
        return self._state in (_CANCELLED, _CANCELLED_AND_NOTIFIED)

    def cancelled(self) -> bool:
        """True if the job ended cancelled."""
        return self._state in (_CANCELLED, _CANCELLED_AND_NOTIFIED)

    def running(self) -> bool:
        """True while a worker runs the job (lock-free look at its slot)."""
        job = self._job
        return self._state == _PENDING and job is not None and job.poll() == RUNNING

    def done(self) -> bool:
        """True once the job has ended (done, failed, cancelled or expired); never blocks."""
        job = self._job
        if self._state != _PENDING:
            return True
        if job is None:  # waiting in an Executor's backlog, or being finished elsewhere
            return self._queue is None
        try:
            status = job.poll()
        except _errors.Error as e:
            self._fail(e)
            return True
        if status >= DONE:
            self._wait(0)
            return self._state != _PENDING
        return False

    def _wait(self, timeout: Optional[float]) -> bool:
        """Waits for the end; True once the future is finished."""
        job = self._job
        if self._state != _PENDING:
            return True
        if job is None:
            if self._queue is not None:
                return self._wait_queued(timeout)
            return self._wait_finished(timeout)
        # In this thread, on the job itself, even when the watcher watches it too (a job may
        # be waited on by several threads at once; whichever sees its end first finishes the
        # future): the timeout holds, and a forked child waiting on its parent's job gets
        # ForkedClient rather than a watcher that is not there.
        start = time.monotonic() if timeout else 0.0
        try:
            t = job.wait(-1 if timeout is None else max(0, int(timeout * 1e9)))
        except _errors.Error as e:
            self._fail(e)
            return True
        if t is None:
            return self._state != _PENDING
        self._finish(t, job)
        if self._state == _PENDING:  # it went on with a next job (Continue): wait for that
            return self._wait(
                timeout if not timeout else max(0.0, timeout - (time.monotonic() - start))
            )
        return True

    def _wait_queued(self, timeout: Optional[float]) -> bool:
        # In an Executor's backlog: wait for its job (_attach), then on the job.
        deadline = None if timeout is None else time.monotonic() + timeout
        cond = self._condition
        with cond:
            while self._state == _PENDING and self._job is None and self._queue is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                cond.wait(left)
        if self._state != _PENDING:
            return True
        return self._wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _wait_finished(self, timeout: Optional[float]) -> bool:
        # The job was dropped by a finish in progress in another thread: wait for its end.
        with self._condition:
            return self._condition.wait_for(lambda: self._state != _PENDING, timeout)

    def result(self, timeout: Optional[float] = None) -> Any:
        """The job's result, waiting up to ``timeout`` seconds (None: no limit) with the GIL
        released. Raises ``concurrent.futures.TimeoutError`` when it is still pending then
        (the job goes on), the job's :class:`gpuq.Error` when it failed, and
        :class:`gpuq.Cancelled` when it was cancelled."""
        if self._state == _PENDING:
            job = self._job
            if job is not None and timeout is None:
                # The common case, inline: wait on the job in this thread.
                try:
                    t = job.wait(-1)
                except _errors.Error as e:
                    self._fail(e)
                else:
                    if t is not None:
                        if t[0] == DONE and self._convert is None:
                            # The end of a job with a scalar result, inline, when nothing
                            # else has come to watch this future (else: _finish).
                            with _finish_lock:
                                if (
                                    self._state == _PENDING
                                    and self._cond is None
                                    and self._w is None
                                    and self._done_callbacks is None
                                ):
                                    self._result = t[4]
                                    self._t = t
                                    self._state = _FINISHED
                                    self._job = None
                                    self._keep = None
                                    return t[4]
                        self._finish(t, job)
            if self._state == _PENDING and not self._wait(timeout):
                raise concurrent.futures.TimeoutError()
        if self._state == _FINISHED:
            if self._exception is not None:
                raise self._exception
            return self._result
        raise self._exception or _errors.Cancelled("the job was cancelled")

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """The job's exception (None if it succeeded), waiting as :meth:`result` does."""
        if self._state == _PENDING and not self._wait(timeout):
            raise concurrent.futures.TimeoutError()
        if self._state != _FINISHED:
            raise self._exception or _errors.Cancelled("the job was cancelled")
        return self._exception

    def add_done_callback(self, fn: Callable[[concurrent.futures.Future], Any]) -> None:
        """Calls ``fn(future)`` when the job ends (in the client's watcher thread), or now if
        it has ended."""
        with _finish_lock:
            pending = self._state == _PENDING
            if pending:
                if self._done_callbacks is None:
                    self._done_callbacks = []
                self._done_callbacks.append(fn)
        if pending:
            self._watch()
        else:
            self._call(fn)

    def set_running_or_notify_cancel(self) -> bool:
        """Not for gpuq futures (an executor's hook): raises RuntimeError."""
        raise RuntimeError("a gpuq.Future is run by the daemon, not by an executor")

    def set_result(self, result: Any) -> None:
        """Not for gpuq futures (an executor's hook): raises RuntimeError."""
        raise RuntimeError("a gpuq.Future's result comes from its job")

    def set_exception(self, exception: Optional[BaseException]) -> None:
        """Not for gpuq futures (an executor's hook): raises RuntimeError."""
        raise RuntimeError("a gpuq.Future's result comes from its job")

    def __await__(self):
        """``await future`` in a coroutine: no thread per job (the client's watcher). An
        awaiting task that is cancelled (``asyncio.wait_for`` timing out, a request handler
        cancelled) stops the job, running or not (:meth:`stop`): in asyncio, cancelling is
        how a coroutine says it no longer wants the work."""
        try:
            return (yield from asyncio.wrap_future(self).__await__())
        except asyncio.CancelledError:
            self.stop()
            raise


class Watcher:
    """One per connection: a daemon thread that finishes the futures handed to it, and keeps
    the jobs of futures dropped before their end (with the arrays they use) until they end.

    It sleeps in the native ``Job.wait_any`` on all the jobs it holds: on one futex of the
    connection that every job's end notifies (``ClientEvents``, docs/design/job_states.md), so
    it wakes when one of them ends, not to poll them. A watcher with pending jobs and nothing
    ending wakes once a second, to check that the daemon is there. A future or orphan handed to
    it meanwhile wakes it (``wake_waiters``) to watch that job too. At interpreter exit
    (atexit) the thread is stopped and joined before Python finalises, which would otherwise
    end it inside a native wait."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._futures: List[Future] = []
        self._orphans: List[Tuple[Any, Any]] = []  # (native job, arrays it uses)
        self._adopted: "collections.deque[Tuple[Any, Any]]" = collections.deque()  # new orphans
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        # A job the thread's native wait watches (any one: waking it wakes the wait), or None
        # while it is not in one.
        self._sleeping_on: Any = None
        self.wakeups = 0  # native waits that returned (for tests: no polling)
        _watchers.add(self)

    def add(self, f: Future) -> None:
        with self._lock:
            self._futures.append(f)
            self._start_locked()
            if self._sleeping_on is not None and f._job is not None:
                f._job.wake_waiters()

    def adopt(self, job: Any, keep: Any) -> None:
        """Keeps a dropped future's unfinished job and its arrays until the job ends. Called
        from ``Future.__del__``, so from wherever the garbage collector runs, including inside
        this class's own locked sections: it never blocks on a lock."""
        self._adopted.append((job, keep))  # atomic; the thread takes them over
        job.wake_waiters()  # lock-free; a thread in its native wait looks again
        if self._lock.acquire(blocking=False):
            try:
                self._start_locked()
            finally:
                self._lock.release()
        # Else a holder of the lock is add() (which starts the thread and wakes it) or the
        # thread itself, which looks at _adopted before it sleeps.

    def _start_locked(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._run, name="gpuq-watcher", daemon=True)
            self._thread.start()
        self._wake.notify()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            thread = self._thread
            self._wake.notify()
            if self._sleeping_on is not None:
                self._sleeping_on.wake_waiters()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            # Ended by an exception (a callback's BaseException...): the work left needs a
            # thread (a normal end cleared _thread under the lock, with nothing left).
            with self._lock:
                self._sleeping_on = None
                if self._thread is threading.current_thread():
                    self._thread = None
                    if self._futures or self._orphans or self._adopted:
                        self._start_locked()

    def _take_adopted_locked(self) -> None:
        while self._adopted:
            self._orphans.append(self._adopted.popleft())

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._sleeping_on = None
                self._take_adopted_locked()
                while not self._futures and not self._orphans and not self._stopping:
                    self._wake.wait(timeout=5.0)
                    self._take_adopted_locked()
                    if not self._futures and not self._orphans:
                        self._thread = None  # idle: a later add() or adopt() starts a new one
                        return
                if self._stopping:
                    self._thread = None
                    return
                # Each future's job read once: another thread may finish the future (or move it
                # on to its next job) meanwhile; its end is then that thread's to record.
                watched = [(f, f._job) for f in self._futures if f._state == _PENDING]
                watched = [(f, j) for f, j in watched if j is not None]
                futures = [f for f, _ in watched]
                jobs = [j for _, j in watched] + [o[0] for o in self._orphans]
                del watched
                orphans = list(self._orphans)
                # Set under the lock with the snapshot: an add() or adopt() after it wakes
                # the wait below (which then returns at once if that came before the sleep).
                self._sleeping_on = jobs[0] if jobs else None
            ended: List[Future] = []
            gone: List[Tuple[Any, Any]] = []
            try:
                positions = _native.Job.wait_any(jobs, -1, False) if jobs else []
            except _errors.Error as e:  # Disconnected, ForkedClient: every job has it
                for f in futures:
                    f._fail(e)
                ended, gone = futures, orphans
                positions = []
            self.wakeups += 1
            n = len(futures)
            for i in positions:
                if i >= n:
                    gone.append(orphans[i - n])
                    continue
                f = futures[i]
                try:
                    t = jobs[i].wait(0)  # f._job may be gone: finished in another thread
                    if t is not None:
                        f._finish(t, jobs[i])
                        if f._state != _PENDING:  # else it went on with a next job
                            ended.append(f)
                except _errors.Error as e:
                    f._fail(e)
                    ended.append(f)
            with self._lock:
                # Finished elsewhere (result() in the caller's thread) or by this pass.
                ids = set(map(id, ended))
                self._futures = [
                    f
                    for f in self._futures
                    if id(f) not in ids and f._state == _PENDING and f._job is not None
                ]
                if gone:
                    ids = set(map(id, gone))
                    self._orphans = [o for o in self._orphans if id(o) not in ids]
            del gone, ended, futures, orphans, jobs


_watchers: "weakref.WeakSet[Watcher]" = weakref.WeakSet()


@atexit.register
def _stop_watchers() -> None:
    for w in list(_watchers):
        w.stop()
