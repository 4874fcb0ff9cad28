"""
gpuq's native binding of libgpuq; use the gpuq package, not this module.
"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray

def register_python_ops(pool: int, ops: Sequence[tuple[int, str, int, int, bool]]) -> None:
    """
    Adds this worker's Python ops to the registry, with gpuqd's ids and their batching (max_batch_size, max_queue_delay_us, step: a step op's).
    """

def run_worker(argv: Sequence[str], handler: object) -> int:
    """
    Runs gpuq's worker loop with `handler` for the Python ops (GIL released); the exit status.
    """

def job_streams() -> bool:
    """
    Whether the running job is a stream (its caller reads parts as they are made).
    """

def part_cell() -> tuple[object, int, str]:
    """
    The running stream's next part cell, a writable memoryview (waits while every cell holds an unread part): (view, 0, '') or (None, code, why) when the job was asked to stop, or its caller read nothing for stream_reader_timeout_ms.
    """

def part_publish(bytes: int) -> None:
    """Publishes the part just written into the cell part_cell() gave."""

def job_cancelled() -> bool:
    """
    Whether the running job was asked to stop (its client cancelled it, its time limit); in a batched call, whether a job's time limit passed or every job was cancelled.
    """

CALL_FLAG_PICKLED_ARGS: int = 1

CALL_FLAG_EXECUTOR_CONTEXT: int = 2

CALL_FLAG_FETCH_SPILLED: int = 4

CALL_FLAG_FUNCTION_REUSED: int = 8

def decode_call(input: object, h: int, n: int, buffers_as_views: bool) -> tuple:
    """
    (flags, args, kwargs) of the call header at [h, h + n) of input (arrays: views of it).
    """

def write_answer(out: object, kind: str, arrays: object, extra: str) -> int:
    """Writes an answer into out: the bytes used, or minus the bytes needed."""

def write_result(out: object, result: object | None) -> int | None:
    """
    write_answer for None, arrays, numpy scalars, bool/int/float and tuples of them; None for any other result.
    """

def read_answer(out: object, nbytes: int) -> tuple:
    """(kind, arrays as views of out, extra JSON text) of an answer."""

def answer_value(out: object, nbytes: int) -> object:
    """A named op's result from its answer."""

def encode_call(args: object, kwargs: object | None, flags: int, output_bytes: int) -> tuple:
    """
    Tests: (block, span offset, span length, h, n, output offset, rows) of a call laid out in a bytearray.
    """

ERROR_CODES: dict = ...

MAX_ERROR_CODE: int = 23

JOB_STATUS: dict = ...

PRIORITIES: dict = {"high": 1, "normal": 0, "low": 2}

CALL_OP: str = "python_call"

MAX_BATCH_SIZE: int = 65536

MAX_QUEUE_DELAY_US: int = 1000000

MAX_STREAM_WINDOW: int = 8

def stream_cell_bytes(output_bytes: int, window: int) -> int:
    """The size of each part cell of a stream's output buffer (0: too small)."""

PARAM_HEADER: str = "py.h"

PARAM_HEADER_BYTES: str = "py.n"

PARAM_ROWS: str = "py.r"

def set_error_factory(factory: object) -> None:
    """Registers (code, message) -> exception used for every gpuq error."""

class JobOptions:
    """A job's options, checked (gpuq._options.job_options makes them)."""

    def __init__(
        self,
        pool: str = "",
        timeout_ns: int = -1,
        expire_ns: int = -1,
        retryable: bool = False,
        time_limit_ms: int = 0,
        try_only: bool = False,
        priority: int = 0,
    ) -> None: ...
    @property
    def pool(self) -> str: ...
    @pool.setter
    def pool(self, arg: str, /) -> None: ...
    @property
    def timeout_ns(self) -> int: ...
    @timeout_ns.setter
    def timeout_ns(self, arg: int, /) -> None: ...
    @property
    def expire_ns(self) -> int: ...
    @expire_ns.setter
    def expire_ns(self, arg: int, /) -> None: ...
    @property
    def retryable(self) -> bool: ...
    @retryable.setter
    def retryable(self, arg: bool, /) -> None: ...
    @property
    def time_limit_ms(self) -> int: ...
    @time_limit_ms.setter
    def time_limit_ms(self, arg: int, /) -> None: ...
    @property
    def try_only(self) -> bool: ...
    @try_only.setter
    def try_only(self, arg: bool, /) -> None: ...
    @property
    def priority(self) -> int: ...
    @priority.setter
    def priority(self, arg: int, /) -> None: ...
    @property
    def stream_window(self) -> int: ...
    @stream_window.setter
    def stream_window(self, arg: int, /) -> None: ...
    def __copy__(self) -> JobOptions: ...
    def __repr__(self) -> str: ...

class Block:
    """An allocation in a client's payload segment (array base)."""

class Job:
    """A submitted job (gpuq::Job)."""

    def wait(self, timeout_ns: int) -> tuple[int, int, str, int, int, int, int, int] | None:
        """Waits for the result (GIL released); None if timeout_ns passed first."""

    def poll(self) -> int:
        """The job's status as an int (gpuq::JobStatus), lock-free."""

    def next_part(self, timeout_ns: int) -> tuple[int, int, int] | None:
        """
        A stream's next part: (index, address, size), (-1, 0, 0) at its end, None after timeout_ns (negative: no limit); its error raised after its last part.
        """

    def cancel(self) -> None:
        """Cancels the job (gpuq::Job::cancel)."""

    def cancel_queued(self) -> bool:
        """
        Cancels the job if it is still queued: whether it did (gpuq::Job::cancel_queued).
        """

    def wake_waiters(self) -> None:
        """
        Wakes every wait_any() on this job's connection (gpuq::Job::wake_waiters).
        """

    @staticmethod
    def wait_any(jobs: list, timeout_ns: int, interruptible: bool) -> list[int]:
        """
        Positions of the jobs that have ended (gpuq::Job::wait_any, GIL released).
        """

class Connection:
    """One connection to the daemon (gpuq::Client)."""

    @staticmethod
    def connect(
        runtime_dir: str, segment_bytes: int, name: str, spin_ns: int, keep_running_jobs: bool
    ) -> Connection:
        """Connects (GIL released)."""

    def allocate(self, size: int) -> Annotated[NDArray[numpy.uint8], dict(shape=(None,))]:
        """A uint8 array over new bytes of the segment."""

    def submit(
        self,
        op: str,
        in_off: int,
        in_len: int,
        out_off: int,
        out_len: int,
        params: list,
        options: JobOptions,
    ) -> Job:
        """Submits a job (the GIL is released while it waits for room)."""

    def submit_plain(self, op: str, options: JobOptions) -> Job:
        """submit() without buffers or params."""

    def submit_call(
        self,
        op: str,
        args: object,
        kwargs: object | None,
        output_bytes: int,
        flags: int,
        callable_job: bool,
        options: JobOptions,
        block: object | None,
    ) -> tuple:
        """
        Submits a Python op's job, its arguments laid out by the codec: (job, answer room, arrays passed in place or None).
        """

    def call_block_bytes(
        self, args: object, kwargs: object | None, output_bytes: int, flags: int, callable_job: bool
    ) -> int:
        """The block submit_call needs."""

    def tensor(
        self,
        op: str,
        operands: Sequence[tuple[int, Sequence[int]] | None],
        y: tuple[int, Sequence[int]],
        dtype: str,
        opts: dict,
        options: JobOptions,
    ) -> Job:
        """Submits a tensor op (the GIL is released while it waits for room)."""

    def pools(self) -> list[tuple[str, str, int, int, bool, str, str]]:
        """
        (name, kind, capacity, client_share, available, reason, runs_on) per pool.
        """

    def ops(self) -> list[str]:
        """The op names the daemon serves."""

    @property
    def segment_bytes(self) -> int: ...
    @property
    def slot_count(self) -> int: ...
    @property
    def epoch(self) -> int: ...
    @property
    def arena_address(self) -> int: ...
    @property
    def arena_bytes(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None:
        """Drops this handle's reference to the connection."""

def status_json(runtime_dir: str) -> str:
    """The daemon's status document (JSON text)."""

def metrics_text(runtime_dir: str) -> str:
    """The daemon's metrics in the Prometheus text format."""

def stop(runtime_dir: str) -> None:
    """Asks the daemon to drain and exit."""

def restart_pool(runtime_dir: str, pool: str, timeout_s: int) -> int:
    """
    A rolling restart of the pool; its new generation once every worker runs it.
    """

def reload(runtime_dir: str, timeout_s: int) -> list[str]:
    """
    Reads the daemon's config file again and applies it; one line per change.
    """

def cpp_noop_round_trips(connection: Connection, n: int) -> list[int]:
    """Benchmark helper: n timed C++ no-op round trips."""

def default_runtime_dir() -> str: ...
def daemon_runtime_dir(explicit_dir: str = "") -> str: ...
def version() -> str: ...
def conv2d_shape(x: Sequence[int], w: Sequence[int], opts: dict) -> list[int]: ...
def pool2d_shape(x: Sequence[int], opts: dict) -> list[int]: ...
def gemm_shape(a: Sequence[int], b: Sequence[int], opts: dict) -> list[int]: ...
