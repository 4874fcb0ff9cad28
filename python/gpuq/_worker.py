"""A Python pool's worker: ``main()`` with gpuqd's arguments (gpuqd runs the pool's interpreter with
``-c "...; from gpuq._worker import main; sys.exit(main())"``), never started by hand.

It imports the pool's modules (their ``@gpuq.op`` functions and ``@gpuq.on_start`` hooks),
checks that their ops are the ones gpuqd numbered when it started, and runs gpuq's own worker
runtime (the C++ job loop of every worker, in gpuq._native) with :class:`Runtime` for the Python
ops. On a GPU pool it sees its one GPU (``CUDA_VISIBLE_DEVICES``), makes a stream current in the
frameworks it finds loaded (torch, CuPy), applies the pool's ``memory_limit`` to their
allocators (TensorFlow's too: memory growth and a logical device of that size) and page-locks
the clients' segments.

``--list-ops``: imports the modules and prints their ops as JSON (gpuqd runs this once per
pool at start, with the GPU hidden).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import pickle
import signal
import sys
import traceback
from multiprocessing import process as _mp_process
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _answers, _batching, _errors, _native, _ops, _spill
from ._answers import ResultTooLarge

decode_call = _native.decode_call
write_result = _native.write_result
_PICKLED_ARGS = _native.CALL_FLAG_PICKLED_ARGS
_EXECUTOR_CONTEXT = _native.CALL_FLAG_EXECUTOR_CONTEXT
_FETCH_SPILLED = _native.CALL_FLAG_FETCH_SPILLED
_FUNCTION_REUSED = _native.CALL_FLAG_FUNCTION_REUSED
_NOT_A_CALL = "not a Python op job: its params lack py.h and py.n (submit it with gpuq.Client.call)"

_USAGE = (
    "usage: python -m gpuq._worker [--module M]... [--path DIR]... "
    "(--list-ops --pool-id N | --ops JSON [--allow-callables] [--gpu] WORKER-ARGS...)\n"
    "gpuq._worker is started by gpuqd for a Python pool; it is not meant to be run by hand."
)


def _import_modules(paths: List[str], modules: List[str]) -> None:
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    for m in modules:
        importlib.import_module(m)


def _frameworks() -> Tuple[Any, Any]:
    """torch and cupy, when the pool's modules loaded them (never imported here)."""
    return sys.modules.get("torch"), sys.modules.get("cupy")


_FRAMEWORKS = ("torch", "cupy", "tensorflow")  # what _configure_frameworks sets up


def _log(message: str) -> None:
    """A line in gpuqd's log (a worker's stderr goes there)."""
    print(f"gpuq python worker: {message}", file=sys.stderr, flush=True)


