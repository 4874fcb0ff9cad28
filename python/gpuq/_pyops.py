"""Python ops: the decorators a Python pool's modules use, and the Python side of a Python op's
wire format, shared by the client (gpuq.Client.call, gpuq.Executor) and the worker
(gpuq._worker).

The format itself (a binary call header in the job's input span, at the params ``py.h`` and
``py.n``; a binary answer at the start of its output buffer) is encoded and decoded by one C++
codec, python/src/call_codec.hpp, in gpuq._native; what it asks of Python (dtypes and JSON
values as text, and back) is gpuq._wire's, and what lives here is the conversion of results it
leaves to Python (framework tensors, str and dict).

Named ops never exchange pickles: a client may not make a worker unpickle (run) its bytes
unless the pool allows callables, and a worker's answer to a named op is arrays and JSON only."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from ._wire import is_array, json_text

__all__ = ["op", "on_start", "cancelled", "context", "WorkerContext"]

CALL_OP = "python_call"  # the op gpuq.Executor's jobs name (daemon: kPythonCallOp)

# ---- registration (in a worker, or in the daemon's listing child) -----------------------------

# name -> (function, summary, batching): batching is (max_batch_size, max_queue_delay_us),
# (1, 0) for an op that is not batched.
_ops: Dict[str, Tuple[Callable[..., Any], str, Tuple[int, int]]] = {}

MAX_BATCH_SIZE = 65536  # daemon: kMaxBatchSize
MAX_QUEUE_DELAY_US = 1_000_000  # daemon: kMaxQueueDelayUs
DEFAULT_QUEUE_DELAY_US = 500
_on_start: List[Callable[[], Any]] = []


def _valid_name(name: str) -> bool:
    return (
        isinstance(name, str)
        and 1 <= len(name) <= 48
        and all(c.isdigit() or c == "_" or ("a" <= c <= "z") for c in name)
    )


def _batching(name: str, max_batch_size: Any, max_queue_delay_us: Any) -> Tuple[int, int]:
    if type(max_batch_size) is not int or not 1 <= max_batch_size <= MAX_BATCH_SIZE:
        raise ValueError(
            f"gpuq.op({name!r}): max_batch_size must be an int from 1 to "
            f"{MAX_BATCH_SIZE}, not {max_batch_size!r}"
        )
    if max_queue_delay_us is None:
        max_queue_delay_us = DEFAULT_QUEUE_DELAY_US if max_batch_size > 1 else 0
    if type(max_queue_delay_us) is not int or not 0 <= max_queue_delay_us <= MAX_QUEUE_DELAY_US:
        raise ValueError(
            f"gpuq.op({name!r}): max_queue_delay_us must be an int from 0 to "
            f"{MAX_QUEUE_DELAY_US}, not {max_queue_delay_us!r}"
        )
    return (max_batch_size, max_queue_delay_us if max_batch_size > 1 else 0)


def op(
    name: str,
    summary: Optional[str] = None,
    *,
    max_batch_size: int = 1,
    max_queue_delay_us: Optional[int] = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Registers the decorated function as the Python op ``name`` of the pools whose modules
    import it (1-48 characters of [a-z0-9_])::

        @gpuq.op("classify")
        def classify(images, *, top_k=5):
            ...                       # images: a read-only numpy view of the caller's array
            return scores, labels     # arrays, a tuple of them, a scalar or None

    A job calls it with the caller's arrays as numpy views (read-only, zero copy) and its
    keyword arguments; what it returns reaches the caller as numpy arrays. The function is
    returned unchanged (it can still be called directly).

    ``max_batch_size`` above 1 makes the op batched (docs/python.md, "Dynamic batching"): a
    worker gathers queued jobs of it from any client, up to ``max_batch_size`` rows (the first
    axis of their arrays) or until ``max_queue_delay_us`` (default 500) has passed, and calls
    the function once with each array argument concatenated along axis 0; the function returns
    an array (or a tuple of arrays) with one row per input row, and each caller gets its own
    rows back."""
    batching = _batching(name, max_batch_size, max_queue_delay_us)
    if not _valid_name(name):
        raise ValueError(f"gpuq.op: {name!r} is not a valid op name (1-48 characters of [a-z0-9_])")
    if name == CALL_OP:
        raise ValueError(f"gpuq.op: {name!r} is reserved for gpuq.Executor's callables")

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"gpuq.op({name!r}) decorates a function, not {type(fn).__name__}")
        have = _ops.get(name)
        if have is not None and have[0] is not fn:
            raise ValueError(
                f"gpuq.op: {name!r} is registered twice ({_qualname(have[0])} and {_qualname(fn)})"
            )
        doc = summary if summary is not None else (fn.__doc__ or "").strip().split("\n")[0]
        _ops[name] = (fn, doc[:200], batching)
        return fn

    return register


