#!/usr/bin/env python3
"""Python-side cost of a task: gpuq's Python client against Python's process pools.

Measured in one run on one machine, with 2 worker processes in every system:

  gpuq        the ``gpuq`` package (Python client) against a private ``gpuqd`` started here
              with one ``cpu`` pool of 2 workers (``gpuq.testing.Daemon``);
  gpuq-copy   the same client and daemon, the array argument a plain numpy array that the
              client copies into its shared-memory segment on every call;
  cpp         libgpuq's C++ client (``gpuq::Client``) on the same connection, through
              ``gpuq._native.cpp_noop_round_trips`` (a C++ loop, GIL released): the floor the
              Python client is compared with (no-op round trips only);
  pyop        only when named in --systems: gpuq's Python ops. The same daemon gets a Python
              pool ``py`` of 2 workers (this interpreter, importing bench_ops.py from this
              directory), and a second client of its own calls its ops with
              ``client.submit_call(op, x, pool="py")`` (what ``client.call`` does, then
              ``.result()``), ``x`` made once with ``client.array`` (in the segment: zero copy);
  pyop-copy   the same, ``x`` a plain numpy array, copied into the segment on every call;
  executor    only when named in --systems: ``gpuq.Executor(client=..., pool="py")`` on the same
              Python pool (its config has ``allow_callables``), through a client of its own
              (a connection with a segment of its own): ``ex.submit(f, x).result()`` with
              the peers' own module-level functions (pickled by cloudpickle, by value, since
              this script runs as ``__main__``) and the peers' plain numpy array (pickled with
              protocol 5, its buffer copied into the segment on every call);
  loky        ``loky.get_reusable_executor(max_workers=2)``;
  ppe         ``concurrent.futures.ProcessPoolExecutor(2)``;
  mp          ``multiprocessing.Pool(2)`` (``apply_async``);
  ray         ``ray.init(num_cpus=2)`` and a remote function, when ``import ray`` works.

Cases:

  noop   gpuq: the ``noop`` op; pyop: the Python op ``nothing`` (returns None); executor and
         the peers: a function that returns None.
  1MiB   a 1 MiB float32 array in, the same array back. gpuq: the ``echo`` op copies the input
  64MiB  into an ``out`` array preallocated in the client's segment and the future's result is
         that array; gpuq reads the input in place when it is already in the segment (``gpuq``:
         ``client.array`` made once and reused, zero copy) and copies it in first when it is a
         plain numpy array (``gpuq-copy``). pyop: the Python op ``identity`` returns the
         read-only view of the input it is given, which the worker writes into the job's
         answer (a block the client allocates in its segment per call, with the header and,
         for pyop-copy, the copy of the input); the future's result is a view of it.
         executor: the peers' function returning its argument; the worker pickles the result
         into the job's answer, its array as an out-of-band buffer in the segment, and the
         future's result is unpickled from there (checked with ``np.array_equal`` against the
         input). The peers: a function returning its argument (the array is pickled to the
         worker and the result pickled back; Ray passes both through its object store).

--cases picks some of them (default all).

Figures, for each system and case:

  latency     one task in flight, back to back: each round trip is timed with
              ``time.perf_counter_ns`` from before the submit to after the result is in hand
              (gpuq: ``client.submit(...).result()``; executors, gpuq.Executor included:
              ``ex.submit(f, x).result()``;
              Pool: ``pool.apply_async(f, (x,)).get()``; Ray: ``ray.get(f.remote(x))``).
              p50/p99/p99.9 by nearest rank over the samples of all rounds.
  throughput  K tasks kept in flight (K = 10 x workers = 20; 4 for 64 MiB, see --inflight-large):
              K are submitted, then each time the oldest has finished one more is submitted,
              until N have finished; N over the time from the first submit to the last result.
              Task j uses out array j mod K (gpuq), so no two tasks in flight share one. A gpuq
              client may have at most ``client_share`` jobs queued in the pool (10 with this
              config, the Python pool's too, for pyop and the Executor alike); past that
              ``submit`` waits for room, which the figure includes.
  breakdown   after the rounds (--breakdown N, default 1000, at most the case's latency count):
              N more round trips of each gpuq variant (not C++; pyop and the Executor included)
              and case, each split into the submit call, the job's queued and run times (the
              daemon's stamps, ``Future.info``) and the rest; medians.

Method: every system is started and warmed up (pools started, a few tasks of each case run and
their results checked) before the first measurement, and stays up, idle, while the others are
measured. The run is split into rounds (--rounds); each round measures every case on every
system in turn (the order rotates from round to round), each block after a short warm-up of
its own, so that drift of the machine is spread over all systems. Ray runs last, in a phase of
its own (started, measured, stopped), because its background processes use CPU while idle.
Python's garbage collector stays on (it is what users get); it is run before each block.
Other CPU use during the run (busy time in /proc/stat less this process and its reaped
children) is reported as ``interference``.

Targets (printed with PASS/MISS; the run's exit status does not depend on them):
  loky no-op p50 / gpuq no-op p50 >= 50;
  loky 64 MiB p50 / gpuq 64 MiB p50 (array in the segment) >= 10 (copied-in variant: shown);
  gpuq Python-client no-op p50 - C++-client no-op p50 <= 3 us;
  loky no-op p50 / gpuq Python op no-op p50 >= 25;
  loky no-op p50 / gpuq.Executor no-op p50 >= 8;
  gpuq.Executor no-op tasks/s / multiprocessing.Pool no-op tasks/s (20 in flight) >= 3;
  loky 1 MiB p50 / gpuq Python op 1 MiB p50 (array in the segment) >= 30 (copied-in: shown).
The last four are issue 28's, point 3. Only the targets whose systems and case were measured
are shown.

Usage (from the repository root, in a venv with ``pip install ./python loky`` and optionally
ray): ``GPUQ_GPUQD=build/daemon/gpuqd python bench/python/bench_python.py``; the Python ops and
gpuq.Executor against the peers: ``... bench_python.py --systems pyop,executor,loky,ppe,mp
--cases noop,1MiB`` (its results file: bench/results/python-ops-<UTC date>.json). ``--quick`` is a
smoke run (well under a minute; its figures mean nothing). Exit status: 0 when every
measurement ran and every result was right (Ray skipped or not), 1 on any failure, 2 on bad
arguments. See bench/python/README.md and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import datetime
import functools
import gc
import json
import math
import multiprocessing
import os
import platform
import re
import resource
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORKERS = 2
DAEMON_CONFIG = {"pools": [{"name": "cpu", "kind": "cpu", "workers": WORKERS}]}
# The Python pool of --systems pyop and executor: gpuqd's Python workers run this interpreter
# and import bench_ops.py from this directory (its ops ``nothing`` and ``identity``); the pool
# also runs callables, for gpuq.Executor.
PY_POOL = "py"
OPS_DIR = os.path.dirname(os.path.abspath(__file__))
PY_POOL_CONFIG = {"name": PY_POOL, "kind": "cpu", "workers": WORKERS,
                  "python": {"interpreter": sys.executable, "modules": ["bench_ops"],
                             "path": [OPS_DIR], "allow_callables": True}}
MIB = 1 << 20
KIB = 1 << 10

# Cases: name -> array bytes (0: no array).
CASES: Dict[str, int] = {"noop": 0, "1MiB": 1 * MIB, "64MiB": 64 * MIB}
CASE_TITLES = {"noop": "no-op task", "1MiB": "1 MiB float32 array in and back",
               "64MiB": "64 MiB float32 array in and back"}

# Systems, in display order: name -> (label, count tier).
SYSTEMS: Dict[str, Tuple[str, str]] = {
    "gpuq": ("gpuq, Python client", "gpuq"),
    "gpuq-copy": ("gpuq, numpy copied in", "gpuq"),
    "cpp": ("gpuq, C++ client", "gpuq"),
    "pyop": ("gpuq Python op", "pyop"),
    "pyop-copy": ("gpuq Python op, copied in", "pyop"),
    "executor": ("gpuq.Executor", "pyop"),
    "loky": ("loky", "peer"),
    "ppe": ("ProcessPoolExecutor", "peer"),
    "mp": ("multiprocessing.Pool", "peer"),
    "ray": ("ray", "ray"),
}
# gpuq-copy comes with gpuq, pyop-copy with pyop. pyop and executor run only when named.
SELECTABLE = ("gpuq", "cpp", "pyop", "executor", "loky", "ppe", "mp", "ray")
DEFAULT_SYSTEMS = ("gpuq", "cpp", "loky", "ppe", "mp", "ray")
PEERS = ("loky", "ppe", "mp", "ray")
# gpuq's variants compared with the peers: system -> suffix of its keys in "speedups".
VARIANTS = {"gpuq": "", "gpuq-copy": "_copied", "pyop": "_pyop", "pyop-copy": "_pyop_copied",
            "executor": "_executor"}
# The systems that run on the daemon's Python pool (PY_POOL_CONFIG).
PY_POOL_SYSTEMS = ("pyop", "executor")

# Total counts over all rounds: (case, measure, tier) -> tasks. "latency": timed round trips;
# "throughput": tasks finished with K in flight. Ray runs one round with its counts. The tier
# "pyop" counts both Python op variants and gpuq.Executor.
COUNTS: Dict[str, Dict[str, Dict[str, int]]] = {
    "noop": {"latency": {"gpuq": 30000, "pyop": 9000, "peer": 3000, "ray": 1000},
             "throughput": {"gpuq": 60000, "pyop": 18000, "peer": 6000, "ray": 2000}},
    "1MiB": {"latency": {"gpuq": 3000, "pyop": 3000, "peer": 600, "ray": 200},
             "throughput": {"gpuq": 6000, "pyop": 6000, "peer": 600, "ray": 200}},
    "64MiB": {"latency": {"gpuq": 30, "pyop": 30, "peer": 12, "ray": 6},
              "throughput": {"gpuq": 60, "pyop": 60, "peer": 24, "ray": 12}},
}
QUICK_COUNTS: Dict[str, Dict[str, Dict[str, int]]] = {
    "noop": {"latency": {"gpuq": 3000, "pyop": 1000, "peer": 300, "ray": 100},
             "throughput": {"gpuq": 6000, "pyop": 2000, "peer": 600, "ray": 200}},
    "1MiB": {"latency": {"gpuq": 300, "pyop": 300, "peer": 50, "ray": 20},
             "throughput": {"gpuq": 600, "pyop": 600, "peer": 60, "ray": 20}},
    "64MiB": {"latency": {"gpuq": 5, "pyop": 5, "peer": 3, "ray": 2},
              "throughput": {"gpuq": 8, "pyop": 8, "peer": 4, "ray": 4}},
}


# ---- the peers' task functions (module level, so that every pool can pickle them) -------------

def noop() -> None:
    """The peers' no-op task."""
    return None


