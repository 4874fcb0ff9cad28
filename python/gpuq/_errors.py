"""gpuq's exceptions: one class per ``gpuq::ErrorCode``, all under :class:`gpuq.Error`.

Each carries the daemon's (or the library's) message as ``str(e)`` and ``e.message``, and the
numeric code as ``e.code``. Where a built-in exception means the same thing, the class derives
from it too, so ``except ValueError`` catches :class:`InvalidArgument` and ``except
TimeoutError`` catches :class:`Timeout` (a wait gave up) and :class:`TimedOut` (a job was
stopped at its time limit), ``except concurrent.futures.CancelledError`` :class:`Cancelled`
and ``except BrokenProcessPool`` :class:`WorkerDied`.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process
from typing import Dict, Type

from . import _native

__all__ = [
    "Error",
    "InvalidArgument",
    "UnknownOp",
    "UnknownPool",
    "QueueFull",
    "Timeout",
    "Cancelled",
    "Expired",
    "WorkerDied",
    "Disconnected",
    "ProtocolMismatch",
    "PermissionDenied",
    "OutOfMemory",
    "NotFound",
    "ShuttingDown",
    "ForkedClient",
    "NoDevice",
    "Internal",
    "NotCancellable",
    "TooManyClients",
    "OpFailed",
    "TimedOut",
    "PoolDown",
    "ClientClosed",
]


class Error(Exception):
    """Base class of every gpuq error. ``code`` is the ``gpuq::ErrorCode`` value (0 for the
    Python-only :class:`ClientClosed`), ``code_name`` its name, ``message`` the text."""

    code: int = -1
    code_name: str = "Error"

    def __init__(self, message: str = "") -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidArgument(Error, ValueError):
    """A field of a request is malformed; the message names it."""

    code_name = "InvalidArgument"


class UnknownOp(Error, LookupError):
    """No op of that name is registered in the daemon."""

    code_name = "UnknownOp"


class UnknownPool(Error, LookupError):
    """No pool of that name."""

    code_name = "UnknownPool"


class QueueFull(Error):
    """``try_submit``: the pool's ring, or this client's share of it, is full."""

    code_name = "QueueFull"


class Timeout(Error, TimeoutError):
    """A deadline passed before the call could complete (``submit(timeout=)``)."""

    code_name = "Timeout"


class Cancelled(Error, concurrent.futures.CancelledError):
    """The job was cancelled (also a ``concurrent.futures.CancelledError``)."""

    code_name = "Cancelled"


class Expired(Error):
    """The job's ``expire_after`` passed while it was still queued; it did not run."""

    code_name = "Expired"


class WorkerDied(Error, concurrent.futures.process.BrokenProcessPool):
    """The worker running the job exited (it is replaced; the job is not run again unless it
    was submitted ``retryable=True``). Also a ``concurrent.futures.process.BrokenProcessPool``,
    what ``ProcessPoolExecutor`` raises when a task's process dies, so code written for it
    catches this too; unlike that pool, gpuq's goes on serving (the daemon replaces the
    worker)."""

    code_name = "WorkerDied"


class Disconnected(Error, ConnectionError):
    """The daemon is gone, or restarted; make a new client."""

    code_name = "Disconnected"


class ProtocolMismatch(Error):
    """This client and the daemon speak different protocol versions."""

    code_name = "ProtocolMismatch"


class PermissionDenied(Error, PermissionError):
    """This user is not one the daemon serves."""

    code_name = "PermissionDenied"


class OutOfMemory(Error, MemoryError):
    """No room in the payload segment (or device memory), or every job slot is in use."""

    code_name = "OutOfMemory"


class NotFound(Error, LookupError):
    """No such job, buffer or object."""

    code_name = "NotFound"


class ShuttingDown(Error):
    """The daemon is draining and accepts no new jobs."""

    code_name = "ShuttingDown"


class ForkedClient(Error):
    """The connection belongs to the parent of a fork (the package reconnects by itself; this
    reaches you only from a job the parent submitted)."""

    code_name = "ForkedClient"


class NoDevice(Error):
    """The pool has no usable device and no fallback."""

    code_name = "NoDevice"


class Internal(Error):
    """A bug in gpuq; the message says where."""

    code_name = "Internal"


class SystemError(Error, OSError):  # noqa: A001 - the code's name; gpuq.SystemError
    """A system call failed; the message names it and errno."""

    code_name = "SystemError"


class NotCancellable(Error):
    """``cancel``: the job has already finished."""

    code_name = "NotCancellable"


class TooManyClients(Error):
    """The daemon serves its configured maximum of clients."""

    code_name = "TooManyClients"


class OpFailed(Error):
    """The op itself reported failure; the message says why."""

    code_name = "OpFailed"


class TimedOut(Error, TimeoutError):
    """The job ran past its time limit (``time_limit=``, or its pool's ``job_time_limit_ms``)
    and the daemon stopped it. Not :class:`Timeout`, which is a wait that gave up while the job
    went on."""

    code_name = "TimedOut"


class PoolDown(Error):
    """The pool has had no ready worker for the daemon's ``pool_down_fail_ms`` (its workers keep
    failing to start): its queued jobs fail with this, and new ones at once, until a worker is
    ready again. The message names the pool and how its last worker ended."""

    code_name = "PoolDown"


class ClientClosed(Error):
    """The client was closed (``Client.close()`` or the end of its ``with`` block)."""

    code, code_name = 0, "ClientClosed"


# One class per gpuq::ErrorCode, numbered from the C++ enum itself (_native.ERROR_CODES, made
# from common/include/gpuq/error.hpp): the numbers are never retyped here.
_CLASSES = (
    InvalidArgument,
    UnknownOp,
    UnknownPool,
    QueueFull,
    Timeout,
    Cancelled,
    Expired,
    WorkerDied,
    Disconnected,
    ProtocolMismatch,
    PermissionDenied,
    OutOfMemory,
    NotFound,
    ShuttingDown,
    ForkedClient,
    NoDevice,
    Internal,
    SystemError,
    NotCancellable,
    TooManyClients,
    OpFailed,
    TimedOut,
    PoolDown,
)
for _cls in _CLASSES:
    _cls.code = _native.ERROR_CODES[_cls.code_name]
_BY_CODE: Dict[int, Type[Error]] = {cls.code: cls for cls in _CLASSES}


def error_for(code: int, message: str) -> Error:
    """The exception for a ``gpuq::ErrorCode`` value (an unknown code gives :class:`Error`)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = Error(message)
        err.code = code
        return err
    return cls(message)


# Every error _native raises is made here (its code's class, with the C++ message).
_native.set_error_factory(error_for)
