"""gpuq: run jobs in the gpuq daemon's warm, pinned GPU and CPU workers from any Python process.

    import gpuq, numpy as np

    with gpuq.connect() as client:                 # the daemon's default runtime directory
        x = client.array(np.random.rand(1, 3, 32, 32).astype(np.float32))   # in shared memory
        w = client.array(np.random.rand(8, 3, 3, 3).astype(np.float32))
        y = client.conv2d(x, w, padding=1).result()                        # 1x8x32x32
        fut = client.submit("echo", x, out=client.empty_like(x))           # gpuq.Future

    gpuq.submit("noop").result()                  # the module's default client

A :class:`Client` is thread-safe and fork-safe (a forked child connects anew on first use).
Its futures are ``concurrent.futures.Future`` objects and are awaitable in asyncio. Every
``gpuq::ErrorCode`` is an exception class under :class:`Error`. Guide: docs/python.md.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any, Optional

import numpy as np

from . import _native
from ._client import (
    Client,
    default_runtime_dir,
    metrics,
    reload_config,
    restart_pool,
    status,
)
from ._errors import *  # noqa: F401,F403 - the exception classes
from ._errors import SystemError  # noqa: F401, A004 - gpuq.SystemError, by the code's name
from ._errors import __all__ as _error_names
from ._remote import RemoteTraceback
from ._executor import Executor
from ._joblib import register as register_joblib
from ._future import Future, JobInfo
from ._ops import WorkerContext, cancelled, context, on_start, op, step_op
from ._stream import Stream

__version__ = _native.version()

__all__ = [
    "Client",
    "Executor",
    "Future",
    "RemoteTraceback",
    "Stream",
    "WorkerContext",
    "op",
    "step_op",
    "on_start",
    "cancelled",
    "context",
    "register_joblib",
    "JobInfo",
    "connect",
    "default_client",
    "submit",
    "try_submit",
    "empty",
    "zeros",
    "array",
    "status",
    "metrics",
    "reload_config",
    "restart_pool",
    "default_runtime_dir",
    *_error_names,
]

_default: Optional[Client] = None
_default_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _default_lock
    _default_lock = threading.Lock()  # a parent thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def connect(
    runtime_dir: Optional[str] = None,
    segment_bytes: int = 0,
    name: Optional[str] = None,
    keep_running_jobs: bool = False,
    wait: float = 0.0,
) -> Client:
    """A new :class:`Client` (a context manager: ``with gpuq.connect() as client:``).
    ``keep_running_jobs``: jobs still running when the connection ends (the process exits) run
    to their end; by default the daemon cancels them. ``wait``: seconds to keep trying while no
    daemon answers (one that is still starting); by default :class:`Disconnected` at once."""
    return Client(
        runtime_dir=runtime_dir,
        segment_bytes=segment_bytes,
        name=name,
        keep_running_jobs=keep_running_jobs,
        wait=wait,
    )


def default_client() -> Client:
    """The module's client, connected on first use to the daemon's default runtime directory
    ($GPUQ_RUNTIME_DIR, else the rule of docs/service.md). Shared by the module-level calls;
    a forked child gets its own connection on first use, as every Client does."""
    global _default
    c = _default
    if c is None or c.closed:
        with _default_lock:
            if _default is None or _default.closed:
                _default = Client()
            c = _default
    return c


def submit(op: str, *inputs: Any, **kwargs: Any) -> Future:
    """:meth:`Client.submit` on the default client."""
    return default_client().submit(op, *inputs, **kwargs)


def try_submit(op: str, *inputs: Any, **kwargs: Any) -> Future:
    """:meth:`Client.try_submit` on the default client."""
    return default_client().try_submit(op, *inputs, **kwargs)


def empty(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """:meth:`Client.empty` on the default client."""
    return default_client().empty(shape, dtype)


def zeros(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """:meth:`Client.zeros` on the default client."""
    return default_client().zeros(shape, dtype)


def array(obj: Any, dtype: Any = None) -> np.ndarray:
    """:meth:`Client.array` on the default client."""
    return default_client().array(obj, dtype)


# joblib's "gpuq" backend: registered as soon as joblib is imported, before or after gpuq,
# without importing joblib here (it takes a quarter of a second). The wheel's hook module
# (python/hook/_gpuq_joblib.py, also loaded at start-up by its .pth file) does it; with gpuq
# imported, it registers gpuq's class rather than its factory.
if "joblib" in sys.modules:
    register_joblib()
else:
    try:
        import _gpuq_joblib
    except ImportError:  # gpuq without its hook (not the wheel): gpuq.register_joblib() by hand
        pass
    else:
        _gpuq_joblib.install()