def identity(x: Any) -> Any:
    """The peers' array task: returns its argument (pickled back to the caller)."""
    return x


# ---- timing ------------------------------------------------------------------------------------

Start = Callable[[], Any]          # submits one task, returns its handle
Finish = Callable[[Any], Any]      # waits for a handle, returns the task's result
Check = Callable[[int, Any], bool]  # (out slot, result) -> whether the result is right


def time_round_trips(start: Start, finish: Finish, n: int) -> List[int]:
    """n round trips, one in flight; the nanoseconds of each."""
    clock = time.perf_counter_ns
    samples = [0] * n
    for i in range(n):
        t0 = clock()
        finish(start())
        samples[i] = clock() - t0
    return samples


def run_in_flight(starts: Sequence[Start], finish: Finish, n: int,
                  check: Optional[Check] = None) -> int:
    """n tasks, len(starts) in flight: task j is started by starts[j % K], the oldest is waited
    for first. Returns the nanoseconds from the first submit to the last result. With ``check``
    every result is checked (warm-up only), and a wrong one raises."""
    k = len(starts)
    clock = time.perf_counter_ns
    pending: collections.deque = collections.deque()
    t0 = clock()
    submitted = 0
    while submitted < min(k, n):
        pending.append(starts[submitted]())
        submitted += 1
    done = 0
    while pending:
        result = finish(pending.popleft())
        if check is not None and not check(done % k, result):
            raise RuntimeError(f"task {done}: wrong result {type(result).__name__}")
        done += 1
        if submitted < n:
            pending.append(starts[submitted % k]())
            submitted += 1
    return clock() - t0


def time_breakdown(start: Start, n: int) -> Dict[str, Any]:
    """n gpuq round trips, one in flight, each split by the client's clock and the daemon's
    job stamps (``Future.info``): the submit call (until it returns), the job's queued and run
    times, and the rest (the total less those three: the worker's end reaching the client and
    the result's conversion, plus whatever of the queued time overlapped the submit call).
    Medians in microseconds."""
    clock = time.perf_counter_ns
    rows = []
    for _ in range(n):
        t0 = clock()
        f = start()
        t1 = clock()
        f.result()
        t2 = clock()
        info = f.info
        rows.append((t2 - t0, t1 - t0, info.queued_ns, info.run_ns))
    out: Dict[str, Any] = {"count": n}
    for i, key in enumerate(("total_us", "submit_us", "queued_us", "run_us")):
        out[key] = percentile(sorted(r[i] for r in rows), 50)
    out["rest_us"] = percentile(sorted(r[0] - r[1] - r[2] - r[3] for r in rows), 50)
    return out


