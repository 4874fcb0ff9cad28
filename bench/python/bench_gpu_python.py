#!/usr/bin/env python3
"""Python on the GPU, side by side: a small torch model called through a gpu Python pool from
1, 4 and 16 client processes, against each process loading the model on the GPU itself; and a
torch no-op op against the same call in-process (issue 26, point 3). One run, one machine.

The model: an MLP 512-1024-1024-10, float32, fixed seed (bench_gpu_python_ops.py), TF32 off,
8 rows per request (--rows), each client process its own fixed input (seed 1000 + its index).

Setup: a private gpuqd (``gpuq.testing.Daemon``) with one gpu Python pool ``models`` on GPU 0,
--workers-per-gpu workers (default 2: one worker serializes every client's calls, Python and
launches included, so a second lets one worker's Python overlap the other's GPU work, for one
more CUDA context and copy of the model), ``memory_limit`` --memory-limit (0.4 of the device
each, so that 2 workers and their contexts fit in it), no fallback: a missing GPU fails the run
instead of running on the CPU. Its workers (this interpreter) import bench_gpu_python_ops.py,
build the model on their GPU in ``on_start`` and run one forward pass before they serve. The
pool's ``runs_on`` (client.pools) and each worker's ``mlp_info`` (device, GPU name) are checked
and recorded. ``--model numpy --device cpu`` runs the same plumbing on a cpu pool with the MLP
in numpy: a smoke test for a machine without a GPU (its figures mean nothing).

Per client count N (--clients, 1,4,16), two configurations, each with N fresh processes
(``multiprocessing``, spawn), started at once:
  gpuq     each process imports gpuq (never torch: checked, with whether libcuda is mapped),
           connects, makes its input with ``client.array`` (zero copy) and calls
           ``client.call("mlp", x, pool="models")``;
  direct   each process imports torch, builds the same model on cuda:0 itself and calls it
           (``net(torch.from_numpy(x).cuda()).cpu().numpy()``). It imports the model's code
           from bench_gpu_python_ops.py, which imports gpuq too (about 40 ms; no connection).
Time to first result: from the parent's clock (CLOCK_MONOTONIC) just before it starts the
process to the first result in the process's hands, median and max over the N; the JSON splits
it into interpreter start, imports, connect or model build, first call. Then, when all N are
ready, a closed loop (one request in flight per process) for --warmup (0.3 s) and the measured
window (--duration, 2 s): results/s (requests ending in the window over its length), p50 and
p99 latency (nearest rank over all processes' requests in the window).

Device memory: ``nvidia-smi --query-gpu=memory.used`` (GPU 0) before the daemon starts
(baseline), once its workers are ready, and every 0.2 s during each window (the maximum
counts). gpuq's figure is the window's maximum less the baseline (the daemon's workers: the
clients hold no CUDA context); direct's, the window's maximum less the reading just before its
processes started (the idle daemon is there throughout). After a direct configuration the
parent waits (10 s at most) for the memory to come back, and records whether it did. Without
nvidia-smi, or on --device cpu, memory figures are null.

No-op: one client (this process) calls ``client.call("torch_noop", x, pool="models")``
--noop-calls times after 200 warm-up calls, each timed with ``time.perf_counter_ns``, against
the same Python function called in this process as many times: p50, p99, overhead (p50
difference) in us.

Correctness: the first result of gpuq process i must equal that of direct process i for the
same input (``np.allclose``, rtol 1e-4, atol 1e-5); each process's last result in the loop must
equal its first.

Usage, in a venv with ``pip install ./python numpy torch`` (torch with CUDA)::

    GPUQ_GPUQD=build/daemon/gpuqd python bench/python/bench_gpu_python.py --json FILE

It prints progress on stderr and the table last on stdout. About a minute on an idle machine
with one GPU; --budget (110 s) skips the configurations not started by then (a failure). The
parent imports torch first (no CUDA context), so the page cache is warm for every process that
follows. ``--json FILE`` writes every figure, per process too, with the machine's facts. Exit
status: 0 when everything ran and every check passed, 1 on a failure, 2 on bad arguments, 77
when --device cuda is asked and torch or CUDA is missing (skipped).
"""

from __future__ import annotations