def on_start(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Registers ``fn`` to run once in each worker before it reports ready (load weights onto
    the GPU once). An exception is the worker's start-up failure: its traceback goes to the
    daemon's log and to ``gpuqctl status``."""
    if not callable(fn):
        raise TypeError("gpuq.on_start decorates a function")
    if fn not in _on_start:
        _on_start.append(fn)
    return fn


def _qualname(fn: Any) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


class WorkerContext:
    """What a Python op may ask of the worker running it (:func:`gpuq.context`).

    ``device``: on a GPU pool the worker's one CUDA device, index 0 of what it sees (its
    ``CUDA_VISIBLE_DEVICES`` is its GPU alone); None on a CPU pool. ``torch_device``: the same
    as a ``torch.device`` when torch is loaded. ``stream``: the worker's CUDA stream as the
    framework's own object (``torch.cuda.Stream``, else ``cupy.cuda.Stream``), which the worker
    made current for its whole life, so code that uses the current stream runs on it without
    asking. ``pool_id`` and ``worker_id``: the daemon's numbers for them."""

    def __init__(self) -> None:
        self.device: Optional[int] = None
        self.torch_device: Any = None
        self.stream: Any = None
        self.cupy_stream: Any = None
        self.pool_id = -1
        self.worker_id = -1
        self.gpu = False

    def cancelled(self) -> bool:
        """:func:`gpuq.cancelled`."""
        return cancelled()

    def __repr__(self) -> str:
        return (
            f"<gpuq.WorkerContext pool={self.pool_id} worker={self.worker_id} "
            f"device={self.device} stream={self.stream!r}>"
        )


_context = WorkerContext()


def in_worker() -> bool:
    """Whether this process is one of a gpuq Python pool's workers."""
    return _context.worker_id >= 0


def context() -> WorkerContext:
    """The running worker's :class:`WorkerContext` (in a Python op or an ``on_start``)."""
    return _context


def cancelled() -> bool:
    """In a Python op: whether its job was asked to stop (its client cancelled it, or its time
    limit passed). An op that loops should look now and then and return (or raise
    :class:`gpuq.Cancelled`); one that does not is stopped by killing its worker after the
    daemon's ``cancel_grace_ms``."""
    return bool(_native.job_cancelled())


# ---- the worker's side ------------------------------------------------------------------------


def decode_call(buf: memoryview, params: Dict[str, Any]) -> Tuple[list, dict]:
    """The job's args and kwargs from its input span (the native codec): arrays as views of
    ``buf`` (read-only when it is)."""
    try:
        h, n = int(params["py.h"]), int(params["py.n"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "not a Python op job: its params lack py.h and py.n (submit it with gpuq.Client.call)"
        ) from None
    if h < 0 or n < 0:
        raise ValueError(f"the header [{h}, +{n}) lies outside the job's {len(buf)}-byte input")
    _, args, kwargs = _native.decode_call(buf, h, n, False)
    return args, kwargs


def batch_key(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, int]:
    """A batched op's job: (what jobs must share to be called together, its rows). The key is
    None for a job that runs alone: no array argument, a 0-d one, or arrays whose first axes
    differ. Jobs share a call when their JSON arguments, and their arrays' dtypes and shapes
    past axis 0, are the same."""
    rows = -1
    alone = False

    def part(v: Any) -> Any:
        nonlocal rows, alone
        if isinstance(v, np.ndarray):
            if v.ndim == 0 or (rows >= 0 and v.shape[0] != rows):
                alone = True
                return None
            rows = v.shape[0]
            return (
                "nd",
                v.dtype.str if v.dtype.fields is None else repr(v.dtype.descr),
                v.shape[1:],
            )
        return ("js", json.dumps(v, sort_keys=True, allow_nan=True))

    key = (tuple(part(a) for a in args), tuple((k, part(v)) for k, v in sorted(kwargs.items())))
    if alone or rows < 0:
        return None, max(rows, 1)
    return key, rows


def concat_rows(parts: Sequence[Any]) -> Any:
    """One argument of a batched call: the jobs' arrays concatenated along axis 0 (one copy,
    C-contiguous), or the first job's JSON value (the batch key makes them all equal)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=0)
    return parts[0]


def split_rows(name: str, result: Any, rows: Sequence[int]) -> Tuple[str, List[List[np.ndarray]]]:
    """A batched call's result cut into each job's rows: (kind, [arrays of job j]). Raises
    TypeError when it is not an array or tuple of arrays with one row per input row."""
    total = sum(rows)
    kind, arrays, _ = _result_arrays(result)
    if (
        kind not in ("array", "tuple")
        or not arrays
        or any(a.ndim == 0 or a.shape[0] != total for a in arrays)
    ):
        shapes = [tuple(a.shape) for a in arrays] if kind in ("array", "tuple") else kind
        raise TypeError(
            f"{name} is batched: it must return an array, or a tuple of arrays, "
            f"with one row per input row; the call had {total} rows and returned "
            f"{shapes}"
        )
    out = []
    at = 0
    for r in rows:
        out.append([a[at : at + r] for a in arrays])
        at += r
    return kind, out


def _result_arrays(result: Any) -> Tuple[str, List[np.ndarray], Any]:
    """(kind, arrays, json value) of what an op returned."""
    if result is None:
        return "none", [], None
    if is_array(result):
        return ("array" if isinstance(result, np.ndarray) else "scalar"), [np.asarray(result)], None
    if isinstance(result, (bool, int, float, complex)):
        return "scalar", [np.asarray(result)], None
    if isinstance(result, (tuple, list)) and all(
        is_array(x) or isinstance(x, (bool, int, float, complex)) for x in result
    ):
        return "tuple", [np.asarray(x) for x in result], None
    # A framework's tensor (torch, CuPy, JAX): to host memory, through numpy.
    conv = _to_numpy(result)
    if conv is not None:
        return "array", [conv], None
    if isinstance(result, (tuple, list)):
        arrays = [_to_numpy(x) if not is_array(x) else np.asarray(x) for x in result]
        if all(a is not None for a in arrays):
            return "tuple", arrays, None  # type: ignore[return-value]
    if isinstance(result, (str, dict)):
        json_text(result, "the op's result")  # TypeError when it is not JSON-able
        return "json", [], result
    raise TypeError(
        f"the op returned {type(result).__name__}; return a numpy array (or a "
        "torch/CuPy/JAX/TensorFlow array), a tuple of them, a scalar, a str or "
        "dict, or None"
    )


def _to_numpy(x: Any) -> Optional[np.ndarray]:
    """A framework's array in host memory as numpy, told by its class's module (so no
    framework is imported here); None for anything else."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return x.detach().cpu().numpy()
    if mod == "cupy":
        return x.get()
    if mod in ("jax", "jaxlib"):
        return np.asarray(x)
    if mod == "tensorflow" and hasattr(x, "numpy"):  # an EagerTensor, a tf.Variable's value
        return np.asarray(x.numpy())
    if mod == "keras" and hasattr(x, "__array__"):  # a Keras 3 Variable (model.weights)
        return np.asarray(x)
    return None


def write_answer(out: memoryview, header: Dict[str, Any], arrays: Sequence[np.ndarray]) -> int:
    """Writes an answer at the start of ``out``: ``header``'s "kind" (default "error") and its
    other keys as the answer's extra JSON, and the arrays; the bytes used. Raises
    ResultTooLarge when they do not fit."""
    extra = {k: v for k, v in header.items() if k != "kind"}
    kind = header.get("kind", "error")
    n = _native.write_answer(
        out, kind, [np.asarray(a) for a in arrays], json.dumps(extra) if extra else ""
    )
    if n < 0:
        raise ResultTooLarge(-n, len(out))
    return n


def write_result(out: memoryview, result: Any) -> int:
    n = _native.write_result(out, result)  # the common results, in C++
    if n is None:
        kind, arrays, value = _result_arrays(result)
        header: Dict[str, Any] = {"kind": kind}
        if kind == "json":
            header["value"] = value
        return write_answer(out, header, arrays)
    if n < 0:
        raise ResultTooLarge(-n, len(out))
    return n


def write_error(out: memoryview, kind: str, message: str, tb: str, **extra: Any) -> int:
    """The failure record (type, message, traceback), trimmed to fit; 0 when none fits."""
    for limit in (len(tb), 16384, 2048, 0):
        rec = {
            "error": dict(
                {
                    "type": kind,
                    "message": message[:4096],
                    "traceback": tb[-limit:] if limit else "",
                },
                **extra,
            )
        }
        try:
            return write_answer(out, rec, [])
        except ResultTooLarge:
            continue
    return 0


class ResultTooLarge(Exception):
    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__(
            f"the result needs {needed} bytes, and the job's output buffer holds "
            f"{capacity}: pass output_bytes={needed} (or more)"
        )
        self.needed = needed
        self.capacity = capacity


# ---- the client's side ------------------------------------------------------------------------


def read_answer(out: np.ndarray, nbytes: int) -> Dict[str, Any]:
    """The answer the worker wrote at the start of ``out`` (a uint8 array): its extra JSON
    keys, "kind", and "arrays" as views of ``out``."""
    kind, views, extra = _native.read_answer(out, nbytes)
    header = json.loads(extra) if extra else {}
    if not isinstance(header, dict):
        raise ValueError("the worker's answer is malformed (its extra is not a JSON object)")
    header["kind"] = kind
    header["arrays"] = views
    return header
