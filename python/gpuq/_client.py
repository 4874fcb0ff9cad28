"""gpuq.Client: one connection to the daemon, its shared-memory arrays and its jobs."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from . import _call_backlog, _calls, _errors, _native, _options, _pools, _room, _stream, _tensors
from ._future import Future, Watcher

if TYPE_CHECKING:
    from typing_extensions import Unpack

ArrayLike = Any
Shape = Union[int, Sequence[int]]
Pair = Union[int, Tuple[int, int]]

# ---- fork ---------------------------------------------------------------------------------------
# A child of fork() must not use its parent's connection (the parent owns its job slots). Every
# Client notices the fork on its next call and connects anew, transparently; the parent's jobs
# and arrays are left to the parent.
_fork_generation = 0
_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    global _fork_generation
    _fork_generation += 1
    for c in list(_clients):
        c._lock = threading.Lock()  # a parent thread may have held it at the fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# The conversions of times the calls take (shared with _calls).
_seconds_to_ns = _options.seconds_to_ns


def _shape_tuple(shape: Shape) -> Tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        return (int(shape),)
    return tuple(int(d) for d in shape)


class _Connection:
    """One native connection and what belongs to it (this process's only)."""

    __slots__ = ("native", "base", "end", "watcher", "pools", "holders", "backlogs", "__weakref__")

    def __init__(self, native: Any) -> None:
        self.native = native
        self.base = native.arena_address
        self.end = self.base + native.arena_bytes
        self.watcher = Watcher()
        self.pools = {p[0]: p for p in native.pools()}
        # The pending futures of Python calls, each holding a block of the segment until it
        # is read (_room: a submit that finds no room settles the finished ones).
        self.holders: "weakref.WeakSet[Any]" = weakref.WeakSet()
        # Per pool, the calls of asubmit_call waiting for room (gpuq._calls, "calls that never
        # wait in the caller's thread").
        self.backlogs: Dict[str, Any] = {}


def _with_params(kwargs: Dict[str, Any], params: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A Python op's keyword arguments: ``kwargs`` and ``params`` (keywords whose names clash
    with the submit method's own), one name given in both refused."""
    if not params:
        return kwargs
    clash = set(params) & set(kwargs)
    if clash:
        raise _errors.InvalidArgument(
            f"keyword {sorted(clash)[0]!r} given in params and as a keyword"
        )
    return dict(kwargs, **params)


class Client:
    """A connection to the gpuq daemon.

    ``Client()`` connects (``runtime_dir``: the daemon's runtime directory, default as the C++
    client finds it; ``segment_bytes``: the size of this client's shared-memory segment, 0 for
    the daemon's default; ``name``: shown in ``gpuqctl status``; ``keep_running_jobs``: when
    this process exits (or its connection ends) with jobs still running, let them run to their
    end instead of having the daemon cancel them; ``wait``: seconds to keep trying while no
    daemon answers at the socket, for a daemon that is still starting, as after ``gpuqd &``;
    0, the default, raises :class:`gpuq.Disconnected` at once). Thread-safe. Use it as a
    context manager, or call :meth:`close`.

    After ``fork()`` the child gets a connection of its own on its first call, by itself; the
    parent's jobs and arrays stay the parent's. A Client pickles as its connect arguments, so
    one passed to a ``spawn``/``forkserver`` child connects anew there.
    """

    def __init__(
        self,
        runtime_dir: Optional[str] = None,
        segment_bytes: int = 0,
        name: Optional[str] = None,
        spin_us: float = 50.0,
        keep_running_jobs: bool = False,
        wait: float = 0.0,
    ) -> None:
        if segment_bytes < 0:
            raise _errors.InvalidArgument(f"segment_bytes: must be >= 0, not {segment_bytes}")
        if not isinstance(wait, (int, float)) or not wait >= 0:
            raise _errors.InvalidArgument(f"wait: must be a number of seconds >= 0, not {wait!r}")
        self._runtime_dir = runtime_dir or ""
        self._segment_bytes = int(segment_bytes)
        self._name = name or ""
        self._spin_ns = int(spin_us * 1000)
        self._keep_running_jobs = bool(keep_running_jobs)
        self._lock = threading.Lock()
        self._closed = False
        self._conn: Optional[_Connection] = None
        self._generation = _fork_generation
        deadline = time.monotonic() + wait
        while True:
            try:
                self._conn = self._connect()
                break
            except _errors.Disconnected:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        _clients.add(self)

    def _connect(self) -> _Connection:
        return _Connection(
            _native.Connection.connect(
                self._runtime_dir,
                self._segment_bytes,
                self._name,
                self._spin_ns,
                self._keep_running_jobs,
            )
        )

    def _c(self) -> _Connection:
        """This process's connection (a new one after a fork)."""
        conn = self._conn
        if self._generation != _fork_generation or conn is None:
            if self._closed:
                raise _errors.ClientClosed("this gpuq client is closed")
            with self._lock:
                if self._generation != _fork_generation:
                    # The parent's native connection is not closed here: arrays this child
                    # inherited still point into its mapping, which their bases keep alive.
                    self._conn = self._connect()
                    self._generation = _fork_generation
                conn = self._conn
            assert conn is not None
        return conn

    def reconnect(self, wait: float = 0.0) -> None:
        """Connects anew, with this client's arguments: after :class:`gpuq.Disconnected`, when
        the daemon was restarted (by systemd, a DaemonSet) or another took its socket.
        ``wait``: seconds to keep trying while no daemon answers (0: once). On failure the
        client is as it was (and raises what connecting raised). The old connection lives on
        while its futures and arrays are held: a daemon that is gone has failed those futures
        (``Disconnected``), and arrays made before are no longer in this client's segment, so
        calls copy them. :class:`gpuq.ClientClosed` after :meth:`close`."""
        if not isinstance(wait, (int, float)) or not wait >= 0:
            raise _errors.InvalidArgument(f"wait: must be a number of seconds >= 0, not {wait!r}")
        deadline = time.monotonic() + wait
        while True:
            if self._closed:
                raise _errors.ClientClosed("this gpuq client is closed")
            try:
                conn = self._connect()
                break
            except _errors.Disconnected:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.05)
        with self._lock:
            old, self._conn = self._conn, conn
            same_process = self._generation == _fork_generation
            self._generation = _fork_generation
            self._py_pools = None  # the new daemon's Python pools may differ
        if old is not None and same_process:
            old.native.close()

    def __reduce__(self) -> Any:
        return (
            Client,
            (
                self._runtime_dir or None,
                self._segment_bytes,
                self._name or None,
                self._spin_ns / 1000,
                self._keep_running_jobs,
            ),
        )

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the client: later calls raise :class:`gpuq.ClientClosed`. Jobs in flight run
        on, and arrays in its segment stay valid; the connection ends when the last of them is
        gone."""
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None and self._generation == _fork_generation:
            conn.native.close()

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called."""
        return self._closed

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        conn = self._conn
        state = "closed" if self._closed else f"epoch {conn.native.epoch}" if conn else ""
        return f"<gpuq.Client {self._runtime_dir or '(default)'} {state}>"

    # ---- facts ---------------------------------------------------------------------------------

    @property
    def pools(self) -> List[Dict[str, Any]]:
        """The daemon's pools: name, kind, capacity, client_share, available, unavailable_reason
        and runs_on (gpuq::PoolInfo)."""
        keys = (
            "name",
            "kind",
            "capacity",
            "client_share",
            "available",
            "unavailable_reason",
            "runs_on",
        )
        return [dict(zip(keys, p)) for p in self._c().native.pools()]

    @property
    def ops(self) -> List[str]:
        """The names of the ops the daemon serves."""
        return list(self._c().native.ops())

    @property
    def segment_bytes(self) -> int:
        """The size of this client's payload area, where its arrays live (what ``segment_bytes``
        asks for at connect; the daemon's default when 0)."""
        return int(self._c().native.arena_bytes)

    @property
    def slot_count(self) -> int:
        """How many jobs this client may have unfinished at once."""
        return int(self._c().native.slot_count)

    def status(self) -> Dict[str, Any]:
        """The daemon's status document (``gpuqctl status --json``) as a dict."""
        if self._closed:
            raise _errors.ClientClosed("this gpuq client is closed")
        return json.loads(_native.status_json(self._runtime_dir))

    # ---- arrays in the segment -----------------------------------------------------------------

    def empty(self, shape: Shape, dtype: Any = np.float32) -> np.ndarray:
        """A new uninitialised array in this client's shared-memory segment: jobs read and
        write it in place, with no copy. Its memory returns to the segment when the last array
        (or view) of it and the last job using it are gone. Raises :class:`gpuq.OutOfMemory`
        when the segment is full and no pending call of this client could make room (one
        that has ended gives its room back; one still running is waited for)."""
        shape_t = _shape_tuple(shape)
        if any(d < 0 for d in shape_t):
            raise _errors.InvalidArgument(f"shape: dimensions must be >= 0, not {shape_t}")
        dt = np.dtype(dtype)
        if dt.hasobject:
            raise _errors.InvalidArgument(
                f"dtype: {dt} holds Python objects; gpuq arrays hold plain numbers"
            )
        nbytes = int(np.prod(shape_t, dtype=np.int64)) * dt.itemsize
        raw = _room.allocate(self._c(), max(nbytes, 1), None)
        return raw[:nbytes].view(dt).reshape(shape_t)

    def zeros(self, shape: Shape, dtype: Any = np.float32) -> np.ndarray:
        """Like :meth:`empty`, filled with zeros."""
        a = self.empty(shape, dtype)
        a.fill(0)
        return a

    def empty_like(self, a: np.ndarray) -> np.ndarray:
        """:meth:`empty` of ``a``'s shape and dtype."""
        return self.empty(a.shape, a.dtype)

    def array(self, obj: ArrayLike, dtype: Any = None) -> np.ndarray:
        """A copy of ``obj`` (anything ``numpy.asarray`` takes) in this client's segment."""
        src = np.asarray(obj, dtype=dtype)
        a = self.empty(src.shape, src.dtype)
        np.copyto(a, src, casting="no")
        return a

    def in_segment(self, a: np.ndarray) -> bool:
        """Whether the array's memory lies in this client's segment (no copy when submitted)."""
        conn = self._c()
        return self._offset(conn, a) is not None

    @staticmethod
    def _offset(conn: _Connection, a: np.ndarray) -> Optional[int]:
        addr = a.__array_interface__["data"][0]
        if conn.base <= addr and addr + a.nbytes <= conn.end:
            return addr - conn.base
        return None

    def _operand(
        self, conn: _Connection, a: Any, what: str, keep: list, dtype: Optional[np.dtype] = None
    ) -> Tuple[int, np.ndarray]:
        """(offset, array in the segment) for a job's input, copying it in if needed."""
        if not isinstance(a, np.ndarray):
            if isinstance(a, (bytes, bytearray, memoryview)):
                a = np.frombuffer(a, dtype=np.uint8)
            else:
                a = np.asarray(a, dtype=dtype)
        if dtype is not None and a.dtype != dtype:
            raise _errors.InvalidArgument(
                f"{what}: dtype is {a.dtype}, must be {dtype} (the dtype of the op's first operand)"
            )
        if not a.flags.c_contiguous:
            raise _errors.InvalidArgument(
                f"{what}: the array is not C-contiguous (strides {a.strides}); pass "
                "numpy.ascontiguousarray(...) of it"
            )
        off = self._offset(conn, a)
        if off is None:
            copy = self.empty(a.shape, a.dtype)
            np.copyto(copy, a, casting="no")
            a = copy
            off = self._offset(conn, a)
            assert off is not None
        keep.append(a)
        return off, a

    def _out(self, conn: _Connection, out: np.ndarray, what: str = "out") -> int:
        if not isinstance(out, np.ndarray):
            raise _errors.InvalidArgument(
                f"{what}: must be a numpy array, not {type(out).__name__}"
            )
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise _errors.InvalidArgument(f"{what}: must be a writeable C-contiguous array")
        off = self._offset(conn, out)
        if off is None:
            raise _errors.InvalidArgument(
                f"{what}: the array is not in this client's segment (workers write outputs in "
                "place); make it with client.empty(), zeros() or array()"
            )
        return off

    # ---- jobs ----------------------------------------------------------------------------------

    def submit(
        self,
        op: str,
        *inputs: ArrayLike,
        out: Optional[np.ndarray] = None,
        pool: Optional[str] = None,
        timeout: Optional[float] = None,
        expire_after: Optional[float] = None,
        retryable: bool = False,
        time_limit: Optional[float] = None,
        priority: Optional[str] = None,
        **params: Union[int, float, str],
    ) -> Future:
        """Submits op ``op`` and returns its :class:`gpuq.Future`.

        ``inputs``: at most one array or bytes-like object, the job's input bytes (an array
        outside this client's segment is copied in first). ``out``: the array the op writes,
        which must be in the segment (:meth:`empty`). ``pool``: the pool's name (default: the
        first). ``timeout``: seconds to wait for room in the pool's queue (None: as long as it
        takes; :class:`gpuq.Timeout` after). ``expire_after``: seconds after which a job still
        queued ends :class:`gpuq.Expired` without running. ``retryable``: run it again if its
        worker dies. ``time_limit``: seconds the job may run once a worker starts it (None or
        0: no limit of its own; the pool's ``job_time_limit_ms`` still applies); past it the
        daemon stops it and it fails with :class:`gpuq.TimedOut`. ``priority``: "high",
        "normal" (None) or "low": higher levels are taken first, and a lower level that waits
        still gets a tenth of the pool's starts. ``params``: the op's parameters (int, float
        or str).

        The future's result is ``out`` when given, else the op's scalar ``value``.
        """
        if (
            inputs
            or out is not None
            or params
            or timeout is not None
            or expire_after is not None
            or time_limit is not None
            or priority is not None
        ):
            options = _options.job_options(
                pool, timeout, expire_after, retryable, time_limit, priority=priority
            )
            return self._submit(op, inputs, out, params, options)
        # No buffers, no params: the short path (a no-op's round trip is a few microseconds).
        conn = self._conn
        if conn is None or self._generation != _fork_generation:
            conn = self._c()
        if pool is None and not retryable:
            options = _options.DEFAULT
        else:
            options = _options.job_options(pool, retryable=retryable)
        return Future(conn.native.submit_plain(op, options), None, None, conn.watcher)

    def try_submit(
        self,
        op: str,
        *inputs: ArrayLike,
        out: Optional[np.ndarray] = None,
        pool: Optional[str] = None,
        expire_after: Optional[float] = None,
        retryable: bool = False,
        time_limit: Optional[float] = None,
        priority: Optional[str] = None,
        **params: Union[int, float, str],
    ) -> Future:
        """Like :meth:`submit`, but raises :class:`gpuq.QueueFull` at once when the queue has
        no room, instead of waiting."""
        options = _options.job_options(
            pool, None, expire_after, retryable, time_limit, try_only=True, priority=priority
        )
        return self._submit(op, inputs, out, params, options)

    def _submit(
        self,
        op: str,
        inputs: Tuple[Any, ...],
        out: Optional[np.ndarray],
        params: Dict[str, Any],
        options: _options.JobOptions,
    ) -> Future:
        conn = self._c()
        keep: list = []
        in_off = in_len = out_off = out_len = 0
        if inputs:
            if len(inputs) > 1:
                raise _errors.InvalidArgument(
                    f"submit: op {op!r} takes one input (the job's input bytes), not "
                    f"{len(inputs)}; the tensor helpers (conv2d, gemm...) take several"
                )
            in_off, a = self._operand(conn, inputs[0], "input", keep)
            in_len = a.nbytes
        if out is not None:
            out_off = self._out(conn, out)
            out_len = out.nbytes
            keep.append(out)
            convert = lambda info, out=out: out  # noqa: E731
        else:
            convert = None  # the op's value
        job = conn.native.submit(
            op, in_off, in_len, out_off, out_len, list(params.items()) if params else [], options
        )
        return Future(job, keep or None, convert, conn.watcher)

    def run(
        self, op: str, *inputs: ArrayLike, timeout: Optional[float] = None, **kwargs: Any
    ) -> Any:
        """``submit(...)`` and wait for its result; ``timeout``: seconds for the whole call
        (waiting for room in the queue, then for the result)."""
        if timeout is None:
            return self.submit(op, *inputs, **kwargs).result()
        deadline = time.monotonic() + _seconds_to_ns(timeout, "timeout") / 1e9
        f = self.submit(op, *inputs, timeout=timeout, **kwargs)
        return f.result(max(0.0, deadline - time.monotonic()))

    # ---- Python ops ----------------------------------------------------------------------------

    def submit_call(
        self,
        op: str,
        *args: Any,
        pool: Optional[str] = None,
        output_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
        expire_after: Optional[float] = None,
        retryable: bool = False,
        time_limit: Optional[float] = None,
        priority: Optional[str] = None,
        params: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> Future:
        """Submits a job of the Python op ``op`` (a ``@gpuq.op`` function of a Python pool)
        and returns its :class:`gpuq.Future`; :meth:`call` waits for it.

        ``args`` and ``kwargs`` are the function's arguments: numpy arrays (passed in place
        when they are in this client's segment, else copied in once; the op sees read-only
        views) and JSON values (numbers, strings, lists, dicts). ``params``: keyword arguments
        whose names clash with this method's own. ``pool``: default, the first Python pool
        that has the op. ``output_bytes``: room for the result (default: the arrays' bytes
        plus 64 KiB); a larger result fails :class:`gpuq.InvalidArgument` naming the size
        needed. The other options are :meth:`submit`'s.

        The future's result is what the function returned: an array, a tuple, a numpy scalar,
        a str or dict, or None; the arrays of an answer larger than 64 KiB are views of this
        client's segment. An exception in the
        function fails the job with :class:`gpuq.OpFailed`, whose ``remote_type`` and
        ``remote_traceback`` (and ``__cause__``) give the worker's exception."""
        kwargs = _with_params(kwargs, params)

        def submit(name: str) -> Future:
            options = _options.job_options(
                name, timeout, expire_after, retryable, time_limit, priority=priority
            )
            return _calls.submit_python(self, op, args, kwargs, options, output_bytes)

        return _pools.submit_to(self, op, pool, submit)

    def call(self, op: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """:meth:`submit_call` and wait for its result; ``timeout``: seconds for the whole
        call."""
        if timeout is None:
            return self.submit_call(op, *args, **kwargs).result()
        deadline = time.monotonic() + _seconds_to_ns(timeout, "timeout") / 1e9
        f = self.submit_call(op, *args, timeout=timeout, **kwargs)
        return f.result(max(0.0, deadline - time.monotonic()))

    def stream(
        self,
        op: str,
        *args: Any,
        pool: Optional[str] = None,
        window: int = _stream.DEFAULT_WINDOW,
        part_bytes: int = _stream.DEFAULT_PART_BYTES,
        timeout: Optional[float] = None,
        expire_after: Optional[float] = None,
        time_limit: Optional[float] = None,
        priority: Optional[str] = None,
        params: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> _stream.Stream:
        """Submits a job of the streaming Python op ``op`` (a ``@gpuq.op`` generator function)
        and returns its :class:`gpuq.Stream`: each value the generator yields, as soon as it
        is yielded (``for part in client.stream("generate", prompt)``; ``async for`` too).

        ``window``: parts that may wait unread, 1 to 8 (default 4): a generator ahead of its
        reader by that many waits at its ``yield``. ``part_bytes``: room for each part's answer
        (default 64 KiB); a larger part fails the stream with :class:`gpuq.InvalidArgument`
        naming the size needed. ``time_limit`` covers the whole stream. The other arguments
        are :meth:`submit_call`'s. A function that is not a generator streams one part, its
        result. The stream's end, and its error after the parts made, come as the iteration's
        end and its exception (docs/python.md, "Streaming")."""
        kwargs = _with_params(kwargs, params)
        if type(window) is not int or not 1 <= window <= _stream.MAX_WINDOW:
            raise _errors.InvalidArgument(
                f"window: must be an int from 1 to {_stream.MAX_WINDOW} (the parts that may "
                f"wait unread), not {window!r}"
            )
        if type(part_bytes) is not int or part_bytes < 64:
            raise _errors.InvalidArgument(
                f"part_bytes: must be an int of at least 64, not {part_bytes!r}"
            )
        cell = -(-part_bytes // 64) * 64

        def submit(name: str) -> _stream.Stream:
            options = _options.job_options(
                name, timeout, expire_after, False, time_limit, priority=priority
            )
            options = _options.replace(options, stream_window=window)
            job, out, kept = _calls.submit_stream(self, op, args, kwargs, options, window * cell)
            return _stream.Stream(job, out, kept, op, window)

        return _pools.submit_to(self, op, pool, submit)

    # ---- Python ops from an event loop: never blocking ----------------------------------------

    def asubmit_call(
        self,
        op: str,
        *args: Any,
        pool: Optional[str] = None,
        output_bytes: Optional[int] = None,
        timeout: Optional[float] = None,
        expire_after: Optional[float] = None,
        retryable: bool = False,
        time_limit: Optional[float] = None,
        priority: Optional[str] = None,
        params: Optional[Dict[str, Any]] = None,
        **kwargs: Any,
    ) -> Future:
        """:meth:`submit_call` that never waits for room in the caller's thread: it returns at
        once, and the :class:`gpuq.Future` (awaitable) is submitted when there is room. For
        event loops (asyncio, uvicorn, FastAPI), where a submit that waits for room stops every
        other request of the loop; :meth:`acall` awaits it.

        The same arguments as :meth:`submit_call`. When the pool's ring (or this client's share
        of it, its job slots, or its segment) is full, the call waits in this client, in order
        with the others for that pool, and one thread per waiting pool sends them as room
        appears (woken by this client's jobs ending, else trying every 2 ms). ``timeout``:
        seconds the call may wait for room; past it the future fails with
        :class:`gpuq.Timeout` and nothing was sent. ``expire_after`` counts from this call,
        waiting included (:class:`gpuq.Expired` if it passes before the call is sent).
        Cancelling the future (``cancel()``, or cancelling the task that awaits it) while the
        call waits takes it out: nothing is sent. The arguments are read when the call is sent:
        do not change them until the future has started (awaiting it is enough).

        Malformed arguments, an unknown op or pool, a pool that is down and a daemon that
        drains raise from this call, as from :meth:`submit_call`. Without ``pool``, the pool is
        found from the daemon's status as for :meth:`submit_call` (a socket round trip every
        5 s); :meth:`acall` does that off the event loop."""
        kwargs = _with_params(kwargs, params)

        def submit(name: str) -> Future:
            options = _options.job_options(
                name, timeout, expire_after, retryable, time_limit, priority=priority
            )
            return _call_backlog.submit_nowait(self, op, args, kwargs, options, output_bytes)

        return _pools.submit_to(self, op, pool, submit)

    async def _refresh_python_pools(self, loop: asyncio.AbstractEventLoop, op: str) -> str:
        """The daemon's Python pools read again off the event loop (a socket round trip): the
        first that has ``op``."""
        self._refreshing_pools = True  # one refresh at a time; others use the cache
        try:
            await loop.run_in_executor(None, _pools.python_pools, self, True)
        finally:
            self._refreshing_pools = False
        pool, _ = _pools.cached_pool(self, op)
        if pool is None:
            raise _pools.no_pool(op)
        return pool

    async def acall(
        self, op: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any
    ) -> Any:
        """``await client.acall(op, *args, **kwargs)``: :meth:`call` for coroutines. Nothing
        it does blocks the event loop: the call is submitted with :meth:`asubmit_call` (it
        waits for room in this client, not in the loop), its end comes through the client's
        watcher thread, and what needs a socket round trip (connecting after a fork, finding
        the op's pool in the daemon's status every 5 s) runs in the loop's default executor.

        The keyword arguments are :meth:`submit_call`'s. ``timeout``: seconds for the whole
        call, as for :meth:`call`. Past it the call raises :class:`gpuq.Timeout` if it was
        still waiting for room (it was never sent), else ``asyncio.TimeoutError`` (a
        ``TimeoutError`` since Python 3.11) and the job is stopped (:meth:`Future.stop`), as
        when the awaiting task is cancelled: in asyncio nobody is left to read its result.
        For a web request, give ``expire_after`` too, so that a job still queued when its
        request has given up never runs."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        if self._conn is None or self._generation != _fork_generation:
            await loop.run_in_executor(None, self._c)  # connecting: a socket round trip
        named = kwargs.pop("pool", None)
        pool = named
        if pool is None:
            pool, fresh = _pools.cached_pool(self, op)
            if pool is None or (not fresh and not self._refreshing_pools):
                pool = await self._refresh_python_pools(loop, op)
        if timeout is not None:
            _seconds_to_ns(timeout, "timeout")
            kwargs["timeout"] = left = max(0.0, timeout - (loop.time() - start))
        try:
            f = self.asubmit_call(op, *args, pool=pool, **kwargs)
        except _errors.UnknownPool:
            if named is not None:
                raise
            # The op's pool was removed by a config reload since the cache was filled.
            pool = await self._refresh_python_pools(loop, op)
            f = self.asubmit_call(op, *args, pool=pool, **kwargs)
        if timeout is None:
            return await f
        try:
            return await asyncio.wait_for(f, left)
        except asyncio.TimeoutError:
            if f.cancelled() and f.info is None:  # taken out of the backlog: never sent
                raise _errors.Timeout(
                    f"pool {pool!r} had no room for the call within {timeout} "
                    "s (timeout); it was not sent"
                ) from None
            raise

    _refreshing_pools = False

    # ---- tensor ops ----------------------------------------------------------------------------
    #
    # Each takes the job options of :meth:`submit` as keywords (``pool``, ``timeout``,
    # ``expire_after``, ``retryable``, ``time_limit``, ``priority``) and ``try_only`` (QueueFull at once when
    # the queue has no room): gpuq._options.Options.

    def conv2d(
        self,
        x: ArrayLike,
        w: ArrayLike,
        b: Optional[ArrayLike] = None,
        *,
        stride: Pair = 1,
        padding: Pair = 0,
        dilation: Pair = 1,
        groups: int = 1,
        relu: bool = False,
        out: Optional[np.ndarray] = None,
        **options: Unpack[_options.Options],
    ) -> Future:
        """2-D convolution (NCHW): x N x C x H x W, w K x C/groups x R x S, b K. The future's
        result is y, N x K x OH x OW, a new array in the segment (or ``out``). docs/ops.md."""
        opts = {
            "stride": stride,
            "padding": padding,
            "dilation": dilation,
            "groups": groups,
            "relu": relu,
        }
        return _tensors.submit_tensor(
            self,
            "conv2d",
            (("x", x), ("w", w), ("b", b)),
            lambda s: _native.conv2d_shape(s[0], s[1], opts),
            opts,
            out,
            _options.job_options(**options),
        )

    def gemm(
        self,
        a: ArrayLike,
        b: ArrayLike,
        c: Optional[ArrayLike] = None,
        *,
        trans_a: bool = False,
        trans_b: bool = False,
        alpha: float = 1.0,
        beta: float = 0.0,
        out: Optional[np.ndarray] = None,
        **options: Unpack[_options.Options],
    ) -> Future:
        """y = alpha op(a) op(b) + beta c (row-major; c only when beta != 0). Result: y, M x N."""
        opts = {"trans_a": trans_a, "trans_b": trans_b, "alpha": float(alpha), "beta": float(beta)}
        return _tensors.submit_tensor(
            self,
            "gemm",
            (("a", a), ("b", b), ("c", c)),
            lambda s: _native.gemm_shape(s[0], s[1], opts),
            opts,
            out,
            _options.job_options(**options),
        )

    def activation(
        self,
        x: ArrayLike,
        mode: str = "relu",
        *,
        out: Optional[np.ndarray] = None,
        **options: Unpack[_options.Options],
    ) -> Future:
        """Elementwise ``mode``: "relu", "sigmoid" or "tanh". Result: y, x's shape."""
        return _tensors.submit_tensor(
            self,
            "activation",
            (("x", x),),
            lambda s: s[0],
            {"mode": mode},
            out,
            _options.job_options(**options),
        )

    def softmax(
        self,
        x: ArrayLike,
        *,
        log: bool = False,
        out: Optional[np.ndarray] = None,
        **options: Unpack[_options.Options],
    ) -> Future:
        """Softmax (or log-softmax) over dimension 1 of a 2-D to 4-D x. Result: x's shape."""
        return _tensors.submit_tensor(
            self,
            "softmax",
            (("x", x),),
            lambda s: s[0],
            {"log": log},
            out,
            _options.job_options(**options),
        )

    def pool2d(
        self,
        x: ArrayLike,
        window: Pair,
        *,
        mode: str = "max",
        stride: Optional[Pair] = None,
        padding: Pair = 0,
        count_pad: bool = False,
        out: Optional[np.ndarray] = None,
        **options: Unpack[_options.Options],
    ) -> Future:
        """Max or average pooling (NCHW); ``stride`` defaults to the window. Result: y."""
        opts = {
            "mode": mode,
            "window": window,
            "stride": stride,
            "padding": padding,
            "count_pad": count_pad,
        }
        return _tensors.submit_tensor(
            self,
            "pool2d",
            (("x", x),),
            lambda s: _native.pool2d_shape(s[0], opts),
            opts,
            out,
            _options.job_options(**options),
        )

    def batchnorm(
        self,
        x: ArrayLike,
        scale: ArrayLike,
        bias: ArrayLike,
        mean: ArrayLike,
        var: ArrayLike,
        *,
        eps: float = 1e-5,
        relu: bool = False,
        out: Optional[np.ndarray] = None,
        **options: Unpack[_options.Options],
    ) -> Future:
        """Inference batch norm per channel: scale (x - mean) / sqrt(var + eps) + bias."""
        opts = {"eps": float(eps), "relu": relu}
        return _tensors.submit_tensor(
            self,
            "batchnorm",
            (("x", x), ("scale", scale), ("bias", bias), ("mean", mean), ("var", var)),
            lambda s: s[0],
            opts,
            out,
            _options.job_options(**options),
        )


def status(runtime_dir: Optional[str] = None) -> Dict[str, Any]:
    """The daemon's status document as a dict, without connecting a client."""
    return json.loads(_native.status_json(runtime_dir or ""))


def restart_pool(
    pool: str, runtime_dir: Optional[str] = None, timeout: Optional[float] = None
) -> int:
    """A rolling restart of pool ``pool`` (``gpuqctl restart``; docs/service.md): its workers
    are replaced one by one by new processes (a Python pool's modules imported anew, its
    ``on_start`` run), each made ready before the one it replaces stops taking jobs; no queued
    job is failed or reordered, and no client is disconnected. Returns the pool's new
    generation once every worker runs it. ``timeout``: seconds to wait for that (None: no
    limit; the rollout goes on after :class:`gpuq.Timeout`). Raises :class:`gpuq.WorkerDied`
    when a new worker did not start (its error in the message; the old workers serve on),
    :class:`gpuq.UnknownPool`, :class:`gpuq.InvalidArgument` when the pool has no seat for a
    new worker (give it ``spare_workers`` or ``rollout_surge_workers``)."""
    return int(_native.restart_pool(runtime_dir or "", pool, _wait_seconds(timeout)))


def reload_config(runtime_dir: Optional[str] = None, timeout: Optional[float] = None) -> List[str]:
    """The daemon reads its config file again and applies what changed (``gpuqctl reload``,
    SIGHUP; docs/service.md, "Config reload"): daemon keys that may change live at once, a
    Python pool whose modules, path or environment changed rolled (as :func:`restart_pool`),
    a removed pool drained (its jobs finish; new ones raise :class:`gpuq.UnknownPool`). No
    client is disconnected. Returns one line per change once it is applied and its rollouts
    have ended. ``timeout``: seconds to wait (None: no limit). Raises
    :class:`gpuq.InvalidArgument` naming the keys that cannot change while gpuqd runs, or the
    file's error (nothing changed), :class:`gpuq.WorkerDied` when a rollout it started failed
    (that pool's settings are back as they were)."""
    return list(_native.reload(runtime_dir or "", _wait_seconds(timeout)))


def _wait_seconds(timeout: Optional[float]) -> int:
    """A control call's wait in whole seconds (0: no limit)."""
    if timeout is None:
        return 0
    ns = _options.seconds_to_ns(timeout, "timeout")
    return max(1, -(-ns // 1_000_000_000)) if ns >= 0 else 0


def metrics(runtime_dir: Optional[str] = None) -> str:
    """The daemon's metrics in the Prometheus text format (``gpuqctl metrics``;
    docs/metrics.md), without connecting a client."""
    return str(_native.metrics_text(runtime_dir or ""))


def default_runtime_dir() -> str:
    """The runtime directory a client without ``runtime_dir`` connects to."""
    return str(_native.default_runtime_dir())


__all__ = ["Client", "status", "default_runtime_dir"]