def _nvml_total_memory() -> Tuple[Optional[int], str]:
    """(the total memory of this worker's GPU in bytes, or None and why), from NVML through
    ctypes when libnvidia-ml is there: the GPU named by ``CUDA_VISIBLE_DEVICES`` (gpuqd sets
    its UUID, or its index in PCI bus order, which is NVML's). No CUDA context is made."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not visible or visible == "-1":
        return None, "CUDA_VISIBLE_DEVICES names no GPU"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return None, f"no NVML ({e})"

    class Memory(ctypes.Structure):  # nvmlMemory_t
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]

    try:
        rc = nvml.nvmlInit_v2()
        if rc != 0:
            return None, f"nvmlInit_v2 failed ({rc})"
        try:
            handle = ctypes.c_void_p()
            if visible.isdigit():
                rc = nvml.nvmlDeviceGetHandleByIndex_v2(
                    ctypes.c_uint(int(visible)), ctypes.byref(handle)
                )
            else:
                rc = nvml.nvmlDeviceGetHandleByUUID(visible.encode(), ctypes.byref(handle))
            if rc != 0:
                return None, f"NVML does not know GPU {visible} ({rc})"
            mem = Memory()
            rc = nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem))
            if rc != 0:
                return None, f"nvmlDeviceGetMemoryInfo failed ({rc})"
            return int(mem.total), ""
        finally:
            nvml.nvmlShutdown()
    except AttributeError as e:  # an NVML without one of these functions
        return None, f"NVML lacks {e}"


# The frameworks' out-of-memory exceptions, as (module, attribute) looked up in sys.modules: a
# framework that is not loaded raised none of them, and is never imported here to find out.
_OOM_CLASSES = (
    ("torch", "OutOfMemoryError"),  # newer torch; torch.cuda.OutOfMemoryError names it too
    ("torch.cuda", "OutOfMemoryError"),
    ("cupy.cuda.memory", "OutOfMemoryError"),
    # tf.errors.ResourceExhaustedError: the class tf.errors names, in the module that defines it
    ("tensorflow.python.framework.errors_impl", "ResourceExhaustedError"),
)
# What torch before 1.13 (and code that wraps its message) raised: a plain RuntimeError.
_OOM_MESSAGE = "CUDA out of memory"


def out_of_memory(e: BaseException) -> bool:
    """Whether an op's exception says that memory ran out: a ``MemoryError`` (numpy's
    allocation failures are one), torch's ``OutOfMemoryError`` or a ``RuntimeError`` whose
    message starts "CUDA out of memory", CuPy's ``cupy.cuda.memory.OutOfMemoryError``,
    TensorFlow's ``tf.errors.ResourceExhaustedError``. Such a job ends ``OutOfMemory``."""
    if isinstance(e, MemoryError):
        return True
    for module, attr in _OOM_CLASSES:
        cls = getattr(sys.modules.get(module), attr, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return True
    return isinstance(e, RuntimeError) and str(e).startswith(_OOM_MESSAGE)


class Runtime:
    """What the C++ worker loop calls (python/src/worker.cpp: PythonBackend)."""

    def __init__(self, ops: Dict[str, Any], allow_callables: bool, gpu: bool) -> None:
        self.ops = ops
        self.allow_callables = allow_callables
        self.gpu = gpu
        self.poisoned = False
        self.memory_limit: Tuple[int, float] = (0, 0.0)
        self.configured: set = set()
        self.registered: Dict[int, int] = {}  # client -> base address page-locked
        self.functions: Dict[bytes, Any] = {}  # a callable's pickle -> the callable
        self.contexts: Dict[bytes, _ExecutorContext] = {}  # by the context's pickle

    # -- start-up ------------------------------------------------------------------------------

    def start(self, pool_id: int, limit_bytes: int, limit_fraction: float) -> None:
        ctx = _ops.context()
        ctx.pool_id = pool_id
        ctx.worker_id = int(os.environ.get("GPUQ_WORKER_ID", "-1"))
        ctx.gpu = self.gpu
        self.memory_limit = (limit_bytes, limit_fraction)
        if self.gpu:
            ctx.device = 0
            self._configure_frameworks()
        for fn in list(_ops.on_start_functions):
            fn()
        if self.gpu:
            self._configure_frameworks()  # those on_start loaded
        # Everything imported and loaded so far (a framework's modules, a model: millions of
        # objects with torch) lives as long as the worker: out of the cyclic collector's reach,
        # so that the collections each job's garbage triggers do not walk it. With torch loaded,
        # a quarter of a busy worker's CPU went to them before (bench_batching.py).
        gc.collect()
        gc.freeze()

    def _configure_frameworks(self) -> None:
        ctx = _ops.context()
        torch, cupy = _frameworks()
        tf = sys.modules.get("tensorflow")
        limit_bytes, fraction = self.memory_limit
        if torch is not None and "torch" not in self.configured:
            self.configured.add("torch")
            torch.cuda.set_device(0)
            ctx.torch_device = torch.device("cuda", 0)
            stream = torch.cuda.Stream(device=0)
            torch.cuda.set_stream(stream)
            ctx.stream = stream
            total = torch.cuda.get_device_properties(0).total_memory
            frac = min(1.0, limit_bytes / total) if limit_bytes else fraction
            torch.cuda.set_per_process_memory_fraction(frac, 0)
        if cupy is not None and "cupy" not in self.configured:
            self.configured.add("cupy")
            cupy.cuda.Device(0).use()
            if torch is not None and ctx.stream is not None:
                s = cupy.cuda.ExternalStream(ctx.stream.cuda_stream)
            else:
                s = cupy.cuda.Stream(non_blocking=True)
            s.use()
            ctx.cupy_stream = s
            if ctx.stream is None:
                ctx.stream = s
            pool = cupy.get_default_memory_pool()
            if limit_bytes:
                pool.set_limit(size=limit_bytes)
            else:
                pool.set_limit(fraction=fraction)
        if tf is not None and "tensorflow" not in self.configured:
            self.configured.add("tensorflow")
            self._configure_tensorflow(tf)

    def _device_total_memory(self) -> Tuple[Optional[int], str]:
        """The worker's GPU's memory in bytes, from a framework that has its CUDA context
        already (torch, CuPy), else from NVML; (None, why) when none can tell."""
        torch, cupy = _frameworks()
        if "torch" in self.configured and torch is not None:
            return int(torch.cuda.get_device_properties(0).total_memory), ""
        if "cupy" in self.configured and cupy is not None:
            return int(cupy.cuda.Device(0).mem_info[1]), ""
        return _nvml_total_memory()

    def _configure_tensorflow(self, tf: Any) -> None:
        """TensorFlow's budget on a GPU pool: memory growth (it takes device memory as it needs
        it, not all of it at start) and one logical GPU of the pool's ``memory_limit`` in MiB.
        TensorFlow accepts both only before it has initialised its GPUs, so this runs right
        after the pool's modules are imported, before ``on_start``."""
        try:
            gpus = tf.config.list_physical_devices("GPU")
        except Exception as e:  # noqa: BLE001 - a broken install: said, not fatal
            _log(f"tensorflow: cannot list its GPUs ({type(e).__name__}: {e}); not configured")
            return
        if not gpus:
            _log(
                "tensorflow sees no GPU (a CPU-only build such as tensorflow-cpu, or one "
                "built without this CUDA): its ops run on the CPU, with no memory budget"
            )
            return
        gpu = gpus[0]  # the worker sees its one GPU
        limit_bytes, fraction = self.memory_limit
        total, why = self._device_total_memory()
        if limit_bytes:  # capped at the device's memory, as for torch
            limit_mib = (min(limit_bytes, total) if total else limit_bytes) >> 20
        else:
            limit_mib = int(total * fraction) >> 20 if total and fraction > 0 else 0
        try:
            if tf.config.get_logical_device_configuration(gpu):
                _log(
                    "tensorflow: the pool's module gave its GPU logical devices itself; "
                    "left as they are (no memory_limit from the pool)"
                )
                return
            # Growth first: TensorFlow refuses to change it once the device has a logical
            # configuration.
            tf.config.experimental.set_memory_growth(gpu, True)
            if limit_mib:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)]
                )
        except (RuntimeError, ValueError) as e:
            # "Physical devices cannot be modified after being initialized"
            _log(
                f"tensorflow had initialised its GPU before the worker could configure it "
                f"({e}): no memory growth and no memory_limit for it; import tensorflow at "
                "the top of the pool's module and use it only in on_start or in ops"
            )
            return
        if limit_mib:
            _log(f"tensorflow: memory growth on, one logical GPU of {limit_mib} MiB")
        else:
            _log(
                f"tensorflow: memory growth on, but no memory_limit: the GPU's total memory "
                f"is unknown ({why}), so the pool's fraction {fraction} cannot be made MiB"
            )

    def describe(self) -> str:
        torch, cupy = _frameworks()
        d: Dict[str, Any] = {
            "python": sys.version.split()[0],
            "ops": sorted(n for n in self.ops),
            "allow_callables": self.allow_callables,
        }
        if torch is not None:
            d["torch"] = torch.__version__
        if cupy is not None:
            d["cupy"] = cupy.__version__
        tf = sys.modules.get("tensorflow")
        if tf is not None:
            d["tensorflow"] = getattr(tf, "__version__", "?")
        return json.dumps(d)

    # -- clients' segments: page-locked on a GPU pool -------------------------------------------

    def client_mapped(self, client: int, base: int, size: int) -> None:
        if not self.gpu:
            return
        torch, cupy = _frameworks()
        if torch is not None:
            err = torch.cuda.cudart().cudaHostRegister(base, size, 0)
            if int(err) == 0:
                self.registered[client] = base
        elif cupy is not None:
            try:
                cupy.cuda.runtime.hostRegister(base, size, 0)
                self.registered[client] = base
            except Exception:  # noqa: BLE001 - pageable copies still work
                pass

    def client_unmapping(self, client: int, base: int, size: int) -> None:
        if self.registered.pop(client, None) is None:
            return
        torch, cupy = _frameworks()
        if torch is not None:
            torch.cuda.cudart().cudaHostUnregister(base)
        elif cupy is not None:
            cupy.cuda.runtime.hostUnregister(base)

    # -- jobs ----------------------------------------------------------------------------------

    def run(
        self, name: str, inp: memoryview, out: memoryview, h: int, n: int
    ) -> Tuple[int, str, int, int]:
        """One job: its call header at [h, h + n) of ``inp`` (-1: the job has no py.h/py.n)."""
        if self.gpu and len(self.configured) < len(_FRAMEWORKS):
            self._configure_frameworks()  # one the job's code has imported since
        if name == _native.CALL_OP:
            return self._run_callable(inp, out, h, n)
        entry = self.ops.get(name)
        if entry is None:
            return (_errors.UnknownOp.code, f"{name}: not an op of this Python pool", 0, 0)
        try:
            if h < 0 or n < 0:
                raise ValueError(_NOT_A_CALL)
            _, args, kwargs = decode_call(inp, h, n, False)
        except Exception as e:  # noqa: BLE001 - the client's mistake, not the op's
            return (_errors.InvalidArgument.code, f"{name}: {e}", 0, 0)
        try:
            return self._call(name, entry[0], args, kwargs, out)
        finally:
            del args, kwargs

    def _call(
        self, name: str, fn: Any, args: list, kwargs: dict, out: memoryview
    ) -> Tuple[int, str, int, int]:
        """One call of a named op for one job, its answer or failure written into ``out``."""
        try:
            result = fn(*args, **kwargs)
            n = write_result(out, result)  # the common results, in C++
            if n is None:
                n = _answers.write_result(out, result)
            elif n < 0:
                raise ResultTooLarge(-n, len(out))
            return (0, "", n, 0)
        except ResultTooLarge as e:
            n = _answers.write_error(out, "gpuq.ResultTooLarge", str(e), "", needed=e.needed)
            return (_errors.InvalidArgument.code, f"{name}: {e}", n, 0)
        except BaseException as e:  # noqa: BLE001 - every failure is the job's, reported
            return self._failed(name, e, out)

    def run_batch(
        self, name: str, ins: List[memoryview], outs: List[memoryview], params: List[Dict[str, Any]]
    ) -> Tuple[List[Tuple[int, str, int, int]], List[int]]:
        """Jobs of a batched op the worker gathered (docs/python.md, "Dynamic batching"): each
        set of jobs whose arguments agree in one call, at most max_batch_size rows, with their
        arrays concatenated along axis 0. (each job's outcome, the rows of each call)."""
        if self.gpu and len(self.configured) < len(_FRAMEWORKS):
            self._configure_frameworks()
        entry = self.ops.get(name)
        if entry is None:
            return [(_errors.UnknownOp.code, f"{name}: not an op of this Python pool", 0, 0)] * len(
                ins
            ), []
        fn, _, (max_rows, _) = entry
        results: List[Any] = [None] * len(ins)
        jobs: List[Any] = [None] * len(ins)
        calls: List[List[int]] = []
        groups: Dict[Any, Tuple[List[List[int]], int]] = {}
        try:
            for i, (inp, p) in enumerate(zip(ins, params)):
                try:
                    args, kwargs = _batching.decode_call(inp, p)
                except Exception as e:  # noqa: BLE001 - the client's mistake, not the op's
                    results[i] = (_errors.InvalidArgument.code, f"{name}: {e}", 0, 0)
                    continue
                key, rows = _batching.batch_key(args, kwargs)
                jobs[i] = (args, kwargs, rows)
                if key is None:
                    calls.append([i])
                    continue
                # Consecutive chunks of at most max_rows rows (one job may be more alone):
                # per key, its chunks and the rows of its last.
                chunks, last_rows = groups.get(key, ([[]], 0))
                if chunks[-1] and last_rows + rows > max_rows:
                    chunks.append([])
                    last_rows = 0
                chunks[-1].append(i)
                groups[key] = (chunks, last_rows + rows)
            for chunks, _ in groups.values():
                calls.extend(chunks)
            calls.sort(key=lambda c: c[0])
            call_rows = []
            for call in calls:
                call_rows.append(sum(jobs[i][2] for i in call))
                self._call_batch(name, fn, call, jobs, outs, results)
            return results, call_rows
        finally:
            jobs.clear()

    def _call_batch(
        self,
        name: str,
        fn: Any,
        call: List[int],
        jobs: List[Any],
        outs: List[memoryview],
        results: List[Any],
    ) -> None:
        if len(call) == 1:  # called as an unbatched op's job is, with its own arrays
            i = call[0]
            results[i] = self._call(name, fn, jobs[i][0], jobs[i][1], outs[i])
            return
        first_args, first_kwargs, _ = jobs[call[0]]
        try:
            args = [
                _batching.concat_rows([jobs[i][0][k] for i in call]) for k in range(len(first_args))
            ]
            kwargs = {k: _batching.concat_rows([jobs[i][1][k] for i in call]) for k in first_kwargs}
            kind, parts = _batching.split_rows(
                name, fn(*args, **kwargs), [jobs[i][2] for i in call]
            )
        except BaseException as e:  # noqa: BLE001 - the call's failure is each of its jobs'
            failed = self._failed(name, e, outs[call[0]])
            for i in call:
                results[i] = failed if i == call[0] else self._failed(name, e, outs[i])
            return
        finally:
            args = kwargs = None  # type: ignore[assignment]
        for i, arrays in zip(call, parts):
            try:
                results[i] = (0, "", _answers.write_answer(outs[i], {"kind": kind}, arrays), 0)
            except ResultTooLarge as e:
                n = _answers.write_error(
                    outs[i], "gpuq.ResultTooLarge", str(e), "", needed=e.needed
                )
                results[i] = (_errors.InvalidArgument.code, f"{name}: {e}", n, 0)

    def _failed(
        self,
        name: str,
        e: BaseException,
        out: memoryview,
        pickled: bool = False,
        initializer: bool = False,
    ) -> Tuple[int, str, int, int]:
        """The failure record of a job (``pickled``: a callable's, with the exception itself;
        ``initializer``: its executor's initializer raised ``e`` in this worker)."""
        if (
            isinstance(e, (SystemExit, KeyboardInterrupt))
            and not isinstance(e, Exception)
            and not pickled
        ):
            # A named op asked the interpreter to exit: it does, as a crash would. (A callable's
            # SystemExit is its task's outcome, as in ProcessPoolExecutor, and the worker goes on.)
            os._exit(70)
        if isinstance(e, _errors.Cancelled) or (
            _ops.cancelled() and isinstance(e, _errors.Error) and e.code == _errors.Cancelled.code
        ):
            return (_errors.Cancelled.code, f"{name}: cancelled while running", 0, 0)
        self._check_device(e)
        kind = f"{type(e).__module__}.{type(e).__qualname__}"
        if type(e).__module__ == "builtins":
            kind = type(e).__qualname__
        # From the op's own frame on: the worker's frames that called it are noise.
        where = e.__traceback__.tb_next if e.__traceback__ is not None else None
        tb = "".join(traceback.format_exception(type(e), e, where or e.__traceback__))
        oom = out_of_memory(e)
        if oom:
            # The job's message holds under 160 bytes: the framework's own words first, after
            # the class's name alone (remote_type has its module) and without TensorFlow's
            # "{{function_node ...}} " prefix. The record keeps the whole message.
            text = str(e)
            if text.startswith("{{") and "}} " in text:
                text = text[text.index("}} ") + 3 :]
            msg = f"{name}: {type(e).__qualname__}: {text}"
        else:
            msg = f"{name}: {kind}: {e}"
        extra: Dict[str, Any] = {"initializer": True} if initializer else {}
        n = 0
        if pickled:
            try:
                blob = pickle.dumps(e, protocol=5)
                n = _answers.write_answer(
                    out,
                    {
                        "error": {
                            "type": kind,
                            "message": str(e)[:4096],
                            "traceback": tb[-16384:],
                            **extra,
                        },
                        "kind": "exception",
                    },
                    [np.frombuffer(blob, dtype=np.uint8)],
                )
            except Exception:  # noqa: BLE001 - unpicklable: the record without it
                n = 0
        if n == 0:
            n = _answers.write_error(out, kind, str(e), tb, **extra)
        return (_errors.OutOfMemory.code if oom else _errors.OpFailed.code, msg, n, 0)

    def _check_device(self, e: BaseException) -> None:
        """After a failure on a GPU pool: whether the CUDA context still works (a sticky error
        poisons it; the worker then exits to be replaced, after this job's outcome)."""
        if not self.gpu:
            return
        torch, cupy = _frameworks()
        try:
            if torch is not None:
                torch.cuda.synchronize()
            elif cupy is not None:
                cupy.cuda.runtime.deviceSynchronize()
        except Exception:  # noqa: BLE001 - any error here means the context is gone
            self.poisoned = True

    def _function(self, blob: memoryview) -> Any:
        """The callable a pickle holds, unpickled once per distinct pickle (gpuq.Executor sends
        the same bytes for the same function, and says so: _pickles, kFlagFunctionReused)."""
        key = bytes(blob)
        fn = self.functions.get(key)
        if fn is None:
            fn = pickle.loads(key)
            if len(self.functions) >= 256:
                self.functions.clear()
            self.functions[key] = fn
        return fn

    def _context(self, blob: memoryview) -> "_ExecutorContext":
        """An Executor's context (gpuq._executor.Executor._context), unpickled once."""
        key = bytes(blob)
        ctx = self.contexts.get(key)
        if ctx is None:
            _, authkey, initializer = pickle.loads(key)
            ctx = _ExecutorContext(_mp_process.AuthenticationString(authkey), initializer)
            if len(self.contexts) >= 1024:
                self.contexts.clear()
            self.contexts[key] = ctx
        return ctx

    def _run_callable(
        self, inp: memoryview, out: memoryview, h: int, n: int
    ) -> Tuple[int, str, int, int]:
        if not self.allow_callables:
            return (
                _errors.PermissionDenied.code,
                "this pool does not run callables: its config has python.allow_callables "
                'false (docs/python.md, "gpuq.Executor")',
                0,
                0,
            )
        try:
            if h < 0 or n < 0:
                raise ValueError(_NOT_A_CALL)
            flags, parts, kwargs = decode_call(inp, h, n, True)
            if flags & _FETCH_SPILLED:
                return self._fetch_spilled(parts, out)
            if not parts:
                raise ValueError("a callable's job without its callable")
            first = 1
            if flags & _EXECUTOR_CONTEXT:
                first = 2
                failure = self._context(parts[1]).enter()
                if failure is not None:
                    return self._failed("initializer", failure, out, pickled=True, initializer=True)
            # After the authkey: joblib's batches hold proxies. Kept only when the client
            # sends the same pickle again; a joblib batch holds its data and is used once.
            fn = self._function(parts[0]) if flags & _FUNCTION_REUSED else pickle.loads(parts[0])
            if flags & _PICKLED_ARGS:
                args, kwargs = pickle.loads(parts[first], buffers=parts[first + 1 :])
            else:
                args = parts[first:]
            del parts
        except BaseException as e:  # noqa: BLE001 - unpickling may raise anything
            return self._failed(_native.CALL_OP, e, out, pickled=True)
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001
            return self._failed(getattr(fn, "__name__", _native.CALL_OP), e, out, pickled=True)
        finally:
            del args, kwargs
        try:
            bufs: List[pickle.PickleBuffer] = []
            blob = pickle.dumps(result, protocol=5, buffer_callback=bufs.append)
            arrays = [np.frombuffer(blob, dtype=np.uint8)]
            arrays += [np.frombuffer(b.raw(), dtype=np.uint8) for b in bufs]
            return (0, "", _answers.write_answer(out, {"kind": "pickle"}, arrays), 0)
        except ResultTooLarge as e:
            spilled = self._spill(arrays, out)
            if spilled is not None:
                return spilled
            n = _answers.write_error(out, "gpuq.ResultTooLarge", str(e), "", needed=e.needed)
            return (_errors.InvalidArgument.code, f"{_native.CALL_OP}: {e}", n, 0)
        except BaseException as e:  # noqa: BLE001 - an unpicklable result
            return self._failed(_native.CALL_OP, e, out, pickled=True)

    @staticmethod
    def _spill(arrays: List[np.ndarray], out: memoryview) -> Optional[Tuple[int, str, int, int]]:
        """A result larger than its answer room, written to a spill file for the caller to
        fetch in pieces (gpuq._spill); None when that cannot be done either."""
        try:
            token, sizes = _spill.store(arrays)
        except OSError as e:
            print(f"gpuq python worker: cannot spill a large result: {e}", file=sys.stderr)
            return None
        try:
            n = _answers.write_answer(out, {"kind": "pickle", "spill": token, "sizes": sizes}, [])
        except ResultTooLarge:  # a room too small even for that (output_bytes=64)
            _spill.discard(token)
            return None
        return (0, "", n, 0)

    def _fetch_spilled(self, parts: List[Any], out: memoryview) -> Tuple[int, str, int, int]:
        try:
            if (
                len(parts) != 4
                or type(parts[1]) is not int
                or type(parts[2]) is not int
                or type(parts[3]) is not bool
                or parts[1] < 0
                or parts[2] < 0
            ):
                raise ValueError("a spilled result's fetch takes (token, offset, length, last)")
            piece = _spill.read_piece(parts[0], parts[1], parts[2], parts[3])
            return (0, "", _answers.write_answer(out, {"kind": "pickle"}, [piece]), 0)
        except BaseException as e:  # noqa: BLE001 - the fetch's failure, said to its caller
            return self._failed("fetching a spilled result", e, out, pickled=True)


