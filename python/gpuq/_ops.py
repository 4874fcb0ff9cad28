"""The decorators a Python pool's modules use (``@gpuq.op``, ``@gpuq.on_start``), the registry
they fill, and what an op may ask of its worker (:func:`gpuq.context`, :func:`gpuq.cancelled`).

Registration runs in a worker (the pool's modules imported by gpuq._worker) and in gpuqd's
listing child (``--list-ops``); the worker's C++ runtime reads the registry once, at start."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from . import _native

__all__ = ["op", "step_op", "on_start", "cancelled", "context", "WorkerContext"]

# An op's batching: (max_batch_size, max_queue_delay_us, step), (1, 0, False) for an op that is
# not batched; `step` for a step op (max_queue_delay_us 0: its jobs join at the next step).
Batching = Tuple[int, int, bool]


class StepFunctions(NamedTuple):
    """A step op's two functions, as the registry holds them (:func:`step_op`)."""

    start: Callable[..., Any]
    step: Callable[[List[Any]], Any]


# name -> (function, summary, batching); a step op's "function" is its StepFunctions.
registry: Dict[str, Tuple[Any, str, Batching]] = {}
on_start_functions: List[Callable[[], Any]] = []

DEFAULT_QUEUE_DELAY_US = 500


def _valid_name(name: str) -> bool:
    return (
        isinstance(name, str)
        and 1 <= len(name) <= 48
        and all(c.isdigit() or c == "_" or ("a" <= c <= "z") for c in name)
    )


def _batching(decorator: str, name: str, max_batch_size: Any, max_queue_delay_us: Any) -> Batching:
    if type(max_batch_size) is not int or not 1 <= max_batch_size <= _native.MAX_BATCH_SIZE:
        raise ValueError(
            f"{decorator}({name!r}): max_batch_size must be an int from 1 to "
            f"{_native.MAX_BATCH_SIZE}, not {max_batch_size!r}"
        )
    if max_queue_delay_us is None:
        max_queue_delay_us = DEFAULT_QUEUE_DELAY_US if max_batch_size > 1 else 0
    if (
        type(max_queue_delay_us) is not int
        or not 0 <= max_queue_delay_us <= _native.MAX_QUEUE_DELAY_US
    ):
        raise ValueError(
            f"{decorator}({name!r}): max_queue_delay_us must be an int from 0 to "
            f"{_native.MAX_QUEUE_DELAY_US}, not {max_queue_delay_us!r}"
        )
    return (max_batch_size, max_queue_delay_us if max_batch_size > 1 else 0, False)


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
    batching = _batching("gpuq.op", name, max_batch_size, max_queue_delay_us)
    _check_name("gpuq.op", name)

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"gpuq.op({name!r}) decorates a function, not {type(fn).__name__}")
        _register("gpuq.op", name, fn, fn, summary, batching)
        return fn

    return register


def step_op(
    name: str,
    summary: Optional[str] = None,
    *,
    start: Callable[..., Any],
    max_batch_size: int = 32,
) -> Callable[[Callable[[List[Any]], Any]], Callable[[List[Any]], Any]]:
    """Registers the decorated function as the step op ``name``: an op that makes a sequence of
    parts one step at a time (a token, a frame), batched per step across every caller
    (docs/python.md, "Step-level batching")::

        def start(prompt, *, length=32):          # a job's arguments, as an op's
            return {"h": encode(prompt), "left": length}      # its sequence's state

        @gpuq.step_op("generate", start=start, max_batch_size=32)
        def step(states):                         # the live sequences' states
            h = model(torch.stack([s["h"] for s in states]))  # one call for all of them
            out = []
            for s, hi in zip(states, h):
                s["h"], s["left"] = hi, s["left"] - 1
                out.append((sample(hi), s["left"] == 0))      # (its part, ended?)
            return out

    ``start`` runs when a job joins, with the job's arguments, and returns its state (any
    object; copy what it keeps of the arguments: they are views of the caller's memory).
    ``step`` runs once per step with the states of the sequences that take it, changes them in
    place, and returns one ``(part, done)`` per state, in order. A worker holds up to
    ``max_batch_size`` live sequences: a new job joins at the next step, a sequence that is done
    (or cancelled, or past its time limit) leaves at the next, so short sequences never wait for
    long ones. :meth:`gpuq.Client.stream` gets each part as its step ends; :meth:`gpuq.Client.call`
    gets the list of a sequence's parts. An exception in ``step`` fails the sequences of that
    step; one in ``start``, its job alone. The function is returned unchanged."""
    batching = _batching("gpuq.step_op", name, max_batch_size, 0)
    _check_name("gpuq.step_op", name)
    if not callable(start):
        raise TypeError(f"gpuq.step_op({name!r}): start must be a function, not {start!r}")

    def register(step: Callable[[List[Any]], Any]) -> Callable[[List[Any]], Any]:
        if not callable(step):
            raise TypeError(
                f"gpuq.step_op({name!r}) decorates a function, not {type(step).__name__}"
            )
        fns = StepFunctions(start, step)
        _register("gpuq.step_op", name, step, fns, summary, (batching[0], 0, True))
        return step

    return register


def _check_name(decorator: str, name: str) -> None:
    if not _valid_name(name):
        raise ValueError(
            f"{decorator}: {name!r} is not a valid op name (1-48 characters of [a-z0-9_])"
        )
    if name == _native.CALL_OP:
        raise ValueError(f"{decorator}: {name!r} is reserved for gpuq.Executor's callables")


def _register(
    decorator: str,
    name: str,
    fn: Callable[..., Any],
    entry: Any,
    summary: Optional[str],
    batching: Batching,
) -> None:
    have = registry.get(name)
    if have is not None and have[0] != entry:
        was = have[0].step if isinstance(have[0], StepFunctions) else have[0]
        raise ValueError(
            f"{decorator}: {name!r} is registered twice ({_qualname(was)} and {_qualname(fn)})"
        )
    doc = summary if summary is not None else (fn.__doc__ or "").strip().split("\n")[0]
    registry[name] = (entry, doc[:200], batching)


def on_start(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Registers ``fn`` to run once in each worker before it reports ready (load weights onto
    the GPU once). An exception is the worker's start-up failure: its traceback goes to the
    daemon's log and to ``gpuqctl status``."""
    if not callable(fn):
        raise TypeError("gpuq.on_start decorates a function")
    if fn not in on_start_functions:
        on_start_functions.append(fn)
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
