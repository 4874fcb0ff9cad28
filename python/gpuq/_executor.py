"""gpuq.Executor: a concurrent.futures.Executor that runs picklable callables in a Python pool's
warm workers (docs/python.md, "gpuq.Executor"; how it differs from ProcessPoolExecutor:
"Differences from the stdlib and joblib")."""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import os
import pickle
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from . import _calls, _errors, _native, _options, _ops, _pools, _remote
from ._backlog import Backlog
from ._future import Future, unfinished
from ._pickles import FunctionPickles

_PLAIN = (type(None), bool, int, float, str)  # arguments that travel as themselves
_PICKLED_ARGS = _native.CALL_FLAG_PICKLED_ARGS
_CONTEXT = _native.CALL_FLAG_EXECUTOR_CONTEXT
_REUSED = _native.CALL_FLAG_FUNCTION_REUSED

# Set once the interpreter is shutting down (after _exit_executors): no new tasks from then on.
_interpreter_exiting = False
_executors: "weakref.WeakSet[Executor]" = weakref.WeakSet()


class Executor(concurrent.futures.Executor):
    """Runs ``fn(*args, **kwargs)`` in a gpuq Python pool's warm workers::

        with gpuq.Executor() as ex:                   # instead of ProcessPoolExecutor()
            futures = [ex.submit(score, batch) for batch in batches]
            results = list(ex.map(score, batches))

    ProcessPoolExecutor's arguments mean what they mean there, as far as they can for workers
    that are the daemon's, long-lived and shared:

    ``max_workers``: at most this many of this executor's tasks in the daemon at once (queued
    or running); the rest wait in this process (default: no limit but the pool's queue).
    ``mp_context``: accepted and unused (the daemon starts the workers). ``initializer``,
    ``initargs``: ``initializer(*initargs)`` runs in each worker before its first task of this
    executor; one that raises breaks the executor (``BrokenExecutor``, as the stdlib's).
    ``max_tasks_per_child``: not supported (a ValueError): the workers outlive executors.

    gpuq's own, by keyword: ``pool`` (default: the first Python pool that allows callables),
    ``client`` (default: a new one, closed by :meth:`shutdown`), ``max_pending`` (``submit``
    waits while this many tasks are unfinished; by default it never waits), ``output_bytes``
    (room for each result; default: the arguments' array bytes plus 64 KiB), ``time_limit``
    (seconds each call may run), ``priority`` (its tasks' level: "high", "normal" or "low";
    higher levels are taken first), ``wait_at_exit`` (default True: at interpreter exit, the
    tasks not yet finished are waited for, as the stdlib executors do; False abandons them).

    The callable and its arguments travel pickled (cloudpickle, so lambdas and functions of
    ``__main__`` work); numpy arrays among them and in the result go through shared memory.
    The pool must allow callables (``python.allow_callables``, off by default: it runs code
    sent by clients as the daemon's user; docs/python.md). ``submit`` never blocks on a full
    queue: a task that finds no room waits in this process (gpuq._backlog). An exception
    raised by ``fn`` is re-raised by ``result()`` as itself (when it pickles), with the
    worker's traceback as its ``__cause__``; a worker that dies fails its task with
    :class:`gpuq.WorkerDied` (a ``BrokenProcessPool``), and the pool goes on.
    """

    def __init__(
        self,
        max_workers: Optional[int] = None,
        mp_context: Any = None,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Tuple[Any, ...] = (),
        *,
        max_tasks_per_child: Optional[int] = None,
        pool: Optional[str] = None,
        client: Any = None,
        max_pending: Optional[int] = None,
        output_bytes: Optional[int] = None,
        time_limit: Optional[float] = None,
        priority: Optional[str] = None,
        wait_at_exit: bool = True,
    ) -> None:
        if max_workers is not None and type(max_workers) is not int:
            raise TypeError(f"max_workers must be an int or None, not {max_workers!r}")
        if max_workers is not None and max_workers <= 0:
            raise ValueError("max_workers must be greater than 0")
        if max_tasks_per_child is not None:
            raise ValueError(
                "max_tasks_per_child: gpuq's workers are the daemon's and outlive "
                "this executor; they are not restarted after N tasks (give the "
                "pool's code what it must free, or restart the pool's workers)"
            )
        if initializer is not None and not callable(initializer):
            raise TypeError("initializer must be a callable")
        # Every task's options: sent without waiting for room (a task that finds none waits in
        # this process, in the backlog), with the executor's time limit; the pool comes below.
        options = _options.job_options(
            timeout=0.0, time_limit=time_limit, try_only=True, priority=priority
        )
        try:
            import cloudpickle
        except ImportError:  # pragma: no cover - a dependency of the package
            raise ImportError("gpuq.Executor needs cloudpickle (pip install cloudpickle)") from None
        self._pickle = cloudpickle
        # What each task takes along (call_codec.hpp, kFlagExecutorContext): a token of this
        # executor (its initializer runs once per worker for it), this process's
        # multiprocessing authkey, so that Manager proxies passed to tasks connect, and the
        # initializer with its arguments, pickled apart: the worker unpickles them once the
        # authkey is set (a proxy among initargs connects as it is unpickled).
        self._context = cloudpickle.dumps(
            (
                os.urandom(16),
                bytes(multiprocessing.current_process().authkey),
                cloudpickle.dumps((initializer, tuple(initargs)), protocol=5),
            ),
            protocol=5,
        )
        from ._client import Client

        self._own_client = client is None
        self._client = Client() if client is None else client
        if pool is None:
            pools = _pools.python_pools(self._client)
            allowed = [p["name"] for p in pools if p["allow_callables"]]
            if not allowed:
                if self._own_client:
                    self._client.close()
                raise _errors.PermissionDenied(
                    "no pool of this daemon runs callables: give a Python pool "
                    '"python": {"allow_callables": true} (docs/python.md) or pass pool='
                )
            pool = allowed[0]
        self.pool = pool
        self._options = _options.replace(options, pool=pool)
        # Inside a worker of the same pool (gpuq inside gpuq): tasks run here, at submit. A
        # task that waited on tasks of its own pool would wait for ever once every worker runs
        # such a parent; run in place, they cannot (joblib's backend does the same).
        self._inline = _ops.in_worker() and pool == _own_pool(self._client)
        self._max_workers = max_workers
        self._initializer = initializer
        self._output_bytes = output_bytes
        self._wait_at_exit = wait_at_exit
        self._pid = os.getpid()  # a forked child does not wait for its parent's tasks at exit
        self._slots = threading.BoundedSemaphore(max_pending) if max_pending else None
        self._lock = threading.Lock()
        self._pending: List[Tuple[Any, "weakref.ref[Future]"]] = []
        self._prune_at = 64
        self._shutdown = False
        self._broken: Optional[str] = None
        self._pickles = FunctionPickles(cloudpickle.dumps)
        self._backlog = Backlog(self._send, self._at_cap, self._in_flight)
        # Made once, not per task: what each task's future keeps.
        self._on_error = self._task_error
        self._origin = (self._client, pool)
        _executors.add(self)

    @property
    def client(self) -> Any:
        """The :class:`gpuq.Client` the tasks go through."""
        return self._client

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Runs ``fn(*args, **kwargs)`` in a worker of the pool; its :class:`gpuq.Future`.
        Never waits for room in the daemon (the task waits in this process instead), except
        with ``max_pending``. A task that cannot be pickled fails its future (as in
        ProcessPoolExecutor). RuntimeError after :meth:`shutdown`; ``BrokenExecutor`` once a
        worker's initializer raised."""
        if self._broken is not None:
            raise concurrent.futures.BrokenExecutor(self._broken)
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if _interpreter_exiting:
            raise RuntimeError("cannot schedule new futures after interpreter shutdown")
        if not callable(fn):
            raise TypeError(f"{type(fn).__name__} object is not callable")
        if self._inline:
            return self._run_here(fn, args, kwargs)
        try:
            task = self._task(fn, args, kwargs)
        except Exception as e:  # noqa: BLE001 - a pickling error is the task's outcome
            f = self._new_future()
            f._fail(e)
            return f
        if self._slots is not None:
            self._slots.acquire()
        if not len(self._backlog) and not self._at_cap():
            try:
                return self._send(None, task)
            except (_errors.QueueFull, _errors.OutOfMemory):
                pass  # no room now: the task waits in the backlog
            except BaseException:
                if self._slots is not None:
                    self._slots.release()
                raise
        f = self._new_future()
        self._backlog.add(f, task)
        if self._slots is not None:
            f.add_done_callback(self._release)
        return f

    def map(
        self,
        fn: Callable[..., Any],
        *iterables: Any,
        timeout: Optional[float] = None,
        chunksize: int = 1,
    ) -> Any:
        """``concurrent.futures.Executor.map``; ``chunksize`` > 1 sends that many calls to a
        worker as one task (as ProcessPoolExecutor does), fewer round trips for small calls."""
        if chunksize < 1:
            raise ValueError("chunksize must be >= 1.")
        if chunksize == 1:
            return super().map(fn, *iterables, timeout=timeout)
        from concurrent.futures import process

        results = super().map(
            functools.partial(process._process_chunk, fn),
            process._get_chunks(*iterables, chunksize=chunksize),
            timeout=timeout,
        )
        return process._chain_from_iterable_of_lists(results)

    def _run_here(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Any) -> Future:
        f = self._new_future()
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the task's outcome, as in a worker
            f._fail(e)
        else:
            f._end("FINISHED", result, None, None)
        return f

    def _new_future(self) -> Future:
        return Future(None, None, None, self._client._c().watcher)

    def _task(
        self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Any
    ) -> Tuple[Tuple[Any, ...], Any, int, int]:
        """(the call's positionals, its keywords, its flags, its output room): the function's
        pickle, made once while it stays the same (_pickles), the executor's context, and the
        arguments, plain ones (numbers, strings, None, numpy arrays) as themselves, anything
        else pickled."""
        blob, stable = self._pickles.get_stable(fn)
        if all(
            type(a) in _PLAIN or (type(a) is np.ndarray and not a.dtype.hasobject)
            for a in (args + tuple(kwargs.values()) if kwargs else args)
        ):
            # The context goes along when the task may need it: an initializer to run, or a
            # pickle that may hold a multiprocessing proxy (the function's, when it is pickled
            # anew; plain arguments hold none).
            if stable and self._initializer is None:
                call = (blob,) + args
                flags = _REUSED
            else:
                call = (blob, self._context) + args
                flags = _CONTEXT | (_REUSED if stable else 0)
            data = sum(a.nbytes for a in args if type(a) is np.ndarray) + (
                sum(a.nbytes for a in kwargs.values() if type(a) is np.ndarray) if kwargs else 0
            )
        else:
            buffers: List[pickle.PickleBuffer] = []
            args_blob = self._pickle.dumps(
                (args, kwargs), protocol=5, buffer_callback=buffers.append
            )
            call = (blob, self._context, args_blob, *buffers)
            kwargs = None
            flags = _CONTEXT | _PICKLED_ARGS | (_REUSED if stable else 0)
            data = len(args_blob) + sum(memoryview(b).nbytes for b in buffers)
        return call, kwargs or None, flags, self._output_bytes or data + _calls.OUTPUT_SLACK

    def _send(self, future: Optional[Future], task: Tuple[Any, ...]) -> Future:
        """Hands one task to the daemon now (QueueFull or OutOfMemory when there is no room);
        ``future``: the backlog's, which gets the job."""
        call, kwargs, flags, output_bytes = task
        f = _calls.submit_python(
            self._client,
            _native.CALL_OP,
            call,
            kwargs,
            self._options,
            output_bytes,
            True,
            flags,
            future=future,
            on_error=self._on_error,
            origin=self._origin,
        )
        with self._lock:
            # For shutdown(): the job (a small handle) and the future, weakly (a future holds
            # its result, and that its block of the segment). Ended jobs are let go now and
            # then, not by a callback per task, which would wake the watcher thread for each.
            self._pending.append((f._job, weakref.ref(f)))
            if len(self._pending) >= self._prune_at:
                self._prune_locked()
        if self._slots is not None and future is None:
            f.add_done_callback(self._release)
        return f

    def _prune_locked(self) -> None:
        self._pending = [e for e in self._pending if e[0] is not None and unfinished(e[0])]
        self._prune_at = max(64, 2 * len(self._pending))

    def _at_cap(self) -> bool:
        if self._max_workers is None or len(self._pending) < self._max_workers:
            return False
        with self._lock:
            self._prune_locked()
            return len(self._pending) >= self._max_workers

    def _in_flight(self) -> List[Any]:
        with self._lock:
            return [job for job, _ in self._pending if job is not None and unfinished(job)]

    def _task_error(self, info: Any, exc: BaseException, out: Any = None) -> BaseException:
        e = _remote.callable_error(info, exc, out)
        if isinstance(e, concurrent.futures.BrokenExecutor) and self._broken is None:
            self._broken = str(e)
            cause = e.__cause__
            concurrent.futures._base.LOGGER.critical(
                "Exception in initializer:\n%s", getattr(cause, "tb", "") or str(e)
            )
        return e

    def _release(self, f: Any) -> None:
        assert self._slots is not None
        self._slots.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks from now on. ``cancel_futures``: cancel the tasks no worker has
        started (those waiting in this process, and those queued in the daemon); running ones
        run on. ``wait``: return once every task has ended, then close the client the
        executor made."""
        self._shutdown = True
        if cancel_futures:
            self._backlog.cancel_all()
            with self._lock:
                pending = list(self._pending)
            for job, ref in pending:
                f = ref()
                if f is not None:
                    f.cancel()
                elif job is not None:  # dropped by its caller: the job alone
                    try:
                        job.cancel_queued()
                    except _errors.Error:
                        pass
        if not wait:
            return
        self._backlog.wait_empty()
        with self._lock:
            pending = self._pending
            self._pending = []
        for job, ref in pending:
            f = ref()
            if f is not None:
                concurrent.futures.wait([f])
            elif job is not None:
                try:
                    job.wait(-1)
                except _errors.Error:
                    pass
        if self._own_client:
            self._client.close()


def _own_pool(client: Any) -> Optional[str]:
    """The name of the pool whose worker this process is."""
    me = _ops.context().pool_id
    return next((p["name"] for p in client.status().get("pools", []) if p.get("id") == me), None)


def _exit_executors() -> None:
    """At interpreter exit, before threads are joined (as concurrent.futures' own executors
    do): waits for every executor's unfinished tasks, unless it said wait_at_exit=False."""
    global _interpreter_exiting
    _interpreter_exiting = True
    for ex in list(_executors):
        if ex._wait_at_exit and ex._pid == os.getpid():
            try:
                ex.shutdown(wait=True)
            except Exception:  # noqa: BLE001 - a daemon gone: nothing left to wait for
                pass


if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_exit_executors)
else:  # pragma: no cover - Python < 3.9
    import atexit

    atexit.register(_exit_executors)