import argparse
import array
import datetime
import importlib
import importlib.util
import json
import math
import multiprocessing
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS_DIR = os.path.dirname(os.path.abspath(__file__))
POOL = "models"
RTOL, ATOL = 1e-4, 1e-5
MODES = ("gpuq", "direct")


def percentile(sorted_ns: Sequence[int], p: float) -> Optional[float]:
    """Nearest-rank percentile of sorted nanoseconds, in microseconds."""
    if not sorted_ns:
        return None
    return sorted_ns[max(1, math.ceil(p / 100.0 * len(sorted_ns))) - 1] / 1e3


def median(values: Sequence[Optional[float]]) -> Optional[float]:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else None


# ---- the client processes ----------------------------------------------------------------------

def _libcuda_mapped() -> bool:
    with open("/proc/self/maps") as f:
        return any("libcuda.so" in line for line in f)


def client_main(mode: str, index: int, spawned_ns: int, runtime_dir: str, model: str,
                device: str, shape: Tuple[int, int], conn: Any) -> None:
    """A client process: its first result (with the times of its stages) to the parent, then
    one closed loop on ("run", t0, begin, end), then exits on ("stop",)."""
    clock = time.monotonic_ns
    began = clock()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    try:
        if mode == "gpuq":
            import gpuq
            imported = clock()
            client = gpuq.connect(runtime_dir, name=f"bench_gpu_python_{index}")
            x = client.array(np.random.default_rng(1000 + index).standard_normal(shape)
                             .astype(np.float32))
            ready = clock()

            def call() -> Any:
                return client.call("mlp", x, pool=POOL)
        else:
            torch = importlib.import_module("torch") if model == "torch" else None
            import bench_gpu_python_ops as ops
            imported = clock()
            forward, _ = ops.build_forward(model, device)
            if torch is not None and device == "cuda":
                torch.cuda.synchronize()
            x = np.random.default_rng(1000 + index).standard_normal(shape).astype(np.float32)
            ready = clock()

            def call() -> Any:
                return forward(x)
        first = np.array(call())
        done = clock()
        conn.send(("ready", {"spawned_ns": spawned_ns, "began_ns": began,
                             "imported_ns": imported, "ready_ns": ready, "first_ns": done},
                   first))
        cmd = conn.recv()
        if cmd[0] != "run":
            return
        _, t0, begin, end = cmd
        lat = array.array("q")
        wait = (t0 - clock()) / 1e9
        if wait > 0:
            time.sleep(wait)
        n_all = 0
        while True:
            t1 = clock()
            r = call()
            t2 = clock()
            n_all += 1
            if t2 > end:
                break
            if t2 >= begin:
                lat.append(t2 - t1)
        ok = bool(np.allclose(r, first, rtol=RTOL, atol=ATOL))
        r = None
        conn.send(("done", lat.tobytes(), n_all, ok, "torch" in sys.modules, _libcuda_mapped()))
        conn.recv()  # ("stop",)
        if mode == "gpuq":
            client.close()
    except BaseException:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass


def receive(conn: Any, deadline: float, what: str) -> Any:
    if not conn.poll(max(0.0, deadline - time.monotonic())):
        raise RuntimeError(f"{what}: no answer in time")
    try:
        msg = conn.recv()
    except EOFError:
        raise RuntimeError(f"{what}: the process exited") from None
    if msg[0] == "error":
        print(f"{what}:\n{msg[1]}", file=sys.stderr, flush=True)
        raise RuntimeError(f"{what} failed: {msg[1].strip().splitlines()[-1]}")
    return msg


# ---- device memory -----------------------------------------------------------------------------

def nvidia_smi(query: str) -> Optional[List[str]]:
    """One row of ``nvidia-smi --query-gpu=QUERY`` for GPU 0, or None."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-i", "0", f"--query-gpu={query}",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return [v.strip() for v in out.stdout.strip().splitlines()[0].split(",")]


def memory_used_mib(enabled: bool) -> Optional[float]:
    row = nvidia_smi("memory.used") if enabled else None
    try:
        return float(row[0]) if row else None
    except ValueError:
        return None


class MemorySampler:
    """memory.used every 0.2 s from a thread, between start() and stop()."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.samples: List[float] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _run(self) -> None:
        while not self._stop.is_set():
            v = memory_used_mib(True)
            if v is not None:
                self.samples.append(v)
            self._stop.wait(0.2)

    def start(self) -> None:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()

    def stop(self) -> Optional[float]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        return max(self.samples) if self.samples else None