def percentile(sorted_ns: Sequence[int], p: float) -> float:
    """Nearest-rank percentile of sorted samples, in microseconds."""
    rank = max(1, math.ceil(p / 100.0 * len(sorted_ns)))
    return sorted_ns[rank - 1] / 1e3


def latency_stats(samples: Sequence[int]) -> Dict[str, Any]:
    s = sorted(samples)
    return {"count": len(s), "min_us": s[0] / 1e3, "p50_us": percentile(s, 50),
            "p99_us": percentile(s, 99), "p999_us": percentile(s, 99.9),
            "mean_us": sum(s) / len(s) / 1e3, "max_us": s[-1] / 1e3}


# ---- systems -----------------------------------------------------------------------------------

class Tasks:
    """How one system runs one case: K submit callables (one per out slot), how to wait for a
    handle, and how to check a result."""

    def __init__(self, starts: Sequence[Start], finish: Finish, check: Check) -> None:
        self.starts = list(starts)
        self.finish = finish
        self.check = check


def _array_check(x: np.ndarray) -> Check:
    return lambda slot, r: isinstance(r, np.ndarray) and r.shape == x.shape and \
        np.array_equal(r, x)


def daemon_config(systems: Sequence[str]) -> Dict[str, Any]:
    """The private gpuqd's config: the ``cpu`` pool for gpuq and cpp (DAEMON_CONFIG), the Python
    pool for pyop and executor."""
    pools = []
    if "gpuq" in systems or "cpp" in systems:
        pools += DAEMON_CONFIG["pools"]
    if any(s in systems for s in PY_POOL_SYSTEMS):
        pools.append(PY_POOL_CONFIG)
    return {"pools": pools}


