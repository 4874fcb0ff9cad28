"""gpuq.Executor: a concurrent.futures.Executor that runs picklable callables in a Python pool's
warm workers, and the joblib backend ("gpuq") built on it."""

from __future__ import annotations

import concurrent.futures
import pickle
import threading
import weakref
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from . import _calls, _errors
from ._future import DONE as _DONE
from ._future import Future
from ._pickles import FunctionPickles

_PLAIN = (type(None), bool, int, float, str)  # arguments that travel as themselves
_PICKLED_ARGS = 1  # call_codec.hpp: kFlagPickledArgs


class Executor(concurrent.futures.Executor):
    """Runs ``fn(*args, **kwargs)`` in a gpuq Python pool's warm workers::

        with gpuq.Executor() as ex:                   # instead of ProcessPoolExecutor()
            futures = [ex.submit(score, batch) for batch in batches]
            results = list(ex.map(score, batches))

    The callable and its arguments travel pickled (cloudpickle, so lambdas and functions of
    ``__main__`` work); numpy arrays among them and in the result go through shared memory,
    not through the pickle. The pool must allow callables (``python.allow_callables``, off by
    default: it runs code sent by clients as the daemon's user; docs/python.md).

    ``pool``: the pool's name (default: the first Python pool that allows callables).
    ``client``: the :class:`gpuq.Client` to use (default: a new one, closed by
    :meth:`shutdown`). ``max_pending``: at most this many unfinished tasks; ``submit`` waits
    for one to end beyond it (default: none besides the daemon's queue, which holds 10 x
    workers and blocks ``submit`` when full). ``output_bytes``: room for each result (default:
    the arguments' array bytes plus 64 KiB). ``time_limit``: seconds each call may run.
    An exception raised by ``fn`` is re-raised by ``result()`` as itself (when it pickles),
    with the worker's traceback as its ``__cause__``; a worker that dies fails its task with
    :class:`gpuq.WorkerDied`.
    """

    def __init__(self, pool: Optional[str] = None, client: Any = None,
                 max_pending: Optional[int] = None, output_bytes: Optional[int] = None,
                 time_limit: Optional[float] = None) -> None:
        try:
            import cloudpickle
        except ImportError:  # pragma: no cover - a dependency of the package
            raise ImportError("gpuq.Executor needs cloudpickle (pip install cloudpickle)") from None
        self._pickle = cloudpickle
        from ._client import Client
        self._own_client = client is None
        self._client = Client() if client is None else client
        if pool is None:
            pools = _calls.python_pools(self._client)
            allowed = [p["name"] for p in pools if p["allow_callables"]]
            if not allowed:
                if self._own_client:
                    self._client.close()
                raise _errors.PermissionDenied(
                    "no pool of this daemon runs callables: give a Python pool "
                    "\"python\": {\"allow_callables\": true} (docs/python.md) or pass pool=")
            pool = allowed[0]
        self.pool = pool
        self._output_bytes = output_bytes
        self._time_limit = time_limit
        self._slots = threading.BoundedSemaphore(max_pending) if max_pending else None
        self._lock = threading.Lock()
        self._pending: List[Tuple[Any, "weakref.ref[Future]"]] = []
        self._prune_at = 64
        self._shutdown = False
        self._pickles = FunctionPickles(cloudpickle.dumps)

    @property
    def client(self) -> Any:
        """The :class:`gpuq.Client` the tasks go through."""
        return self._client

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        """Runs ``fn(*args, **kwargs)`` in a worker of the pool; its :class:`gpuq.Future`.
        Waits while ``max_pending`` tasks are unfinished, or while this client's share of the
        pool's queue is full."""
        if self._shutdown:
            raise RuntimeError("cannot schedule new futures after shutdown")
        if not callable(fn):
            raise TypeError(f"{type(fn).__name__} object is not callable")
        # The function's pickle, made once while it stays the same (_pickles); plain arguments
        # (numbers, strings, None, numpy arrays) travel as themselves, anything else pickled.
        call: Tuple[Any, ...]
        if all(type(a) in _PLAIN or (type(a) is np.ndarray and not a.dtype.hasobject)
               for a in (args + tuple(kwargs.values()) if kwargs else args)):
            call = (self._pickles.get(fn),) + args
            flags = 0
            data = sum(a.nbytes for a in call if type(a) is np.ndarray) + (sum(
                a.nbytes for a in kwargs.values() if type(a) is np.ndarray) if kwargs else 0)
        else:
            buffers: List[pickle.PickleBuffer] = []
            blob = self._pickle.dumps((args, kwargs), protocol=5, buffer_callback=buffers.append)
            call = (self._pickles.get(fn), blob, *buffers)
            kwargs = {}
            flags = _PICKLED_ARGS
            data = len(blob) + sum(memoryview(b).nbytes for b in buffers)
        output_bytes = self._output_bytes or data + _calls._OUTPUT_SLACK
        if self._slots is not None:
            self._slots.acquire()
        try:
            f = _calls.submit_python(self._client, _calls._pyops.CALL_OP, call, kwargs or None,
                                     self.pool, output_bytes, None, None, False,
                                     self._time_limit, False, True, flags)
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        with self._lock:
            # For shutdown(): the job (a small handle) and the future, weakly (a future holds
            # its result, and that its block of the segment). Ended jobs are let go now and
            # then, not by a callback per task, which would wake the watcher thread for each.
            self._pending.append((f._job, weakref.ref(f)))
            if len(self._pending) >= self._prune_at:
                self._pending = [e for e in self._pending if _unfinished(e[0])]
                self._prune_at = max(64, 2 * len(self._pending))
        if self._slots is not None:
            f.add_done_callback(self._release)
        return f

    def _release(self, f: Future) -> None:
        assert self._slots is not None
        self._slots.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new tasks from now on. ``cancel_futures``: cancel the unfinished ones (a running
        one is stopped, as :meth:`gpuq.Future.cancel` does). ``wait``: return once every task
        has ended, then close the client the executor made."""
        self._shutdown = True
        with self._lock:
            pending = self._pending
            self._pending = []
        if cancel_futures:
            for job, ref in pending:
                f = ref()
                if f is not None:
                    f.cancel()
                else:  # dropped by its caller: the job alone
                    try:
                        job.cancel()
                    except _errors.Error:
                        pass
        if wait:
            for job, ref in pending:
                f = ref()
                if f is not None:
                    concurrent.futures.wait([f])
                else:
                    try:
                        job.wait(-1)
                    except _errors.Error:
                        pass
            if self._own_client:
                self._client.close()


def _unfinished(job: Any) -> bool:
    try:
        return job.poll() < _DONE
    except _errors.Error:  # a parent's job after a fork, a connection gone: none to wait for
        return False


def _joblib_backend() -> Any:
    from joblib._parallel_backends import ParallelBackendBase

    class GpuqBackend(ParallelBackendBase):
        """joblib's "gpuq" backend: ``with joblib.parallel_backend("gpuq", pool=...)``; each
        batch of calls runs as one gpuq.Executor task in the pool's warm workers."""

        supports_retrieve_callback = True
        supports_timeout = True
        default_n_jobs = -1

        def __init__(self, pool: Optional[str] = None, client: Any = None,
                     output_bytes: Optional[int] = None, nesting_level: Optional[int] = None,
                     inner_max_num_threads: Optional[int] = None, **kwargs: Any) -> None:
            super().__init__(nesting_level=nesting_level,
                             inner_max_num_threads=inner_max_num_threads, **kwargs)
            self._pool = pool
            self._client = client
            self._output_bytes = output_bytes
            self._executor: Optional[Executor] = None

        def _workers(self) -> int:
            st = (self._executor.client if self._executor else None)
            try:
                status = st.status() if st is not None else None
                if status is None:
                    from ._client import status as daemon_status
                    status = daemon_status()
                for p in status.get("pools", []):
                    if p["name"] == (self._executor.pool if self._executor else self._pool) or (
                            self._pool is None and self._executor is None and
                            p.get("python", {}).get("allow_callables")):
                        return max(1, int(p.get("workers_total", 1)))
            except Exception:  # noqa: BLE001 - a guess is all joblib needs
                pass
            return 1

        def effective_n_jobs(self, n_jobs: int) -> int:
            if n_jobs == 0:
                raise ValueError("n_jobs == 0 in Parallel has no meaning")
            # Never 1: joblib runs the calls itself, in the caller, when its backend says 1 (a
            # one-worker pool, n_jobs=1, an unavailable pool's 0), which is what the "gpuq"
            # backend is there to avoid (the caller would make its own CUDA context).
            if n_jobs is None or n_jobs < 0:
                return max(2, self._workers())
            return max(2, n_jobs)

        def configure(self, n_jobs: int = 1, parallel: Any = None, **kwargs: Any) -> int:
            self.parallel = parallel
            if self._executor is None:
                self._executor = Executor(pool=self._pool, client=self._client,
                                          output_bytes=self._output_bytes)
            return self.effective_n_jobs(n_jobs)

        def submit(self, func: Callable[[], Any], callback: Any = None) -> Future:
            assert self._executor is not None, "configure() first"
            f = self._executor.submit(func)
            if callback is not None:
                f.add_done_callback(callback)
            return f

        def retrieve_result_callback(self, future: Future) -> Any:
            return future.result()

        def abort_everything(self, ensure_ready: bool = True) -> None:
            if self._executor is not None:
                self._executor.shutdown(wait=True, cancel_futures=True)
                self._executor = None

        def terminate(self) -> None:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    return GpuqBackend


def register_joblib() -> None:
    """Registers joblib's "gpuq" backend (``import gpuq`` does it when joblib is installed)."""
    import joblib
    joblib.register_parallel_backend("gpuq", _joblib_backend())
