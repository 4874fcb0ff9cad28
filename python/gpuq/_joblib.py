"""joblib's "gpuq" backend: ``Parallel(backend="gpuq")`` or ``parallel_config("gpuq",
pool=...)``; each batch of calls runs as one :class:`gpuq.Executor` task in the pool's warm
workers. Registered with joblib by ``import gpuq`` (as soon as joblib is imported)."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional

from . import _ops, _options
from ._executor import Executor
from ._future import Future


in_worker = _ops.in_worker


def _backend_class() -> Any:
    from joblib._parallel_backends import (
        AutoBatchingMixin,
        FallbackToBackend,
        ParallelBackendBase,
        SequentialBackend,
    )

    class GpuqBackend(AutoBatchingMixin, ParallelBackendBase):
        """joblib's "gpuq" backend (see the module's docstring). ``pool``, ``client``,
        ``output_bytes`` and ``priority`` are :class:`gpuq.Executor`'s; ``initializer`` and ``initargs`` (given
        to ``Parallel`` or ``parallel_config``) run in each worker before its first batch, as
        with loky. Batches are sized as loky's are (joblib's AutoBatchingMixin: short calls
        are grouped so that a batch lasts 0.2 to 2 s). Inside a gpuq worker, it runs the calls in that worker, one after another:
        a nested submission to the same pool would wait for workers that may all be busy
        running its parents."""

        supports_retrieve_callback = True
        supports_timeout = True
        default_n_jobs = -1

        def __init__(
            self,
            pool: Optional[str] = None,
            client: Any = None,
            output_bytes: Optional[int] = None,
            priority: Optional[str] = None,
            nesting_level: Optional[int] = None,
            inner_max_num_threads: Optional[int] = None,
            **kwargs: Any,
        ) -> None:
            super().__init__(
                nesting_level=nesting_level, inner_max_num_threads=inner_max_num_threads, **kwargs
            )
            self._pool_name = pool
            self._client = client
            self._output_bytes = output_bytes
            _options.priority_level(priority)  # a wrong level is refused here, not at first use
            self._priority = priority
            self._workers: Optional[Executor] = None  # as loky's backend names its executor
            self._init: Any = (None, ())

        def _pool_size(self) -> int:
            st = self._workers.client if self._workers else None
            try:
                status = st.status() if st is not None else None
                if status is None:
                    from ._client import status as daemon_status

                    status = daemon_status()
                for p in status.get("pools", []):
                    if p["name"] == (self._workers.pool if self._workers else self._pool_name) or (
                        self._pool_name is None
                        and self._workers is None
                        and p.get("python", {}).get("allow_callables")
                    ):
                        return max(1, int(p.get("workers_total", 1)))
            except Exception:  # noqa: BLE001 - a guess is all joblib needs
                pass
            return 1

        def effective_n_jobs(self, n_jobs: int) -> int:
            if n_jobs == 0:
                raise ValueError("n_jobs == 0 in Parallel has no meaning")
            if in_worker():
                return 1
            # Never 1: joblib runs the calls itself, in the caller, when its backend says 1 (a
            # one-worker pool, n_jobs=1, an unavailable pool's 0), which is what the "gpuq"
            # backend is there to avoid (the caller would make its own CUDA context).
            if n_jobs is None or n_jobs < 0:
                return max(2, self._pool_size())
            return max(2, n_jobs)

        def configure(self, n_jobs: int = 1, parallel: Any = None, **kwargs: Any) -> int:
            if in_worker():
                raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
            self.parallel = parallel
            options: Dict[str, Any] = {**self.backend_kwargs, **kwargs}
            init = (options.get("initializer"), tuple(options.get("initargs") or ()))
            if self._workers is not None and init != self._init:
                self._workers.shutdown(wait=True)  # a new initializer: a new executor
                self._workers = None
            if self._workers is None:
                self._workers = Executor(
                    initializer=init[0],
                    initargs=init[1],
                    pool=self._pool_name,
                    client=self._client,
                    output_bytes=self._output_bytes,
                    priority=self._priority,
                )
                self._init = init
            return self.effective_n_jobs(n_jobs)

        def submit(self, func: Callable[[], Any], callback: Any = None) -> Future:
            if self._workers is None:
                raise RuntimeError("the gpuq backend was used before Parallel configured it")
            f = self._workers.submit(func)
            if callback is not None:
                f.add_done_callback(callback)
            return f

        def retrieve_result_callback(self, future: Future) -> Any:
            return future.result()

        def abort_everything(self, ensure_ready: bool = True) -> None:
            # Cancels what no worker has started and returns at once; a running batch runs on
            # (stopping it would cost its warm worker: the daemon replaces a worker that does
            # not stop), and a thread closes the executor once its batches have ended. Then,
            # when joblib asks for it (a Parallel used as a context manager), is ready for the
            # next call.
            ex, self._workers = self._workers, None
            if ex is not None:
                ex.shutdown(wait=False, cancel_futures=True)
                threading.Thread(
                    target=ex.shutdown, name="gpuq-executor-drain", daemon=True
                ).start()
            if ensure_ready:
                self.configure(
                    n_jobs=self.parallel.n_jobs,
                    parallel=self.parallel,
                    **self.parallel._backend_kwargs,
                )

        def terminate(self) -> None:
            if self._workers is not None:
                self._workers.shutdown(wait=True)
                self._workers = None
            self.reset_batch_stats()  # as loky's backend: each call sizes its batches anew

    return GpuqBackend


def register() -> None:
    """Registers joblib's "gpuq" backend (``import gpuq`` does it when joblib is imported)."""
    import joblib

    joblib.register_parallel_backend("gpuq", _backend_class())