# ---- one configuration -------------------------------------------------------------------------

def run_config(mode: str, n: int, args: argparse.Namespace, runtime_dir: str,
               in_features: int, baseline: Optional[float]) -> Dict[str, Any]:
    """N fresh processes of one mode: their first results and stage times, then one window."""
    mem_on = args.device == "cuda"
    before = memory_used_mib(mem_on)
    ctx = multiprocessing.get_context("spawn")
    procs: List[Any] = []
    conns: List[Any] = []
    sampler = MemorySampler(mem_on)
    try:
        for i in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=client_main, name=f"bench_gpu_python_{mode}_{i}", daemon=True,
                            args=(mode, i, time.monotonic_ns(), runtime_dir, args.model,
                                  args.device, (args.rows, in_features), child))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + args.start_timeout
        readies = [receive(c, deadline, f"{mode} process {i} start") for i, c in enumerate(conns)]
        clock = time.monotonic_ns
        t0 = clock() + 100_000_000
        begin = t0 + int(args.warmup * 1e9)
        end = begin + int(args.duration * 1e9)
        for c in conns:
            c.send(("run", t0, begin, end))
        time.sleep(max(0.0, (begin - clock()) / 1e9))
        sampler.start()
        time.sleep(max(0.0, (end - clock()) / 1e9))
        peak = sampler.stop()
        deadline = time.monotonic() + 60
        dones = [receive(c, deadline, f"{mode} process {i} run") for i, c in enumerate(conns)]
        for c in conns:
            c.send(("stop",))
    finally:  # a process still waiting for a command reads EOF and exits
        sampler.stop()
        for c in conns:
            c.close()
        deadline = time.monotonic() + 20
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    released = after = None
    if mode == "direct" and before is not None:
        stop_at = time.monotonic() + 10
        while True:
            after = memory_used_mib(mem_on)
            released = after is not None and after <= before + 64
            if released or time.monotonic() > stop_at:
                break
            time.sleep(0.2)
    lat: List[int] = []
    for d in dones:
        a = array.array("q")
        a.frombytes(d[1])
        lat.extend(a)
    lat.sort()
    stages = [r[1] for r in readies]
    ms = [(s["first_ns"] - s["spawned_ns"]) / 1e6 for s in stages]
    ref = baseline if mode == "gpuq" else before
    return {
        "mode": mode, "clients": n,
        "ttfr_ms_median": median(ms), "ttfr_ms_max": max(ms), "ttfr_ms": ms,
        "stages_ms_median": {
            name: median([(s[b] - s[a]) / 1e6 for s in stages])
            for name, a, b in (("interpreter_start", "spawned_ns", "began_ns"),
                               ("imports", "began_ns", "imported_ns"),
                               ("connect_or_build", "imported_ns", "ready_ns"),
                               ("first_call", "ready_ns", "first_ns"))},
        "results_per_s": len(lat) / args.duration, "rows_per_s": len(lat) * args.rows
        / args.duration, "requests_in_window": len(lat), "requests_all": sum(d[2] for d in dones),
        "p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
        "last_results_ok": all(d[3] for d in dones),
        "torch_in_clients": [d[4] for d in dones], "libcuda_in_clients": [d[5] for d in dones],
        "memory_before_mib": before, "memory_window_max_mib": peak,
        "memory_samples": len(sampler.samples),
        "memory_mib": peak - ref if peak is not None and ref is not None else None,
        "memory_after_mib": after, "memory_released": released,
        "first_results": [r[2] for r in readies],  # for the check; left out of the JSON
    }


# ---- the no-op ---------------------------------------------------------------------------------

def time_noop(client: Any, ops: Any, rows: int, count: int) -> Dict[str, Any]:
    host = np.random.default_rng(7).standard_normal((rows, ops.IN)).astype(np.float32)
    x = client.array(host)
    clock = time.perf_counter_ns
    out: Dict[str, Any] = {"calls": count}
    for name, fn in (("gpuq", lambda: client.call("torch_noop", x, pool=POOL)),
                     ("in_process", lambda: ops.torch_noop(host))):
        for _ in range(200):
            fn()
        lat = []
        for _ in range(count):
            t1 = clock()
            fn()
            lat.append(clock() - t1)
        lat.sort()
        out[name] = {"p50_us": percentile(lat, 50), "p99_us": percentile(lat, 99),
                     "mean_us": sum(lat) / len(lat) / 1e3}
    out["overhead_us_p50"] = out["gpuq"]["p50_us"] - out["in_process"]["p50_us"]
    out["overhead_us_p99"] = out["gpuq"]["p99_us"] - out["in_process"]["p99_us"]
    out["ratio_p50"] = out["gpuq"]["p50_us"] / out["in_process"]["p50_us"] \
        if out["in_process"]["p50_us"] else None
    return out