class _ExecutorContext:
    """What an Executor's tasks take along (call_codec.hpp, kFlagExecutorContext): the caller's
    multiprocessing authkey, and its initializer and arguments, pickled, run in this worker
    before the executor's first task here."""

    __slots__ = ("authkey", "initializer", "failure")

    def __init__(self, authkey: Any, initializer: Optional[bytes]) -> None:
        self.authkey = authkey
        self.initializer = initializer  # its pickle until it has run, then None
        self.failure: Optional[BaseException] = None  # what it (or its unpickling) raised

    def enter(self) -> Optional[BaseException]:
        """Before a task: the caller's authkey becomes this process's (for the task and after:
        the worker has no use of its own for it), so that the Manager proxies among its
        arguments connect as in a child of the caller; the initializer runs on the first
        task. What the initializer raised, if it did: the executor is broken."""
        config = _mp_process.current_process()._config
        if config.get("authkey") is not self.authkey:
            config["authkey"] = self.authkey
        if self.initializer is not None:
            blob, self.initializer = self.initializer, None
            try:
                fn, args = pickle.loads(blob)  # after the authkey: initargs may hold proxies
                if fn is not None:
                    fn(*args)
            except BaseException as e:  # noqa: BLE001 - the executor is broken
                self.failure = e
        return self.failure


