"""What the two web apps share: a request's rows, gpuq's exceptions as HTTP answers, and the
report of what a web worker has imported. Imports gpuq and numpy only, never the model.

gpuq's exceptions (docs/python.md, "Errors") as HTTP status codes (docs/web.md):

- 503 with Retry-After: gpuq.Timeout and QueueFull (no room in the pool's queue in time:
  backpressure), Expired (the call waited in the queue past its expire_after and never ran),
  PoolDown, NoDevice, ShuttingDown, Disconnected, TooManyClients, OutOfMemory (gpuq cannot take
  work now: no ready worker, a daemon draining or gone, a full segment);
- 504: gpuq.TimedOut and any other TimeoutError (the model took longer than the request may
  wait);
- 500: gpuq.OpFailed, WorkerDied and any other error (the model failed; the daemon's log has
  the worker's traceback).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np

import gpuq

MAX_ROWS = 64  # one request's rows, at most the op's max_batch_size
RETRY_AFTER = {"Retry-After": "1"}


def rows_of(body: Any, width: int) -> np.ndarray:
    """The request's ``{"rows": [[...], ...]}`` as an n x width float32 array; ValueError (an
    HTTP 400) when it is not one."""
    if not isinstance(body, dict) or "rows" not in body:
        raise ValueError('the body must be JSON {"rows": [[...], ...]}')
    try:
        x = np.asarray(body["rows"], dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"rows: {e}") from None
    if x.ndim != 2 or not 1 <= x.shape[0] <= MAX_ROWS or x.shape[1] != width:
        raise ValueError(f"rows: must be 1 to {MAX_ROWS} rows of {width} numbers, not an array "
                         f"of shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("rows: must be finite numbers")
    return x


def http_error(e: BaseException) -> Tuple[int, Dict[str, str], str]:
    """(status, headers, message) for an exception of a gpuq call (the table above)."""
    if isinstance(e, (gpuq.Timeout, gpuq.QueueFull, gpuq.Expired)):
        return 503, RETRY_AFTER, f"overloaded, try again: {e}"
    if isinstance(e, (gpuq.PoolDown, gpuq.NoDevice, gpuq.ShuttingDown, gpuq.Disconnected,
                      gpuq.TooManyClients, gpuq.OutOfMemory)):
        return 503, RETRY_AFTER, f"unavailable: {e}"
    if isinstance(e, TimeoutError) or type(e).__name__ == "TimeoutError":
        # gpuq.TimedOut, concurrent.futures' and asyncio's TimeoutError (before Python 3.11
        # not builtin TimeoutErrors)
        return 504, {}, "the model did not answer in time"
    return 500, {}, f"the model failed: {type(e).__name__}: {e}"


# What a web worker must never have imported: the model lives in the gpuq pool only.
MODEL_MODULES = ("model", "model_ops", "torch", "tensorflow", "jax")


def imports_report() -> Dict[str, Any]:
    """This process's pid and parent, which of MODEL_MODULES it has imported (none), and its
    resident memory: the debug endpoint (WEB_DEBUG=1) of both apps."""
    rss: Optional[int] = None
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in MODEL_MODULES)
    return {"pid": os.getpid(), "ppid": os.getppid(), "model_modules": loaded, "rss": rss}


def debug_enabled() -> bool:
    return os.environ.get("WEB_DEBUG") == "1"