# ---- setup, report -----------------------------------------------------------------------------

def config_failures(r: Dict[str, Any]) -> List[str]:
    what = f"{r['mode']} {r['clients']} clients"
    out = []
    if not r["requests_in_window"]:
        out.append(f"{what}: no request in the window")
    if not r["last_results_ok"]:
        out.append(f"{what}: a process's last result differs from its first")
    if r["mode"] == "gpuq" and any(r["torch_in_clients"]):
        out.append(f"{what}: a client process imported torch")
    if r["memory_released"] is False:
        out.append(f"{what}: device memory not back ({r['memory_after_mib']} MiB after, "
                   f"{r['memory_before_mib']} MiB before)")
    return out


def compare(configs: Dict[str, Dict[str, Dict[str, Any]]], shape: Tuple[int, int],
            failures: List[str]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """gpuq's first results against direct's for the same inputs (appending to failures), and
    the ratios gpuq / direct per client count. Drops the results from configs."""
    compared, worst = 0, 0.0
    ratios: Dict[str, Any] = {}
    for n, g in configs["gpuq"].items():
        dr = configs["direct"].get(n)
        if dr is None:
            continue
        for i, (a, b) in enumerate(zip(g["first_results"], dr["first_results"])):
            compared += 1
            if a.shape != shape or b.shape != shape or not np.allclose(a, b, rtol=RTOL, atol=ATOL):
                failures.append(f"correctness: {n} clients, input {i}: gpuq's mlp result "
                                f"{a.shape} differs from the in-process model's {b.shape}")
            else:
                worst = max(worst, float(np.max(np.abs(a - b))))
        ratios[n] = {k: g[key] / dr[key] if g[key] is not None and dr[key] else None
                     for k, key in (("results_per_s", "results_per_s"),
                                    ("ttfr_median", "ttfr_ms_median"),
                                    ("ttfr_max", "ttfr_ms_max"), ("memory", "memory_mib"))}
    if compared == 0 and not failures:
        failures.append("correctness: no gpuq result was compared with a direct one")
    for by_n in configs.values():
        for r in by_n.values():
            r.pop("first_results", None)
    return ratios, {"compared": compared, "max_abs_diff": worst, "rtol": RTOL, "atol": ATOL,
                    "last_results_ok": all(r["last_results_ok"] for by_n in configs.values()
                                           for r in by_n.values())}


def cuda_unavailable() -> Optional[str]:
    """Why torch on CUDA cannot run here, or None. Imports torch; creates no CUDA context."""
    if importlib.util.find_spec("torch") is None:
        return f"torch is not installed for {sys.executable}"
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # no CUDA init in the parent
    import torch
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable CUDA "
                "device")
    return None


def daemon_config(args: argparse.Namespace) -> Dict[str, Any]:
    pool: Dict[str, Any] = {"name": POOL, "kind": "cpu", "workers": args.workers_per_gpu}
    if args.device == "cuda":
        pool = {"name": POOL, "kind": "gpu", "gpus": [0], "workers_per_gpu": args.workers_per_gpu,
                "memory_limit": args.memory_limit, "fallback": "none"}
    pool["python"] = {"interpreter": sys.executable, "modules": ["bench_gpu_python_ops"],
                      "path": [OPS_DIR],
                      "env": {"BENCH_GPU_PYTHON_MODEL": args.model,
                              "BENCH_GPU_PYTHON_DEVICE": args.device}}
    return {"pools": [pool]}


