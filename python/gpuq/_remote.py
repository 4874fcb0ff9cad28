"""The exception a failed Python op raises in the caller: its class for the job's error code,
with the worker's exception type and traceback read from the answer's error record; for a
callable (gpuq.Executor), the worker's exception itself when it could be pickled, as in
``concurrent.futures.ProcessPoolExecutor``."""

from __future__ import annotations

import concurrent.futures
import pickle
from concurrent.futures.process import _RemoteTraceback as _StdlibRemoteTraceback

import numpy as np

from . import _answers, _errors
from ._future import JobInfo


class RemoteTraceback(_StdlibRemoteTraceback):
    """The traceback of an exception raised in a worker: the ``__cause__`` of the exception a
    failed Python op raises in the caller (as in ``concurrent.futures.ProcessPoolExecutor``,
    whose class this one derives from; a gpuq.Executor task's cause is that class itself)."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)  # type: ignore[arg-type]  # typeshed says a TracebackType; it is a str
        self.tb = tb

    def __str__(self) -> str:
        return f'\n"""\n{self.tb}"""'


def named_error(info: JobInfo, exc: BaseException, out: np.ndarray) -> BaseException:
    return remote_error(out, info, exc, False)


def callable_error(info: JobInfo, exc: BaseException, out: np.ndarray) -> BaseException:
    return remote_error(out, info, exc, True)


def remote_error(
    out: np.ndarray, info: JobInfo, exc: BaseException, callable_job: bool
) -> BaseException:
    """The exception a failed Python op raises: with its remote type and traceback; for a
    callable, the worker's exception itself when it could be pickled (a named op's answer is
    never unpickled: its worker may serve clients this one does not trust)."""
    if info.output_size < 8:
        return exc
    try:
        h = _answers.read_answer(out, info.output_size)
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
                original.__cause__ = _StdlibRemoteTraceback(f'\n"""\n{tb}"""')  # type: ignore[arg-type]
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