def _segment_bytes(need: float) -> int:
    """A segment for ``need`` bytes of arrays, a quarter more against fragmentation."""
    segment = max(64 * MIB, (int(need * 1.25) // MIB + 16) * MIB)
    limit = 1 << 30  # the daemon's max_client_segment_bytes, which the config leaves
    if segment > limit:
        raise RuntimeError(f"the arrays need a {segment // MIB} MiB segment, the daemon "
                           f"allows {limit // MIB} MiB: lower --inflight-large")
    return segment


class Gpuq:
    """The private daemon, its clients, and the arrays every gpuq case uses (made once).

    ``client`` (gpuq, gpuq-copy, cpp: the native ops of the ``cpu`` pool), ``py`` (pyop,
    pyop-copy: the Python ops of the ``py`` pool) and ``ex_client`` (executor: the
    ``gpuq.Executor`` ``ex`` on the ``py`` pool) are separate connections, each with a segment
    of its own, so that a run of several measures each as it would run alone."""

    def __init__(self, gpuqd: str, inputs: Dict[str, np.ndarray], inflight: Dict[str, int],
                 systems: Sequence[str], stack: contextlib.ExitStack) -> None:
        import gpuq
        import gpuq.testing
        self.gpuq = gpuq
        self.config = daemon_config(systems)
        self.daemon = stack.enter_context(gpuq.testing.Daemon(self.config, gpuqd=gpuqd))
        self.daemon_status = self.daemon.status()
        self.inputs = inputs
        self.client: Any = None
        self.py: Any = None
        self.ex_client: Any = None
        self.ex: Any = None
        if "gpuq" in systems or "cpp" in systems:
            # Room for every case's arrays at once: the input in the segment, K out arrays, and
            # up to K + 1 copies made by the copied-in variant.
            need = sum(a.nbytes * (1 + k + k + 1) for case, a in inputs.items()
                       for k in [inflight[case]])
            self.client = gpuq.connect(self.daemon.runtime_dir, segment_bytes=_segment_bytes(need),
                                       name="bench_python")
            stack.callback(self.client.close)
            self.in_segment = {case: self.client.array(a) for case, a in inputs.items()}
            self.outs = {case: [self.client.zeros(a.shape, a.dtype)
                                for _ in range(inflight[case])]
                         for case, a in inputs.items()}
        if "pyop" in systems:
            # Every case's input in the segment, and the largest case's blocks at once: a call
            # allocates its answer's block (the array's bytes + 64 KiB) and, copied in, a block
            # for the header and the copy; K in flight, the result just taken and the next call.
            need = sum(a.nbytes for a in inputs.values()) + max(
                [(2 * inflight[case] + 2) * (a.nbytes + 64 * KIB + 4 * KIB)
                 for case, a in inputs.items()] + [0])
            self.py = gpuq.connect(self.daemon.runtime_dir, segment_bytes=_segment_bytes(need),
                                   name="bench_python_pyop")
            stack.callback(self.py.close)
            self.py_in_segment = {case: self.py.array(a) for case, a in inputs.items()}
        if "executor" in systems:
            # The largest case's blocks at once: a call allocates a block for the header, the
            # pickle and the copy of the array argument, and one for the answer (the arguments'
            # bytes + 64 KiB); K in flight, the result just taken and the next call.
            need = max([(2 * inflight[case] + 2) * (a.nbytes + 64 * KIB + 8 * KIB)
                        for case, a in inputs.items()] + [0])
            self.ex_client = gpuq.connect(self.daemon.runtime_dir,
                                          segment_bytes=_segment_bytes(need),
                                          name="bench_python_executor")
            stack.callback(self.ex_client.close)
            self.ex = gpuq.Executor(client=self.ex_client, pool=PY_POOL)
            stack.callback(self.ex.shutdown, wait=True)

    def client_info(self) -> Dict[str, Any]:
        return {name: {"segment_bytes": c.segment_bytes, "slot_count": c.slot_count,
                       "pools": c.pools}
                for name, c in (("native", self.client), ("pyop", self.py),
                                ("executor", self.ex_client)) if c is not None}

    def pyop_tasks(self, case: str, k: int, copied: bool) -> Tasks:
        """pyop: ``py.submit_call("identity", x, pool="py")`` (or ``"nothing"``), the result
        the array the worker returned, in ``py``'s segment."""
        finish = self.gpuq.Future.result
        if case == "noop":
            return Tasks([functools.partial(self.py.submit_call, "nothing", pool=PY_POOL)] * k,
                         finish, lambda slot, r: r is None)
        x = self.inputs[case] if copied else self.py_in_segment[case]
        ref = self.inputs[case]
        in_segment = self.py.in_segment
        return Tasks([functools.partial(self.py.submit_call, "identity", x, pool=PY_POOL)] * k,
                     finish,
                     lambda slot, r: isinstance(r, np.ndarray) and r is not x and
                     r.shape == ref.shape and r.dtype == ref.dtype and in_segment(r) and
                     np.array_equal(r, ref))

    def executor_tasks(self, case: str, k: int) -> Tasks:
        """executor: ``ex.submit(noop)`` / ``ex.submit(identity, x)``, the peers' functions
        (pickled by cloudpickle), ``x`` the plain numpy array the peers get (copied into the
        segment on every call, as a drop-in ProcessPoolExecutor's caller would pass it)."""
        finish = self.gpuq.Future.result
        if case == "noop":
            return Tasks([functools.partial(self.ex.submit, noop)] * k, finish,
                         lambda slot, r: r is None)
        x = self.inputs[case]
        return Tasks([functools.partial(self.ex.submit, identity, x)] * k, finish,
                     _array_check(x))

    def tasks(self, case: str, k: int, copied: bool) -> Tasks:
        finish = self.gpuq.Future.result
        if case == "noop":
            return Tasks([functools.partial(self.client.submit, "noop")] * k, finish,
                         lambda slot, r: True)
        x = self.inputs[case] if copied else self.in_segment[case]
        outs = self.outs[case][:k]
        for out in outs:  # so that a check proves the worker wrote it
            out.fill(0)
        starts = [functools.partial(self.client.submit, "echo", x, out=out) for out in outs]
        ref = self.inputs[case]
        return Tasks(starts, finish,
                     lambda slot, r: r is outs[slot] and np.array_equal(r, ref))

    def cpp_round_trips(self, n: int) -> List[int]:
        ns = list(self.gpuq._native.cpp_noop_round_trips(self.client._c().native, n))
        if n and (len(ns) != n or 0 in ns):
            raise RuntimeError("a C++ no-op round trip failed (cpp_noop_round_trips stopped "
                               f"after {ns.index(0) if 0 in ns else len(ns)} of {n})")
        return ns


class Peer:
    """A process pool of the standard library, loky, or Ray."""

    def __init__(self, name: str, stack: contextlib.ExitStack) -> None:
        self.name = name
        self.info: Dict[str, Any] = {}
        if name == "loky":
            import loky
            ex = loky.get_reusable_executor(max_workers=WORKERS)
            stack.callback(ex.shutdown, wait=True, kill_workers=True)
            self.submit = lambda f, *a: functools.partial(ex.submit, f, *a)
            self.info["start_method"] = "loky"
        elif name == "ppe":
            ex = concurrent.futures.ProcessPoolExecutor(WORKERS)
            stack.callback(ex.shutdown, wait=True)
            self.submit = lambda f, *a: functools.partial(ex.submit, f, *a)
            self.info["start_method"] = multiprocessing.get_start_method()
        elif name == "mp":
            pool = multiprocessing.Pool(WORKERS)
            stack.callback(pool.join)
            stack.callback(pool.terminate)
            self.submit = lambda f, *a: functools.partial(pool.apply_async, f, a)
            self.info["start_method"] = multiprocessing.get_start_method()
        elif name == "ray":
            import logging
            import ray
            t0 = time.perf_counter()
            ray.init(num_cpus=WORKERS, include_dashboard=False, log_to_driver=False,
                     logging_level=logging.WARNING)
            stack.callback(ray.shutdown)
            self.info["init_s"] = time.perf_counter() - t0
            remote = {noop: ray.remote(noop), identity: ray.remote(identity)}
            self.submit = lambda f, *a: functools.partial(remote[f].remote, *a)
            self.ray_get = ray.get
        else:
            raise ValueError(name)
        self.finish: Optional[Finish] = None

    def tasks(self, case: str, k: int, x: Optional[np.ndarray]) -> Tasks:
        start = self.submit(noop) if x is None else self.submit(identity, x)
        if self.finish is None:  # the handle type's own method: no wrapper in the timed loop
            if self.name == "ray":
                self.finish = self.ray_get
            else:
                h = start()
                self.finish = type(h).get if self.name == "mp" else type(h).result
                self.finish(h)
        check = (lambda slot, r: r is None) if x is None else _array_check(x)
        return Tasks([start] * k, self.finish, check)


# ---- the run -----------------------------------------------------------------------------------

class Results:
    """Samples and throughput windows per (case, system), over the rounds, and failures."""

    def __init__(self, keep_samples: bool) -> None:
        self.samples: Dict[Tuple[str, str], List[List[int]]] = collections.defaultdict(list)
        self.windows: Dict[Tuple[str, str], List[Tuple[int, int, int]]] = \
            collections.defaultdict(list)
        self.failures: List[Dict[str, str]] = []
        self.skipped: Dict[str, str] = {}
        self.keep_samples = keep_samples

    def fail(self, system: str, case: str, what: str, exc: BaseException) -> None:
        msg = f"{type(exc).__name__}: {exc}"
        self.failures.append({"system": system, "case": case, "what": what, "error": msg})
        print(f"FAILURE {system} {case} {what}: {msg}", file=sys.stderr, flush=True)
        traceback.print_exc(file=sys.stderr)

    def latency(self, case: str, system: str) -> Optional[Dict[str, Any]]:
        rounds = [r for r in self.samples.get((case, system), []) if r]
        if not rounds:
            return None
        st = latency_stats([v for r in rounds for v in r])
        st["per_round_p50_us"] = [percentile(sorted(r), 50) for r in rounds]
        if self.keep_samples:
            st["samples_ns"] = [v for r in rounds for v in r]
        return st

    def throughput(self, case: str, system: str) -> Optional[Dict[str, Any]]:
        w = self.windows.get((case, system))
        if not w:
            return None
        tasks = sum(t for t, _, _ in w)
        ns = sum(d for _, d, _ in w)
        return {"tasks_per_s": tasks / ns * 1e9, "tasks": tasks, "seconds": ns / 1e9,
                "inflight": w[0][2], "per_round_tasks_per_s": [t / d * 1e9 for t, d, _ in w]}


def per_round(total: int, rounds: int) -> int:
    return max(1, math.ceil(total / rounds)) if total > 0 else 0


def measure_block(res: Results, case: str, system: str, tasks: Tasks, n_lat: int,
                  n_tp: int) -> None:
    """Warm-up (K tasks in flight, every result checked, then a tenth of the latency count),
    the latency samples, then the throughput window, for one system and case."""
    k = len(tasks.starts)
    run_in_flight(tasks.starts, tasks.finish, k, tasks.check)
    time_round_trips(tasks.starts[0], tasks.finish, max(1, n_lat // 10))
    gc.collect()
    if n_lat:
        res.samples[(case, system)].append(time_round_trips(tasks.starts[0], tasks.finish, n_lat))
    gc.collect()
    if n_tp:
        res.windows[(case, system)].append((n_tp, run_in_flight(tasks.starts, tasks.finish, n_tp),
                                            k))


def count(counts: Dict[str, Dict[str, Dict[str, int]]], case: str, measure: str,
          system: str) -> int:
    return counts[case][measure][SYSTEMS[system][1]]


def run_rounds(args: argparse.Namespace, res: Results, inputs: Dict[str, np.ndarray],
               inflight: Dict[str, int], systems: List[str], info: Dict[str, Any]) -> None:
    """Starts gpuq and the pools, measures every round, and stops them all (also on error)."""
    with contextlib.ExitStack() as stack:
        peers: Dict[str, Peer] = {}
        # The forking pools first, before this process has a gpuq client and its threads.
        for name in ("mp", "ppe", "loky"):
            if name in systems:
                try:
                    peers[name] = Peer(name, stack)
                    for case in args.cases:  # start the workers, run each case, check
                        t = peers[name].tasks(case, inflight[case], inputs.get(case))
                        run_in_flight(t.starts, t.finish, 1 if CASES[case] >= 16 * MIB
                                      else inflight[case], t.check)
                except Exception as e:  # noqa: BLE001 - recorded, the others go on
                    res.fail(name, "-", "start", e)
                    peers.pop(name, None)
        g: Optional[Gpuq] = None
        if any(s in systems for s in ("gpuq", "cpp") + PY_POOL_SYSTEMS):
            g = Gpuq(args.gpuqd, inputs, inflight, systems, stack)
            info["gpuq_daemon"] = g.daemon_status
            clients = g.client_info()
            if "native" in clients:
                info["gpuq_client"] = clients["native"]
            if "pyop" in clients:
                info["gpuq_pyop_client"] = clients["pyop"]
            if "executor" in clients:
                info["gpuq_executor_client"] = clients["executor"]
            if g.client is not None:
                for case in args.cases:  # run each case once, check, and warm the no-op path
                    for copied in (False, True) if CASES[case] else (False,):
                        t = g.tasks(case, inflight[case], copied)
                        run_in_flight(t.starts, t.finish, inflight[case], t.check)
                t = g.tasks("noop", inflight["noop"], False)
                run_in_flight(t.starts, t.finish, 2000)
                g.cpp_round_trips(1000)
            if g.py is not None:
                for case in args.cases:  # the same for the Python ops
                    for copied in (False, True) if CASES[case] else (False,):
                        t = g.pyop_tasks(case, inflight[case], copied)
                        run_in_flight(t.starts, t.finish, inflight[case], t.check)
                t = g.pyop_tasks("noop", inflight["noop"], False)
                run_in_flight(t.starts, t.finish, 200)
            if g.ex is not None:
                for case in args.cases:  # the same for the Executor
                    t = g.executor_tasks(case, inflight[case])
                    run_in_flight(t.starts, t.finish, inflight[case], t.check)
                t = g.executor_tasks("noop", inflight["noop"])
                run_in_flight(t.starts, t.finish, 200)
        info["peers"] = {n: p.info for n, p in peers.items()}

        order = [s for s in ("gpuq", "gpuq-copy", "cpp", "pyop", "pyop-copy", "executor", "loky",
                             "ppe", "mp")
                 if (s in systems or (s == "gpuq-copy" and "gpuq" in systems)
                     or (s == "pyop-copy" and "pyop" in systems))
                 and (s in peers or s.startswith("gpuq") or s.startswith("pyop")
                      or s in ("cpp", "executor"))]
        for rnd in range(args.rounds):
            rotated = order[rnd % len(order):] + order[:rnd % len(order)]
            print(f"round {rnd + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for case in args.cases:
                for system in rotated:
                    n_lat = per_round(count(args.counts, case, "latency", system), args.rounds)
                    n_tp = per_round(count(args.counts, case, "throughput", system), args.rounds)
                    k = inflight[case]
                    try:
                        if system == "cpp":
                            if case == "noop":
                                assert g is not None
                                g.cpp_round_trips(max(1, n_lat // 10))
                                gc.collect()
                                res.samples[(case, system)].append(g.cpp_round_trips(n_lat))
                            continue
                        if system in ("gpuq-copy", "pyop-copy") and case == "noop":
                            continue  # no array to copy
                        if system.startswith("gpuq"):
                            assert g is not None
                            tasks = g.tasks(case, k, copied=system == "gpuq-copy")
                        elif system.startswith("pyop"):
                            assert g is not None
                            tasks = g.pyop_tasks(case, k, copied=system == "pyop-copy")
                        elif system == "executor":
                            assert g is not None
                            tasks = g.executor_tasks(case, k)
                        else:
                            tasks = peers[system].tasks(case, k, inputs.get(case))
                        measure_block(res, case, system, tasks, n_lat, n_tp)
                    except Exception as e:  # noqa: BLE001
                        res.fail(system, case, f"round {rnd + 1}", e)
            # A system that failed is not measured again.
            bad = {f["system"] for f in res.failures}
            order = [s for s in order if s not in bad]
            if not order:
                break
        if args.breakdown and g is not None:
            print("breakdown", file=sys.stderr, flush=True)
            for case in args.cases:
                for system in order:
                    if system not in VARIANTS or (system.endswith("-copy") and case == "noop"):
                        continue
                    try:
                        copied = system.endswith("-copy")
                        if system == "executor":
                            tasks = g.executor_tasks(case, 1)
                        elif system.startswith("pyop"):
                            tasks = g.pyop_tasks(case, 1, copied)
                        else:
                            tasks = g.tasks(case, 1, copied)
                        # At most the case's latency count (30 trips of 64 MiB, not 1000).
                        n = min(args.breakdown, count(args.counts, case, "latency", system))
                        if n == 0:
                            continue
                        time_round_trips(tasks.starts[0], tasks.finish, max(1, n // 10))
                        gc.collect()
                        info.setdefault("breakdown", {}).setdefault(case, {})[system] = \
                            time_breakdown(tasks.starts[0], n)
                    except Exception as e:  # noqa: BLE001
                        res.fail(system, case, "breakdown", e)


def run_ray(args: argparse.Namespace, res: Results, inputs: Dict[str, np.ndarray],
            inflight: Dict[str, int], info: Dict[str, Any]) -> None:
    """Ray's phase: start it, measure each case once (its own counts), stop it. Any failure here
    skips Ray with the reason, as does a missing ``ray``."""
    try:
        import ray  # noqa: F401
    except Exception as e:  # noqa: BLE001
        res.skipped["ray"] = f"import ray failed: {type(e).__name__}: {e}"
        return
    try:
        with contextlib.ExitStack() as stack:
            print("ray", file=sys.stderr, flush=True)
            peer = Peer("ray", stack)
            info.setdefault("peers", {})["ray"] = peer.info
            for case in args.cases:
                tasks = peer.tasks(case, inflight[case], inputs.get(case))
                measure_block(res, case, "ray", tasks, count(args.counts, case, "latency", "ray"),
                              count(args.counts, case, "throughput", "ray"))
    except Exception as e:  # noqa: BLE001
        res.skipped["ray"] = f"{type(e).__name__}: {e}"
        traceback.print_exc(file=sys.stderr)
        for key in [k for k in res.samples if k[1] == "ray"]:
            del res.samples[key]
        for key in [k for k in res.windows if k[1] == "ray"]:
            del res.windows[key]


# ---- machine facts -----------------------------------------------------------------------------

def machine_cpu() -> Tuple[float, float]:
    """(busy, stolen) CPU seconds of the whole machine, from /proc/stat."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice_, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice_ + system + irq + softirq) / tick, steal / tick


def own_cpu_s() -> float:
    """CPU seconds of this process and of every descendant it has reaped."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        total += r.ru_utime + r.ru_stime
    return total


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def package_versions(names: Sequence[str] = ("gpuq", "numpy", "loky", "cloudpickle", "ray")
                     ) -> Dict[str, Optional[str]]:
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - Python < 3.8
        return {}
    out: Dict[str, Optional[str]] = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def median(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median of the values that are not None; None when none is."""
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


# ---- a Python pool's figures (bench_batching.py, bench_steps.py) --------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def batch_rows(text: str, op: str) -> Optional[Tuple[float, float]]:
    """(sum, count) of the ``gpuq_batch_rows`` histogram for ``op`` over all workers and pools
    in metrics ``text``, or None when the metrics have no such family."""
    total = count = 0.0
    seen = False
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) not in ("gpuq_batch_rows_sum", "gpuq_batch_rows_count"):
            continue
        labels = m.group(2) or ""
        if 'op="' in labels and f'op="{op}"' not in labels:
            continue
        seen = True
        v = float(m.group(3))
        if m.group(1).endswith("_sum"):
            total += v
        else:
            count += v
    return (total, count) if seen else None


def scrape_batch_rows(runtime_dir: str, op: str) -> Optional[Tuple[float, float]]:
    """batch_rows of the daemon's metrics now; None when they cannot be had."""
    import gpuq
    try:
        return batch_rows(gpuq.metrics(runtime_dir), op)
    except Exception:  # noqa: BLE001 - the batch size is optional
        return None


def worker_cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far (those gone: 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def pool_worker_pids(status: Dict[str, Any], pool: str) -> List[int]:
    """The pids of pool ``pool``'s workers in a daemon's status."""
    return [w["pid"] for p in status.get("pools", []) if p["name"] == pool
            for w in p.get("workers", []) if w.get("pid")]


def source_commit() -> Optional[str]:
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (head + ("-dirty" if dirty else "")) if head else None
    except (OSError, subprocess.SubprocessError):
        return None


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


# ---- report ------------------------------------------------------------------------------------

def _fmt(v: Optional[float], digits: int = 2) -> str:
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def print_tables(res: Results, systems_shown: List[str], inflight: Dict[str, int],
                 cases: Sequence[str]) -> None:
    for case in cases:
        nbytes = CASES[case]
        unit, scale = ("ms", 1e3) if nbytes >= 16 * MIB else ("us", 1.0)
        print(f"\n{CASE_TITLES[case]}: round trip with one in flight ({unit}); throughput with "
              f"{inflight[case]} in flight")
        print(f"  {'system':<26} {'p50':>9} {'p99':>9} {'p99.9':>9} {'mean':>9} {'n':>7}"
              f" {'tasks/s':>11} {'n':>7}")
        for s in systems_shown:
            lat = res.latency(case, s)
            tp = res.throughput(case, s)
            if lat is None and tp is None:
                continue
            cells = [_fmt(lat[k] / scale) if lat else "-"
                     for k in ("p50_us", "p99_us", "p999_us", "mean_us")]
            print(f"  {SYSTEMS[s][0]:<26} {cells[0]:>9} {cells[1]:>9} {cells[2]:>9} {cells[3]:>9}"
                  f" {lat['count'] if lat else '-':>7}"
                  f" {_fmt(tp['tasks_per_s'], 0) if tp else '-':>11}"
                  f" {tp['tasks'] if tp else '-':>7}")


def print_breakdown(bd: Dict[str, Dict[str, Dict[str, Any]]], cases: Sequence[str]) -> None:
    if not bd:
        return
    print("\ngpuq round trips, one in flight, split by the daemon's job stamps (medians, us; "
          "rest = total - submit - queued - run)")
    print(f"  {'case':<6} {'system':<26} {'total':>9} {'submit':>9} {'queued':>9} {'run':>9}"
          f" {'rest':>9} {'n':>6}")
    for case in cases:
        for system, b in bd.get(case, {}).items():
            print(f"  {case:<6} {SYSTEMS[system][0]:<26} " +
                  " ".join(f"{_fmt(b[k]):>9}" for k in ("total_us", "submit_us", "queued_us",
                                                           "run_us", "rest_us")) +
                  f" {b['count']:>6}")


def targets(res: Results, systems: Sequence[str], cases: Sequence[str]) -> List[Dict[str, Any]]:
    """The targets whose systems and case this run measures (by default those of gpuq, cpp
    and loky; with --systems pyop/executor, the Python op's and the Executor's)."""
    def p50(case: str, system: str) -> Optional[float]:
        st = res.latency(case, system)
        return st["p50_us"] if st else None

    def tput(case: str, system: str) -> Optional[float]:
        st = res.throughput(case, system)
        return st["tasks_per_s"] if st else None

    def selected(system: str) -> bool:
        return system in systems or (system.endswith("-copy") and system[:-5] in systems)

    out: List[Dict[str, Any]] = []

    def add(name: str, value: Optional[float], bound: float, upper: bool, headline: bool,
            needs: Tuple[str, ...], unit: str = "", **extra: Any) -> None:
        case, *needed = needs
        if case not in cases or not all(selected(s) for s in needed):
            return
        verdict = None if value is None else (value <= bound if upper else value >= bound)
        out.append({"name": name, "value": value, "bound": bound, "upper_bound": upper,
                    "headline": headline, "unit": unit, "pass": verdict, **extra})

    def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return a / b if a is not None and b else None

    add("loky no-op p50 / gpuq no-op p50", ratio(p50("noop", "loky"), p50("noop", "gpuq")),
        50, False, True, ("noop", "loky", "gpuq"))
    add("loky 64 MiB p50 / gpuq 64 MiB p50 (in segment)",
        ratio(p50("64MiB", "loky"), p50("64MiB", "gpuq")), 10, False, True,
        ("64MiB", "loky", "gpuq"))
    py, cpp = p50("noop", "gpuq"), p50("noop", "cpp")
    add("gpuq no-op p50, Python - C++ client", None if py is None or cpp is None else py - cpp,
        3.0, True, True, ("noop", "gpuq", "cpp"), "us")
    add("loky 64 MiB p50 / gpuq 64 MiB p50 (copied in)",
        ratio(p50("64MiB", "loky"), p50("64MiB", "gpuq-copy")), 10, False, False,
        ("64MiB", "loky", "gpuq-copy"))
    # The Python op's and the Executor's (issue 28, point 3).
    add("loky no-op p50 / gpuq Python op no-op p50",
        ratio(p50("noop", "loky"), p50("noop", "pyop")), 25, False, True,
        ("noop", "loky", "pyop"))
    add("loky no-op p50 / gpuq.Executor no-op p50",
        ratio(p50("noop", "loky"), p50("noop", "executor")), 8, False, True,
        ("noop", "loky", "executor"))
    add("gpuq.Executor no-op tasks/s / multiprocessing.Pool no-op tasks/s",
        ratio(tput("noop", "executor"), tput("noop", "mp")), 3, False, True,
        ("noop", "executor", "mp"))
    # The Python op's 1 MiB: also the p50 that 30x this run's loky p50 asks of it.
    loky1 = p50("1MiB", "loky")
    need = {"loky_p50_us": loky1, "gpuq_p50_needed_us": None if loky1 is None else loky1 / 30}
    add("loky 1 MiB p50 / gpuq Python op 1 MiB p50 (in segment)",
        ratio(loky1, p50("1MiB", "pyop")), 30, False, True, ("1MiB", "loky", "pyop"),
        gpuq_p50_us=p50("1MiB", "pyop"), **need)
    add("loky 1 MiB p50 / gpuq Python op 1 MiB p50 (copied in)",
        ratio(loky1, p50("1MiB", "pyop-copy")), 30, False, False, ("1MiB", "loky", "pyop-copy"),
        gpuq_p50_us=p50("1MiB", "pyop-copy"), **need)
    return out


def speedups(res: Results, cases: Sequence[str]
             ) -> Dict[str, Dict[str, Dict[str, Optional[float]]]]:
    """peer -> case -> {p50: peer p50 / gpuq p50, throughput: gpuq / peer, and the same for the
    other variants measured (keys suffixed as in VARIANTS: _copied, _pyop, _pyop_copied,
    _executor)}."""
    out: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    measured = [v for v in VARIANTS
                if any(res.latency(c, v) or res.throughput(c, v) for c in cases)]
    for peer in PEERS:
        for case in cases:
            row: Dict[str, Optional[float]] = {}
            for variant in measured:
                key = VARIANTS[variant]
                a, b = res.latency(case, peer), res.latency(case, variant)
                row["p50" + key] = a["p50_us"] / b["p50_us"] if a and b else None
                ta, tb = res.throughput(case, peer), res.throughput(case, variant)
                row["throughput" + key] = tb["tasks_per_s"] / ta["tasks_per_s"] \
                    if ta and tb else None
            if any(v is not None for v in row.values()):
                out.setdefault(peer, {})[case] = row
    return out


def print_report(res: Results, tgts: List[Dict[str, Any]], ups: Dict[str, Any],
                 cases: Sequence[str]) -> None:
    for title, key in (("gpuq", ""), ("gpuq Python op", "_pyop"), ("gpuq.Executor", "_executor")):
        if not any(r.get("p50" + key) is not None or r.get("throughput" + key) is not None
                   for by_case in ups.values() for r in by_case.values()):
            continue
        how = " (array copied in, as the peers' is)" if key == "_executor" else \
            " (in segment; copied in)"
        print(f"\n{title}'s advantage: peer p50 / {title} p50, and {title} tasks/s / peer "
              f"tasks/s{how}")
        print(f"  {'peer':<24} " + " ".join(f"{c + ' ' + m:>19}" for c in cases
                                              for m in ("p50", "tput")))
        for peer, by_case in ups.items():
            cells = []
            for case in cases:
                r = by_case.get(case, {})
                for m in ("p50", "throughput"):
                    a, b = r.get(m + key), r.get(m + key + "_copied")
                    cells.append((_fmt(a, 1) if a is not None else "-") +
                                 ("; " + _fmt(b, 1) if b is not None else ""))
            print(f"  {SYSTEMS[peer][0]:<24} " + " ".join(f"{c:>19}" for c in cells))
    if tgts:
        print(f"\n  {'target':<66} {'measured':>9} {'goal':>9}  result")
    for t in tgts:
        goal = f"{'<=' if t['upper_bound'] else '>='} {t['bound']:g}{t['unit']}"
        value = "-" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
        verdict = "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        name = t["name"] if t["headline"] else "(shown) " + t["name"]
        print(f"  {name:<66} {value:>9} {goal:>9}  {verdict}")
        if t.get("gpuq_p50_needed_us") is not None and t.get("gpuq_p50_us") is not None:
            print(f"      gpuq Python op p50 {t['gpuq_p50_us']:.1f} us; {t['bound']:g}x this run's "
                  f"loky p50 ({t['loky_p50_us']:,.0f} us) needs <= "
                  f"{t['gpuq_p50_needed_us']:.1f} us")


# ---- main --------------------------------------------------------------------------------------

def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="gpuq's Python client against loky, ProcessPoolExecutor, multiprocessing.Pool "
                    "and Ray: no-op and array round trips and throughput (see the module "
                    "docstring and BENCHMARKS.md).")
    p.add_argument("--gpuqd", default=os.environ.get("GPUQ_GPUQD")
                   or os.path.join(REPO, "build", "daemon", "gpuqd"),
                   help="the gpuqd binary (default: $GPUQ_GPUQD, else <repo>/build/daemon/gpuqd)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run with small counts and one round (its figures mean nothing); "
                        "writes no JSON unless --json is given")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated, of {','.join(SELECTABLE)} (default: "
                        f"{','.join(DEFAULT_SYSTEMS)}; pyop, gpuq's Python ops, and executor, "
                        "gpuq.Executor, only when named)")
    p.add_argument("--cases", default=",".join(CASES),
                   help=f"comma-separated, of {','.join(CASES)} (default: all)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds over all systems (default 3; 1 with --quick); counts are totals")
    p.add_argument("--inflight", type=int, default=10 * WORKERS,
                   help="tasks in flight for throughput, no-op and 1 MiB (default 20)")
    p.add_argument("--inflight-large", type=int, default=2 * WORKERS,
                   help="tasks in flight for 64 MiB throughput (default 4: gpuq holds an out "
                        "array per task in flight in its segment, at most 1 GiB)")
    p.add_argument("--count", action="append", default=[], metavar="CASE.MEASURE.TIER=N",
                   help="override a count, e.g. noop.latency.peer=5000 (CASE: noop, 1MiB, "
                        "64MiB; MEASURE: latency, throughput; TIER: gpuq (gpuq, copied-in and "
                        "C++), pyop (Python ops, both variants, and gpuq.Executor), peer "
                        "(loky, ppe, mp), ray); repeatable")
    p.add_argument("--json", metavar="PATH",
                   help="results file (default bench/results/python-<UTC date>.json; "
                        "python-ops-<UTC date>.json when --systems names pyop or executor)")
    p.add_argument("--no-json", action="store_true", help="write no results file")
    p.add_argument("--breakdown", type=int, default=None, metavar="N",
                   help="after the rounds, N more round trips of each gpuq variant (not C++; "
                        "the Executor included) and case, split into submit call, queued, run "
                        "and rest by the "
                        "daemon's job stamps (default 1000; 100 with --quick; at most the "
                        "case's latency count; 0: none)")
    p.add_argument("--samples", action="store_true",
                   help="store every round trip's nanoseconds in the JSON")
    a = p.parse_args(argv)
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in a.systems:
        if s not in SELECTABLE:
            p.error(f"--systems: unknown system {s!r} (known: {', '.join(SELECTABLE)})")
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    for c in cases:
        if c not in CASES:
            p.error(f"--cases: unknown case {c!r} (known: {', '.join(CASES)})")
    if not cases:
        p.error("--cases: name at least one case")
    a.cases = [c for c in CASES if c in cases]  # in CASES' order
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    if a.breakdown is None:
        a.breakdown = 100 if a.quick else 1000
    if a.breakdown < 0:
        p.error("--breakdown must be >= 0")
    if a.rounds < 1 or a.inflight < 1 or a.inflight_large < 1:
        p.error("--rounds, --inflight and --inflight-large must be >= 1")
    a.counts = json.loads(json.dumps(QUICK_COUNTS if a.quick else COUNTS))
    for item in a.count:
        try:
            key, n = item.split("=")
            case, measure, tier = key.split(".")
            if tier not in a.counts[case][measure] or int(n) < 0:
                raise KeyError(tier)
            a.counts[case][measure][tier] = int(n)
        except (ValueError, KeyError):
            p.error(f"--count: bad {item!r} (want CASE.MEASURE.TIER=N, e.g. "
                    "noop.latency.peer=5000)")
    return a


def _default_sigterm() -> None:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except ValueError:  # only the main thread may; a child of fork() runs in its main thread
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so that the daemon and the pools are stopped. Forked pool
    # workers must not inherit the handler: Pool.terminate() retires them with SIGTERM, and a
    # worker that catches it can stay blocked on the queue's lock, hanging the parent's join.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_default_sigterm)

    date = datetime.datetime.now(datetime.timezone.utc)
    inflight = {"noop": args.inflight, "1MiB": args.inflight, "64MiB": args.inflight_large}
    rng = np.random.default_rng(1)
    inputs = {case: rng.random(nbytes // 4, dtype=np.float32)
              for case, nbytes in CASES.items() if nbytes and case in args.cases}
    res = Results(args.samples)
    info: Dict[str, Any] = {}
    non_ray = [s for s in args.systems if s != "ray"]

    load_start = load_average()
    busy0, steal0 = machine_cpu()
    own0 = own_cpu_s()
    t_start = time.perf_counter()
    print(f"bench_python: {os.cpu_count()} CPUs ({cpu_model()}), Python "
          f"{platform.python_version()}, gpuqd {args.gpuqd}, {args.rounds} round(s)"
          f"{', quick' if args.quick else ''}", file=sys.stderr, flush=True)
    try:
        if non_ray:
            run_rounds(args, res, inputs, inflight, non_ray, info)
        if "ray" in args.systems:
            run_ray(args, res, inputs, inflight, info)
    except Exception as e:  # noqa: BLE001 - e.g. the daemon did not start
        res.fail("-", "-", "run", e)
    wall = time.perf_counter() - t_start
    busy1, steal1 = machine_cpu()
    own = own_cpu_s() - own0
    other = max(0.0, busy1 - busy0 - own)
    ncpu = os.cpu_count() or 1
    load_end = load_average()

    shown = [s for s in SYSTEMS
             if s in args.systems or (s.endswith("-copy") and s[:-5] in args.systems)]
    print(f"\nload average at start {load_start}, at end {load_end}")
    print(f"run {wall:.1f} s wall; CPU time: this benchmark and its processes {own:.1f} s, other "
          f"processes {other:.1f} s ({100 * other / (wall * ncpu):.0f}% of the machine), stolen "
          f"{steal1 - steal0:.1f} s")
    print_tables(res, shown, inflight, args.cases)
    tgts = targets(res, args.systems, args.cases)
    ups = speedups(res, args.cases)
    print_report(res, tgts, ups, args.cases)
    print_breakdown(info.get("breakdown", {}), args.cases)
    for name, why in res.skipped.items():
        print(f"\nSKIPPED {name}: {why}")
    for f in res.failures:
        print(f"FAILURE {f['system']} {f['case']} {f['what']}: {f['error']}")

    if not args.no_json and (args.json or not args.quick):
        stem = "python-ops" if any(s in args.systems for s in PY_POOL_SYSTEMS) else "python"
        path = args.json or os.path.join(REPO, "bench", "results",
                                         f"{stem}-{date.strftime('%Y-%m-%d')}.json")
        doc = {
            "benchmark": "bench_python",
            "date": date.strftime("%Y-%m-%d"),
            "timestamp_utc": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join([sys.executable] + sys.argv),
            "hostname": socket.gethostname(),
            "machine": {"nproc": os.cpu_count(),
                        "nproc_usable": len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else None,
                        "cpu_model": cpu_model(),
                        "kernel": " ".join(platform.uname()[2:4]),
                        "python": sys.version,
                        "packages": package_versions(),
                        "multiprocessing_start_method": multiprocessing.get_start_method()},
            "source_commit": source_commit(),
            "gpuqd": args.gpuqd,
            "daemon_config": daemon_config(args.systems),
            "workers": WORKERS,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "interference": {"wall_s": wall, "own_cpu_s": own, "other_processes_cpu_s": other,
                             "other_processes_share": other / (wall * ncpu),
                             "steal_s": steal1 - steal0},
            "parameters": {"quick": args.quick, "rounds": args.rounds, "inflight": inflight,
                           "counts": args.counts, "systems": args.systems, "cases": args.cases,
                           "breakdown": args.breakdown,
                           "array_dtype": "float32",
                           "array_bytes": {c: n for c, n in CASES.items()
                                           if n and c in args.cases}},
            "results": {case: {s: {"latency": res.latency(case, s),
                                   "throughput": res.throughput(case, s)}
                               for s in shown
                               if res.latency(case, s) or res.throughput(case, s)}
                        for case in args.cases},
            "speedups": ups,
            "targets": tgts,
            "all_targets_met": all(t["pass"] for t in tgts if t["headline"]),
            "skipped": res.skipped,
            "failures": res.failures,
            **info,
        }
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"\nresults: {path}")
    return 1 if res.failures else 0


if __name__ == "__main__":
    sys.exit(main())