def wait_for_pool(d: Any, timeout: float) -> None:
    """Until every worker of the pool is ready; raises at once when the pool is unavailable (no
    GPU: no fallback here) or a worker failed to start, with the daemon's reason."""
    deadline = time.monotonic() + timeout
    while True:
        pool = next((p for p in d.status().get("pools", []) if p["name"] == POOL), {})
        why = None
        if pool.get("status") == "unavailable":
            why = f"pool {POOL} is unavailable: {pool.get('reason')}"
        elif pool.get("status") == "ready":
            return
        elif any(w.get("state") == "failed" for w in pool.get("workers", [])):
            why = f"pool {POOL}: a worker failed to start ({pool.get('reason')})"
        elif time.monotonic() > deadline:
            why = f"pool {POOL} not ready within {timeout:g} s ({pool.get('reason')})"
        if why is not None:
            print(f"{why}; the daemon's log, last lines:\n{d.log()[-6000:]}", file=sys.stderr)
            raise RuntimeError(why + " (the daemon's log is on stderr)")
        time.sleep(0.05)


def check_pool(client: Any, args: argparse.Namespace) -> Dict[str, Any]:
    """The pool's entry in client.pools and its workers' mlp_info; raises when it would not run
    the model where asked."""
    entry = next(p for p in client.pools if p["name"] == POOL)
    if not entry.get("available", True):
        raise RuntimeError(f"pool {POOL} is unavailable: {entry.get('unavailable_reason')}")
    if entry.get("runs_on") not in (None, POOL):
        raise RuntimeError(f"pool {POOL} runs on {entry['runs_on']!r}, not on itself")
    futures = [client.submit_call("mlp_info", pool=POOL) for _ in range(8 * args.workers_per_gpu)]
    workers = {json.dumps(f.result(), sort_keys=True) for f in futures}
    info = [json.loads(w) for w in sorted(workers)]
    want = "cuda" if args.device == "cuda" else "cpu"
    if any(not str(w.get("device", "")).startswith(want) or w.get("model") != args.model
           for w in info):
        raise RuntimeError(f"the workers' models are not {args.model} on {want}: {info}")
    return {"pool": entry, "workers_seen": info}


def _fmt(v: Optional[float], digits: int = 1, suffix: str = "") -> str:
    if v is None:
        return "-"
    return (f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}f}") + suffix


def print_report(doc: Dict[str, Any]) -> None:
    p, m = doc["parameters"], doc["memory"]
    gpu = doc["machine"]["gpu"] or {}
    print(f"\nMLP 512-1024-1024-10 float32, {p['rows']} rows/request, {p['model']} on {p['device']}"
          f" ({gpu.get('name', 'no GPU')}); pool {POOL}: {p['workers_per_gpu']} workers"
          f"{', memory_limit %g' % p['memory_limit'] if p['device'] == 'cuda' else ''}; "
          f"{p['duration_s']:g} s windows")
    print(f"device memory used: {_fmt(m['baseline_mib'], 0)} MiB before the daemon, its idle "
          f"workers {_fmt(m['daemon_idle_mib'], 0)} MiB more; daemon start "
          f"{_fmt(doc['daemon_start_s'], 2)} s")
    nz = doc.get("noop")
    if nz:
        print(f"torch no-op, one client, p50/p99 us: gpuq {_fmt(nz['gpuq']['p50_us'])}/"
              f"{_fmt(nz['gpuq']['p99_us'])}, in-process {_fmt(nz['in_process']['p50_us'], 2)}/"
              f"{_fmt(nz['in_process']['p99_us'], 2)}; overhead {_fmt(nz['overhead_us_p50'])} us "
              f"(x{_fmt(nz['ratio_p50'], 0)})")
    print(f"\n  {'N':>3} {'mode':<7} {'ttfr med ms':>11} {'ttfr max ms':>11} {'results/s':>10}"
          f" {'p50 us':>8} {'p99 us':>8} {'mem MiB':>8}  clients: torch/libcuda")
    for n in p["clients"]:
        for mode in MODES:
            r = doc["configs"][mode].get(str(n))
            if r is None:
                print(f"  {n:>3} {mode:<7} (did not run)")
                continue
            print(f"  {n:>3} {mode:<7} {_fmt(r['ttfr_ms_median'], 0):>11} "
                  f"{_fmt(r['ttfr_ms_max'], 0):>11} {_fmt(r['results_per_s'], 0):>10} "
                  f"{_fmt(r['p50_us']):>8} {_fmt(r['p99_us']):>8} {_fmt(r['memory_mib'], 0):>8}"
                  f"  {sum(r['torch_in_clients'])}/{sum(r['libcuda_in_clients'])} of {n}")
    print("  (ttfr: time to first result from process start; mem: gpuq, the daemon's workers; "
          "direct, the N processes)")
    print(f"\n  gpuq / direct: {'N':>3} {'results/s':>10} {'ttfr median':>12} {'memory':>8}")
    for n, r in doc["ratios"].items():
        print(f"  {'':<14} {n:>3} {_fmt(r['results_per_s'], 2, 'x'):>10} "
              f"{_fmt(r['ttfr_median'], 3, 'x'):>12} {_fmt(r['memory'], 2, 'x'):>8}")
    c = doc.get("correctness") or {}
    if c:
        print(f"\ncorrectness: gpuq == direct for {c['compared']} inputs (max abs diff "
              f"{c['max_abs_diff']:.3g}); last results == first: {c['last_results_ok']}")
    for f in doc["failures"]:
        print(f"FAILURE {f}")


