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

import gc
import importlib
import inspect
import json
import os
import pickle
import signal
import sys
import traceback
from multiprocessing import process as _mp_process
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from . import _answers, _batching, _errors, _native, _ops, _parts, _spill, _steps
from ._answers import ResultTooLarge
from ._frameworks import Frameworks, out_of_memory

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


class Runtime:
    """What the C++ worker loop calls (python/src/worker.cpp: PythonBackend)."""

    def __init__(self, ops: Dict[str, Any], allow_callables: bool, gpu: bool) -> None:
        self.ops = ops
        self.allow_callables = allow_callables
        self.gpu = gpu
        self.poisoned = False  # the CUDA context broke: worker.cpp ends the worker
        # On a GPU pool: the frameworks the modules loaded, set up for the worker's GPU.
        self.frameworks = Frameworks(_ops.context()) if gpu else None
        self.functions: Dict[bytes, Any] = {}  # a callable's pickle -> the callable
        self.contexts: Dict[bytes, _ExecutorContext] = {}  # by the context's pickle
        self.sequences = _steps.Sequences(self._failed)  # the step ops' live sequences

    # -- start-up ------------------------------------------------------------------------------

    def start(self, pool_id: int, limit_bytes: int, limit_fraction: float) -> None:
        ctx = _ops.context()
        ctx.pool_id = pool_id
        ctx.worker_id = int(os.environ.get("GPUQ_WORKER_ID", "-1"))
        ctx.gpu = self.gpu
        if self.frameworks is not None:
            ctx.device = 0
            self.frameworks.memory_limit = (limit_bytes, limit_fraction)
            self.frameworks.configure()
        for fn in list(_ops.on_start_functions):
            fn()
        if self.frameworks is not None:
            self.frameworks.configure()  # those on_start loaded
        # Everything imported and loaded so far (a framework's modules, a model: millions of
        # objects with torch) lives as long as the worker: out of the cyclic collector's reach,
        # so that the collections each job's garbage triggers do not walk it. With torch loaded,
        # a quarter of a busy worker's CPU went to them before (bench_batching.py).
        gc.collect()
        gc.freeze()

    def describe(self) -> str:
        d: Dict[str, Any] = {
            "python": sys.version.split()[0],
            "ops": sorted(n for n in self.ops),
            "allow_callables": self.allow_callables,
        }
        d.update(Frameworks.versions())
        return json.dumps(d)

    # -- clients' segments: page-locked on a GPU pool -------------------------------------------

    def client_mapped(self, client: int, base: int, size: int) -> None:
        if self.frameworks is not None:
            self.frameworks.page_lock(client, base, size)

    def client_unmapping(self, client: int, base: int, size: int) -> None:
        if self.frameworks is not None:
            self.frameworks.page_unlock(client, base, size)

    # -- jobs ----------------------------------------------------------------------------------

    def run(
        self, name: str, inp: memoryview, out: memoryview, h: int, n: int
    ) -> Tuple[int, str, int, int]:
        """One job: its call header at [h, h + n) of ``inp`` (-1: the job has no py.h/py.n)."""
        if self.frameworks is not None:
            self.frameworks.configure_new()  # one the job's code has imported since
        if name == _native.CALL_OP:
            return self._run_callable(inp, out, h, n)
        entry = self.ops.get(name)
        if entry is None:
            return (_errors.UnknownOp.code, f"{name}: not an op of this Python pool", 0, 0)
        if isinstance(entry[0], _ops.StepFunctions):  # never sent here: the step runner's
            return (_errors.Internal.code, f"{name}: a step op's job ran alone", 0, 0)
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

    # -- step ops' sequences (python/src/worker.cpp: the step runner's backend) -----------------

    def step_start(
        self, name: str, key: int, inp: memoryview, out: memoryview, h: int, n: int
    ) -> Tuple[int, str, int]:
        """A job of step op ``name`` joins as sequence ``key``: its call decoded, its state made."""
        if self.frameworks is not None:
            self.frameworks.configure_new()
        fns = _steps.find(self.ops, name)
        if fns is None:
            return (_errors.UnknownOp.code, f"{name}: not a step op of this Python pool", 0)
        try:
            if h < 0 or n < 0:
                raise ValueError(_NOT_A_CALL)
            _, args, kwargs = decode_call(inp, h, n, False)
        except Exception as e:  # noqa: BLE001 - the client's mistake, not the op's
            return (_errors.InvalidArgument.code, f"{name}: {e}", 0)
        try:
            return self.sequences.start(name, fns, key, args, kwargs, out)
        finally:
            del args, kwargs

    def step(
        self, name: str, keys: List[int], cells: List[memoryview], streams: List[bool]
    ) -> List[Tuple[int, str, int, bool]]:
        """One step of step op ``name`` for the sequences ``keys`` (gpuq._steps)."""
        fns = _steps.find(self.ops, name)
        if fns is None:
            why = (_errors.UnknownOp.code, f"{name}: not a step op of this Python pool", 0, True)
            return [why] * len(keys)
        return self.sequences.step(name, fns, keys, cells, streams)

    def step_end(self, key: int) -> None:
        self.sequences.end(key)

    def _call(
        self, name: str, fn: Any, args: list, kwargs: dict, out: memoryview
    ) -> Tuple[int, str, int, int]:
        """One call of a named op for one job, its answer or failure written into ``out``."""
        try:
            result = fn(*args, **kwargs)
            if (
                _native.job_streams()
            ):  # a stream: each value yielded a part (one if not a generator)
                generated = inspect.isgenerator(result) or inspect.isasyncgen(result)
                return _parts.stream(name, result if generated else iter((result,)), self._failed)
            if inspect.isgenerator(result) or inspect.isasyncgen(result):
                result = _parts.collect(result)  # called, not streamed: all parts at once
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
        """Jobs of a batched op the worker gathered (docs/python.md, "Dynamic batching"), at
        most max_batch_size rows: each set of jobs whose arguments agree in one call, with
        their arrays concatenated along axis 0. (each job's outcome, the rows of each call)."""
        if self.frameworks is not None:
            self.frameworks.configure_new()
        entry = self.ops.get(name)
        if entry is None:
            return [(_errors.UnknownOp.code, f"{name}: not an op of this Python pool", 0, 0)] * len(
                ins
            ), []
        fn = entry[0]
        results: List[Any] = [None] * len(ins)
        jobs: List[Any] = [None] * len(ins)
        keys: List[Any] = []
        try:
            for i, (inp, p) in enumerate(zip(ins, params)):
                try:
                    args, kwargs = _batching.decode_call(inp, p)
                    key, rows = _batching.batch_key(args, kwargs)
                    _batching.check_rows(key, rows, p)
                except Exception as e:  # noqa: BLE001 - the client's mistake, not the op's
                    results[i] = (_errors.InvalidArgument.code, f"{name}: {e}", 0, 0)
                    keys.append(None)
                    continue
                jobs[i] = (args, kwargs, rows)
                keys.append(key)
            calls = [c for c in _batching.group(keys) if jobs[c[0]] is not None]
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
        if self.frameworks is not None and not self.frameworks.device_works():
            self.poisoned = True
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
            authkey = _mp_process.AuthenticationString(authkey)  # type: ignore[attr-defined]
            ctx = _ExecutorContext(authkey, initializer)
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
        config = _mp_process.current_process()._config  # type: ignore[attr-defined]
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
                {
                    "name": n,
                    "summary": s,
                    "max_batch_size": b[0],
                    "max_queue_delay_us": b[1],
                    "step": b[2],
                }
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
        pool_id, sorted((i, n) + batching.get(n, (1, 0, False)) for n, i in expected.items())
    )
    runtime = Runtime(dict(_ops.registry), allow_callables, gpu)
    return int(_native.run_worker(["gpuq-python-worker"] + rest, runtime))


if __name__ == "__main__":
    sys.exit(main())