def _fail(message: str) -> int:
    print(f"gpuq python worker: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    modules: List[str] = []
    paths: List[str] = []
    ops_json: Optional[str] = None
    list_ops = allow_callables = gpu = False
    pool_id = 0
    rest: List[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if a in ("--list-ops", "--allow-callables", "--gpu"):
            list_ops |= a == "--list-ops"
            allow_callables |= a == "--allow-callables"
            gpu |= a == "--gpu"
            i += 1
            continue
        if i + 1 >= len(args):
            print(_USAGE, file=sys.stderr)
            return 2
        v = args[i + 1]
        if a == "--module":
            modules.append(v)
        elif a == "--path":
            paths.append(v)
        elif a == "--ops":
            ops_json = v
        elif a == "--pool-id" and list_ops:
            pool_id = int(v)
        else:
            rest += [a, v]
            if a == "--pool-id":
                pool_id = int(v)
        i += 2
    if not list_ops and ops_json is None:
        print(_USAGE, file=sys.stderr)
        return 2
    # The list goes to the real stdout, alone: what the modules print while they import goes
    # to stderr (gpuqd's log) instead of in front of it.
    listing = None
    if list_ops:
        sys.stdout.flush()
        listing = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    # A traceback of a failing import or on_start is the start-up failure gpuqd reports.
    _import_modules(paths, modules)
    if listing is not None:
        json.dump(
            [
                {"name": n, "summary": s, "max_batch_size": b[0], "max_queue_delay_us": b[1]}
                for n, (_, s, b) in _ops.registry.items()
            ],
            listing,
        )
        listing.write("\n")
        listing.close()
        return 0
    expected = {name: op_id for op_id, name in json.loads(ops_json or "[]")}
    have = set(_ops.registry) | {_native.CALL_OP}
    if have != set(expected):
        return _fail(
            f"the modules define ops {sorted(have - {_native.CALL_OP})}, but gpuqd started with "
            f"{sorted(set(expected) - {_native.CALL_OP})}: did a module change since? restart gpuqd"
        )
    # As gpuq's C++ workers: a terminal's Ctrl-C (sent to gpuqd's whole process group) ends the
    # worker, instead of raising KeyboardInterrupt in whatever job runs next.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    batching = {n: b for n, (_, _, b) in _ops.registry.items()}
    _native.register_python_ops(
        pool_id, sorted((i, n) + batching.get(n, (1, 0)) for n, i in expected.items())
    )
    runtime = Runtime(dict(_ops.registry), allow_callables, gpu)
    return int(_native.run_worker(["gpuq-python-worker"] + rest, runtime))


if __name__ == "__main__":
    sys.exit(main())