def package_versions() -> Dict[str, Optional[str]]:
    from importlib import metadata
    out: Dict[str, Optional[str]] = {}
    for name in ("gpuq", "numpy", "torch"):
        try:
            out[name] = metadata.version(name)
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="A small torch model through a gpu Python pool from 1, 4 and 16 client "
                    "processes against each process loading it on the GPU, and a no-op op "
                    "against the same call in-process (see the module docstring).")
    p.add_argument("--gpuqd", default=os.environ.get("GPUQ_GPUQD")
                   or os.path.join(REPO, "build", "daemon", "gpuqd"),
                   help="the gpuqd binary (default: $GPUQ_GPUQD, else <repo>/build/daemon/gpuqd)")
    p.add_argument("--model", choices=("torch", "numpy"), default="torch")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--clients", default="1,4,16", help="client process counts (default 1,4,16)")
    p.add_argument("--rows", type=int, default=8, help="rows per request (default 8)")
    p.add_argument("--duration", type=float, default=2.0, help="measured seconds (default 2)")
    p.add_argument("--warmup", type=float, default=0.3, help="seconds before each window (0.3)")
    p.add_argument("--noop-calls", type=int, default=5000, help="timed no-op calls (5000)")
    p.add_argument("--workers-per-gpu", type=int, default=2, help="the pool's workers (2)")
    p.add_argument("--memory-limit", type=float, default=0.4,
                   help="the gpu pool's memory_limit per worker (default 0.4 of the device)")
    p.add_argument("--start-timeout", type=float, default=120.0,
                   help="seconds for N processes to get their first result (default 120)")
    p.add_argument("--budget", type=float, default=110.0,
                   help="seconds after which no further configuration starts (default 110)")
    p.add_argument("--json", metavar="FILE", help="write every figure and the machine's facts")
    a = p.parse_args(argv)
    try:
        a.clients = sorted({int(c) for c in a.clients.split(",") if c.strip()})
    except ValueError:
        p.error(f"--clients: bad list {a.clients!r}")
    if not a.clients or a.clients[0] < 1 or a.clients[-1] > 60:
        p.error("--clients: from 1 to 60 each")
    if a.duration <= 0 or a.warmup < 0 or a.rows < 1 or a.noop_calls < 1 \
            or not 1 <= a.workers_per_gpu <= 64 or not 0 < a.memory_limit <= 1:
        p.error("bad --duration, --warmup, --rows, --noop-calls, --workers-per-gpu or "
                "--memory-limit")
    if a.model == "numpy" and a.device == "cuda":
        p.error("--model numpy runs on the CPU only: add --device cpu")
    if a.model == "torch" and a.device == "cpu" and importlib.util.find_spec("torch") is None:
        p.error("--model torch: this interpreter cannot import torch")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    if args.device == "cuda":
        why = cuda_unavailable()
        if why is not None:
            print(f"bench_gpu_python: skipped: --device cuda, but {why}", file=sys.stderr)
            return 77
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop children, daemon
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # direct processes: GPU 0 as nvidia-smi's
    import gpuq
    import gpuq.testing

    import bench_gpu_python_ops as ops
    ops.use(args.model)  # the in-process no-op: torch on the CPU here, never CUDA
    date = datetime.datetime.now(datetime.timezone.utc)
    mem_on = args.device == "cuda"
    gpu_row = nvidia_smi("name,driver_version,memory.total") if mem_on else None
    gpu = dict(zip(("name", "driver_version", "memory_total_mib"), gpu_row)) if gpu_row else None
    config = daemon_config(args)
    failures: List[str] = []
    configs: Dict[str, Dict[str, Dict[str, Any]]] = {m: {} for m in MODES}
    doc: Dict[str, Any] = {"memory": {"baseline_mib": memory_used_mib(mem_on),
                                      "daemon_idle_mib": None}, "daemon_start_s": None}
    print(f"bench_gpu_python: {args.model} on {args.device} ({gpu or 'no GPU'}), clients "
          f"{args.clients}, {args.warmup:g} + {args.duration:g} s windows", file=sys.stderr,
          flush=True)
    try:
        t0 = time.monotonic()
        with gpuq.testing.Daemon(config, gpuqd=args.gpuqd, wait_ready=False) as d:
            wait_for_pool(d, 90)
            doc["daemon_start_s"] = time.monotonic() - t0
            idle = memory_used_mib(mem_on)
            if idle is not None and doc["memory"]["baseline_mib"] is not None:
                doc["memory"]["daemon_idle_mib"] = idle - doc["memory"]["baseline_mib"]
            with gpuq.connect(d.runtime_dir, name="bench_gpu_python") as client:
                doc.update(check_pool(client, args))
                print(f"pool {POOL}: {doc['pool']}; workers {doc['workers_seen']}",
                      file=sys.stderr, flush=True)
                doc["noop"] = time_noop(client, ops, args.rows, args.noop_calls)
            for n in args.clients:
                for mode in MODES:
                    if time.monotonic() - t_start > args.budget:
                        failures.append(f"{mode} {n} clients: skipped, past --budget "
                                        f"{args.budget:g} s")
                        continue
                    try:
                        r = run_config(mode, n, args, d.runtime_dir, ops.IN,
                                       doc["memory"]["baseline_mib"])
                        configs[mode][str(n)] = r
                        stages = " + ".join(f"{k} {v:.0f}" for k, v in
                                            r["stages_ms_median"].items())
                        print(f"{mode:>6} {n:>2} clients: first result {stages} ms (median); "
                              f"{_fmt(r['results_per_s'], 0)} results/s, p50 "
                              f"{_fmt(r['p50_us'])} us; memory {_fmt(r['memory_mib'], 0)} MiB",
                              file=sys.stderr, flush=True)
                        failures += config_failures(r)
                    except Exception as e:  # noqa: BLE001
                        failures.append(f"{mode} {n} clients: {type(e).__name__}: {e}")
                        traceback.print_exc(file=sys.stderr)
            doc["daemon_status"] = d.status()
    except Exception as e:  # noqa: BLE001 - e.g. the daemon did not start
        failures.append(f"run: {type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stderr)

    ratios, correctness = compare(configs, (args.rows, ops.OUT), failures)
    wall = time.monotonic() - t_start
    ncpu = os.cpu_count() or 1
    torch_v = None
    if "torch" in sys.modules:
        torch_mod = sys.modules["torch"]
        torch_v = {"version": torch_mod.__version__, "cuda": torch_mod.version.cuda}
    doc.update({
        "benchmark": "bench_gpu_python",
        "timestamp_utc": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": shlex.join([sys.executable] + sys.argv),
        "hostname": socket.gethostname(),
        "machine": {"nproc": ncpu, "kernel": " ".join(platform.uname()[2:4]),
                    "python": sys.version, "packages": package_versions(), "torch": torch_v,
                    "gpu": gpu, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES")},
        "gpuqd": args.gpuqd, "daemon_config": config, "wall_s": wall,
        "parameters": {"model": args.model, "device": args.device, "clients": args.clients,
                       "rows": args.rows, "mlp": ops.MLP, "duration_s": args.duration,
                       "warmup_s": args.warmup, "noop_calls": args.noop_calls,
                       "workers_per_gpu": args.workers_per_gpu,
                       "memory_limit": args.memory_limit, "budget_s": args.budget},
        "configs": configs, "ratios": ratios,
        "correctness": correctness,
        "failures": failures,
    })
    print(f"\nrun {wall:.1f} s wall on {ncpu} CPUs")
    print_report(doc)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
        print(f"\nresults: {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
