#!/usr/bin/env python3
"""Dynamic batching of Python ops: many clients sending 1-row requests to a small model, with and
without batching, side by side in one run on one machine.

The model: an MLP 256-512-10 (Linear 256->512, ReLU, Linear 512->10), float32, defined in
bench_batching_ops.py as two Python ops of the same function and the same weights (made once per
worker from a fixed seed in its ``on_start`` hook):

  batched     ``mlp``: ``@gpuq.op("mlp", max_batch_size=64, max_queue_delay_us=500)``; a worker
              gathers queued jobs of it from any client (up to 64 rows, or until 500 us have
              passed; a lone job does not wait) and calls the function once on their rows;
  unbatched   ``mlp_single``: ``@gpuq.op("mlp_single")``, one call per job.

The model is torch (``torch.set_num_threads(1)``, ``torch.inference_mode()``) when this
interpreter can import torch, else, or with ``--model numpy``, the same shapes as numpy matmuls.

Setup: a private gpuqd (``gpuq.testing.Daemon``) with one Python pool ``py`` of 2 CPU workers
(this interpreter, importing bench_batching_ops.py from this directory) and ``queue_factor`` 32,
so that the pool's ring (64 cells) holds every request of 32 clients at once (with the default,
10, it holds 20 and the 21st client's submit would wait for room, which would cap a batch at
about 20 rows). The same pool serves both ops.

Clients: N processes (``multiprocessing``, spawn), started once for the whole run and reused,
each connected with ``gpuq.connect(runtime_dir)`` and holding one (1, 256) float32 row of its own
made with ``client.array`` (in its segment: zero copy in). In a run, the first N of them, told a
common start time, each call ``client.call(op, x, pool="py")`` in a closed loop (one request in
flight per client) for a warm-up (--warmup, 0.3 s) and then the measured window (--duration,
2 s). Each request is timed with ``time.monotonic_ns`` from before the call to after the result
is in hand; the requests that end inside the window count. Figures per run: rows/s (requests
ended in the window, all clients, over the window's length; each request is one row), p50 and
p99 latency (nearest rank over all the clients' requests in the window), and the clients' CPU
time per request (``getrusage`` in each client) and the machine's busy share (/proc/stat) during
the run. The last result of every client's run is checked against the unbatched op's answer for
its row.

Method: the runs are interleaved, so that drift of the machine falls on both ops alike: each
round (--rounds, 3) measures every client count (--clients, 1,8,32) with both ops, in the order
batched, unbatched in even rounds and the reverse in odd ones. A figure is the median of its
rounds' values (the JSON keeps each round's). Before the rounds, correctness: 16 distinct rows
sent to the unbatched op one by one, then to the batched op as 16 jobs in flight at once (so
that a worker may batch them) and as one 16-row job, must give the same rows (``np.allclose``,
rtol 1e-4, atol 1e-5), with the right shape and dtype.

Batch sizes: when the daemon's metrics (``gpuq.metrics(runtime_dir)``) have the family
``gpuq_batch_rows`` (a histogram of rows per call of a batched op's function), the mean batch
size of the batched op in each run is its ``_sum`` over its ``_count``, between a scrape before
and one after the run, and is printed; without the family, "-".

Targets (printed as met/missed; the exit status does not depend on them):
  rows/s batched / rows/s unbatched at 32 clients >= 4 (8 clients: shown);
  p50 batched - p50 unbatched with 1 client <= 50 us.

Usage (from the repository root, in a venv with ``pip install ./python numpy`` and ``pip install
torch``)::

    GPUQ_GPUQD=build/daemon/gpuqd python bench/python/bench_batching.py [--json FILE]

The gpuqd binary: --gpuqd, else $GPUQ_GPUQD, else <repo>/build/daemon/gpuqd. A default run takes
about a minute (3 rounds x 3 client counts x 2 ops x 2.3 s, plus starting 32 client processes
and the daemon); ``--quick`` is a smoke run (one round of 0.5 s runs; its figures mean nothing).
``--json FILE`` writes every figure with the machine's facts (CPU model, nproc, Python, torch
and numpy versions, date, git commit). Exit status: 0 when every run ran and every checked
result was right, 1 on any failure, 2 on bad arguments. See BENCHMARKS.md, "Dynamic batching".
"""

from __future__ import annotations

import argparse
import array
import datetime
import gc
import importlib.util
import json
import multiprocessing
import os
import platform
import resource
import shlex
import signal
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bench_python import (median, package_versions, pool_worker_pids, scrape_batch_rows,
                          worker_cpu_s)
from bench_python import (cpu_model, load_average, machine_cpu, own_cpu_s, percentile,
                          source_commit)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS_DIR = os.path.dirname(os.path.abspath(__file__))

WORKERS = 2
QUEUE_FACTOR = 32  # ring of 64 cells: every request of 32 clients fits
POOL = "py"
IN, OUT = 256, 10
BATCHED, UNBATCHED = "mlp", "mlp_single"
OPS = (BATCHED, UNBATCHED)
LABEL = {BATCHED: "batched", UNBATCHED: "unbatched"}
MAX_BATCH_SIZE, MAX_QUEUE_DELAY_US = 64, 500  # as in bench_batching_ops.py (for the record)
CHECK_ROWS = 16
RTOL, ATOL = 1e-4, 1e-5
TARGET_RATIO, TARGET_RATIO_CLIENTS = 4.0, 32
TARGET_P50_DIFF_US = 50.0


def daemon_config(model: str, gpu: bool = False) -> Dict[str, Any]:
    """A Python pool of WORKERS CPU workers; with ``gpu``, WORKERS workers on GPU 0 (torch on
    cuda, a stage of scripts/device_check.sh)."""
    pool: Dict[str, Any] = {"name": POOL, "kind": "cpu", "workers": WORKERS}
    if gpu:
        pool = {"name": POOL, "kind": "gpu", "gpus": [0], "workers_per_gpu": WORKERS,
                "memory_limit": 0.4}
    pool["python"] = {"interpreter": sys.executable, "modules": ["bench_batching_ops"],
                      "path": [OPS_DIR],
                      "env": {"BENCH_BATCHING_MODEL": model,
                              "BENCH_BATCHING_DEVICE": "cuda" if gpu else "cpu"}}
    return {"queue_factor": QUEUE_FACTOR, "pools": [pool]}


# ---- the client processes ----------------------------------------------------------------------

def client_main(index: int, runtime_dir: str, spin_us: Optional[float], conn: Any) -> None:
    """A client process: connects, makes its row, checks one call of each op, reports ready,
    then serves ("run", op, t0_ns, begin_ns, end_ns) commands until ("stop",)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    try:
        import gpuq
        if spin_us is None:
            client = gpuq.connect(runtime_dir, name=f"bench_batching_{index}")
        else:
            client = gpuq.Client(runtime_dir, name=f"bench_batching_{index}", spin_us=spin_us)
        row = np.random.default_rng(1000 + index).standard_normal((1, IN)).astype(np.float32)
        x = client.array(row)
        ref = np.array(client.call(UNBATCHED, x, pool=POOL))
        got = np.array(client.call(BATCHED, x, pool=POOL))
        if ref.shape != (1, OUT) or ref.dtype != np.float32 or \
                not np.allclose(got, ref, rtol=RTOL, atol=ATOL):
            raise RuntimeError(f"client {index}: warm-up results differ or are malformed: "
                               f"{UNBATCHED} {ref.shape} {ref.dtype}, {BATCHED} {got.shape}")
        conn.send(("ready", index))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    call = client.call
    clock = time.monotonic_ns
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, op, t0, begin, end = cmd
        try:
            gc.collect()
            lat = array.array("q")
            wait = (t0 - clock()) / 1e9
            if wait > 0:
                time.sleep(wait)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            n_all = 0
            r = None
            while True:
                t1 = clock()
                r = call(op, x, pool=POOL)
                t2 = clock()
                n_all += 1
                if t2 > end:
                    break
                if t2 >= begin:
                    lat.append(t2 - t1)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            ok = r is not None and r.shape == (1, OUT) and r.dtype == np.float32 and \
                bool(np.allclose(r, ref, rtol=RTOL, atol=ATOL))
            r = None
            cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            conn.send(("done", lat.tobytes(), n_all, cpu, ok))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    client.close()


class Clients:
    """The client processes, started once and reused by every run."""

    def __init__(self, n: int, runtime_dir: str, spin_us: Optional[float]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=client_main, args=(i, runtime_dir, spin_us, child),
                                name=f"bench_batching_client_{i}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            for i, c in enumerate(self.conns):
                if not c.poll(120):
                    raise RuntimeError(f"client {i} did not start within 120 s")
                msg = c.recv()
                if msg[0] != "ready":
                    raise RuntimeError(f"client {i} failed to start:\n{msg[1]}")
        except BaseException:
            self.close()
            raise

    def run(self, n: int, op: str, warmup_s: float, duration_s: float
            ) -> Tuple[List[int], int, float, bool]:
        """One run of the first n clients: (latencies in the window in ns, requests made in
        all, the clients' CPU seconds, whether every client's last result was right)."""
        clock = time.monotonic_ns
        t0 = clock() + 100_000_000  # 0.1 s for the commands to arrive
        begin = t0 + int(warmup_s * 1e9)
        end = begin + int(duration_s * 1e9)
        for c in self.conns[:n]:
            c.send(("run", op, t0, begin, end))
        lat: List[int] = []
        total, cpu, ok = 0, 0.0, True
        errors = []
        for i, c in enumerate(self.conns[:n]):
            if not c.poll(duration_s + warmup_s + 60):
                raise RuntimeError(f"client {i} did not finish its run")
            msg = c.recv()
            if msg[0] != "done":
                errors.append(f"client {i}:\n{msg[1]}")
                continue
            a = array.array("q")
            a.frombytes(msg[1])
            lat.extend(a)
            total += msg[2]
            cpu += msg[3]
            ok = ok and msg[4]
        if errors:
            raise RuntimeError("\n".join(errors))
        return lat, total, cpu, ok

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


# ---- checks and metrics ------------------------------------------------------------------------

def check_correctness(client: Any) -> Dict[str, Any]:
    """16 distinct rows: the unbatched op one by one (the reference), the batched op as 16 jobs
    in flight at once and as one 16-row job, the unbatched op as one 16-row job. Raises on a
    mismatch; returns the largest absolute differences."""
    rows = np.random.default_rng(7).standard_normal((CHECK_ROWS, IN)).astype(np.float32)
    xs = [client.array(rows[i:i + 1]) for i in range(CHECK_ROWS)]
    ref = np.concatenate([np.array(client.call(UNBATCHED, x, pool=POOL)) for x in xs])
    futures = [client.submit_call(BATCHED, x, pool=POOL) for x in xs]
    in_flight = np.concatenate([np.array(f.result()) for f in futures])
    whole = client.array(rows)
    one_job = np.array(client.call(BATCHED, whole, pool=POOL))
    one_job_single = np.array(client.call(UNBATCHED, whole, pool=POOL))
    out: Dict[str, Any] = {"rows": CHECK_ROWS, "rtol": RTOL, "atol": ATOL}
    for name, got in (("batched_in_flight", in_flight), ("batched_one_job", one_job),
                      ("unbatched_one_job", one_job_single)):
        if got.shape != (CHECK_ROWS, OUT) or got.dtype != np.float32:
            raise RuntimeError(f"correctness: {name}: shape {got.shape} dtype {got.dtype}, want "
                               f"({CHECK_ROWS}, {OUT}) float32")
        if not np.allclose(got, ref, rtol=RTOL, atol=ATOL):
            bad = np.nonzero(~np.isclose(got, ref, rtol=RTOL, atol=ATOL).all(axis=1))[0]
            raise RuntimeError(f"correctness: {name} differs from the unbatched op one row at a "
                               f"time in rows {bad.tolist()}")
        out[name + "_max_abs_diff"] = float(np.max(np.abs(got - ref)))
    if len(np.unique(ref, axis=0)) != CHECK_ROWS:
        raise RuntimeError("correctness: distinct rows gave equal answers")
    return out


# ---- the run -----------------------------------------------------------------------------------

def run_stats(lat: List[int], total: int, cpu: float, ok: bool, duration: float,
              busy: float, ncpu: int, batch: Optional[Tuple[float, float]],
              worker_cpu: float) -> Dict[str, Any]:
    s = sorted(lat)
    return {"rows_per_s": len(s) / duration, "requests_in_window": len(s),
            "requests_all": total,
            "p50_us": percentile(s, 50) if s else None,
            "p99_us": percentile(s, 99) if s else None,
            "mean_us": sum(s) / len(s) / 1e3 if s else None,
            "client_cpu_us_per_request": cpu / total * 1e6 if total else None,
            # The workers' CPU over the whole run (warm-up included) per request of it: what
            # batching changes, apart from the clients' own cost.
            "worker_cpu_us_per_row": worker_cpu / total * 1e6 if total else None,
            "machine_busy_share": busy / ncpu,
            "batch_calls": batch[1] if batch else None,
            "batch_rows_sum": batch[0] if batch else None,
            "mean_batch_rows": batch[0] / batch[1] if batch and batch[1] else None,
            "results_checked_ok": ok}


def summarize(per_round: Dict[str, Dict[int, List[Dict[str, Any]]]]
              ) -> Dict[str, Dict[str, Dict[str, Any]]]:
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for op, by_n in per_round.items():
        for n, runs in by_n.items():
            row: Dict[str, Any] = {"rounds": len(runs)}
            for key in ("rows_per_s", "p50_us", "p99_us", "mean_us", "client_cpu_us_per_request",
                        "worker_cpu_us_per_row", "machine_busy_share", "mean_batch_rows"):
                row[key] = median([r[key] for r in runs])
                row["per_round_" + key] = [r[key] for r in runs]
            out.setdefault(LABEL[op], {})[str(n)] = row
    return out


def ratios_and_targets(summary: Dict[str, Dict[str, Dict[str, Any]]],
                       per_round: Dict[str, Dict[int, List[Dict[str, Any]]]],
                       clients: Sequence[int]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    ratios: Dict[str, Any] = {}
    for n in clients:
        b = summary.get("batched", {}).get(str(n))
        u = summary.get("unbatched", {}).get(str(n))
        if not b or not u:
            continue
        ratios[f"rows_per_s_ratio_{n}"] = b["rows_per_s"] / u["rows_per_s"] \
            if b["rows_per_s"] and u["rows_per_s"] else None
        ratios[f"worker_cpu_per_row_ratio_{n}"] = \
            u["worker_cpu_us_per_row"] / b["worker_cpu_us_per_row"] \
            if b.get("worker_cpu_us_per_row") and u.get("worker_cpu_us_per_row") else None
        ratios[f"p50_diff_us_{n}"] = b["p50_us"] - u["p50_us"] \
            if b["p50_us"] is not None and u["p50_us"] is not None else None
        # Paired by round (both ops measured back to back), for the drift.
        ru = {r["round"]: r for r in per_round[UNBATCHED].get(n, [])}
        pairs = [(x, ru[x["round"]]) for x in per_round[BATCHED].get(n, []) if x["round"] in ru]
        ratios[f"per_round_rows_per_s_ratio_{n}"] = [
            x["rows_per_s"] / y["rows_per_s"] if y["rows_per_s"] else None for x, y in pairs]
        ratios[f"per_round_p50_diff_us_{n}"] = [
            x["p50_us"] - y["p50_us"] if x["p50_us"] is not None and y["p50_us"] is not None
            else None for x, y in pairs]
    targets = []
    r = ratios.get(f"rows_per_s_ratio_{TARGET_RATIO_CLIENTS}")
    if f"rows_per_s_ratio_{TARGET_RATIO_CLIENTS}" in ratios:
        targets.append({"name": f"rows/s batched / unbatched, {TARGET_RATIO_CLIENTS} clients",
                        "value": r, "bound": TARGET_RATIO, "upper_bound": False, "unit": "",
                        "met": None if r is None else r >= TARGET_RATIO})
    d = ratios.get("p50_diff_us_1")
    if "p50_diff_us_1" in ratios:
        targets.append({"name": "p50 batched - unbatched, 1 client", "value": d,
                        "bound": TARGET_P50_DIFF_US, "upper_bound": True, "unit": " us",
                        "met": None if d is None else d <= TARGET_P50_DIFF_US})
    return ratios, targets


def _fmt(v: Optional[float], digits: int = 1) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def print_report(summary: Dict[str, Dict[str, Dict[str, Any]]], ratios: Dict[str, Any],
                 targets: List[Dict[str, Any]], clients: Sequence[int], rounds: int) -> None:
    print(f"\n1-row requests to the MLP 256-512-10, one in flight per client, 2 workers; medians of "
          f"{rounds} round(s)")
    print(f"  {'clients':>7} {'op':<10} {'rows/s':>9} {'p50 us':>9} {'p99 us':>9} "
          f"{'rows/call':>9} {'cli cpu us/req':>14} {'wrk cpu us/row':>14} {'busy':>5}")
    for n in clients:
        for op in OPS:
            r = summary.get(LABEL[op], {}).get(str(n))
            if not r:
                continue
            busy = r["machine_busy_share"]
            print(f"  {n:>7} {LABEL[op]:<10} {_fmt(r['rows_per_s'], 0):>9} {_fmt(r['p50_us']):>9}"
                  f" {_fmt(r['p99_us']):>9}"
                  f" {_fmt(r['mean_batch_rows'], 2) if op == BATCHED else '':>9}"
                  f" {_fmt(r['client_cpu_us_per_request']):>14}"
                  f" {_fmt(r.get('worker_cpu_us_per_row')):>14}"
                  f" {'-' if busy is None else f'{100 * busy:.0f}%':>5}")
    print("\n  batched / unbatched:")
    for n in clients:
        if f"rows_per_s_ratio_{n}" not in ratios:
            continue
        rr = ratios[f"per_round_rows_per_s_ratio_{n}"]
        dd = ratios[f"per_round_p50_diff_us_{n}"]
        print(f"  {n:>3} clients: workers' CPU per row, unbatched / batched "
              f"{_fmt(ratios.get(f'worker_cpu_per_row_ratio_{n}'), 2)}")
        print(f"  {n:>3} clients: rows/s ratio {_fmt(ratios[f'rows_per_s_ratio_{n}'], 2)} "
              f"(rounds: {', '.join(_fmt(v, 2) for v in rr)}); p50 difference "
              f"{_fmt(ratios[f'p50_diff_us_{n}'])} us (rounds: "
              f"{', '.join(_fmt(v) for v in dd)})")
    if targets:
        print(f"\n  {'target':<44} {'measured':>10} {'goal':>10}  result")
    for t in targets:
        goal = f"{'<=' if t['upper_bound'] else '>='} {t['bound']:g}{t['unit']}"
        value = "-" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "missed")
        print(f"  {t['name']:<44} {value:>10} {goal:>10}  {verdict}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Dynamic batching of Python ops: 1-row requests from 1, 8 and 32 client "
                    "processes to a small MLP, batched and unbatched (see the module docstring "
                    "and BENCHMARKS.md).")
    p.add_argument("--gpuqd", default=os.environ.get("GPUQ_GPUQD")
                   or os.path.join(REPO, "build", "daemon", "gpuqd"),
                   help="the gpuqd binary (default: $GPUQ_GPUQD, else <repo>/build/daemon/gpuqd)")
    p.add_argument("--model", choices=("auto", "torch", "numpy"), default="auto",
                   help="the MLP's implementation in the workers (default auto: torch when this "
                        "interpreter can import it, else numpy)")
    p.add_argument("--clients", default="1,8,32",
                   help="comma-separated client counts (default 1,8,32)")
    p.add_argument("--duration", type=float, default=None,
                   help="measured seconds per run (default 2; 0.5 with --quick)")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds of requests before each run's window (default 0.3; 0.1 with "
                        "--quick)")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds, each running every client count with both ops (default 3; 1 "
                        "with --quick)")
    p.add_argument("--client-spin-us", type=float, default=None,
                   help="the clients' wait spin (gpuq.Client(spin_us=...)); default: "
                        "gpuq.connect's (50 us)")
    p.add_argument("--gpu", action="store_true",
                   help="a gpu pool on GPU 0, the torch model on cuda (needs torch with CUDA)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: one round of 0.5 s runs (its figures mean nothing)")
    p.add_argument("--json", metavar="FILE", help="write every figure and the machine's facts here")
    a = p.parse_args(argv)
    try:
        a.clients = sorted({int(c) for c in a.clients.split(",") if c.strip()})
    except ValueError:
        p.error(f"--clients: bad list {a.clients!r}")
    if not a.clients or a.clients[0] < 1 or a.clients[-1] > 60:
        p.error("--clients: from 1 to 60 each (the daemon takes 64 clients)")
    if a.duration is None:
        a.duration = 0.5 if a.quick else 2.0
    if a.warmup is None:
        a.warmup = 0.1 if a.quick else 0.3
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    if a.duration <= 0 or a.warmup < 0 or a.rounds < 1:
        p.error("--duration must be > 0, --warmup >= 0, --rounds >= 1")
    if a.model == "auto":
        a.model = "torch" if importlib.util.find_spec("torch") is not None else "numpy"
    elif a.model == "torch" and importlib.util.find_spec("torch") is None:
        p.error("--model torch: this interpreter cannot import torch")
    if a.gpu and a.model != "torch":
        p.error("--gpu runs the torch model on cuda: it needs --model torch (or auto with torch)")
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the daemon
    import gpuq
    import gpuq.testing

    date = datetime.datetime.now(datetime.timezone.utc)
    ncpu = os.cpu_count() or 1
    config = daemon_config(args.model, args.gpu)
    failures: List[str] = []
    per_round: Dict[str, Dict[int, List[Dict[str, Any]]]] = {op: {} for op in OPS}
    info: Dict[str, Any] = {}
    load_start = load_average()
    busy0, steal0 = machine_cpu()
    own0 = own_cpu_s()
    t_start = time.perf_counter()
    print(f"bench_batching: {ncpu} CPUs ({cpu_model()}), Python {platform.python_version()}, "
          f"model {args.model}, gpuqd {args.gpuqd}, clients {args.clients}, {args.rounds} "
          f"round(s) of {args.warmup:g} + {args.duration:g} s runs"
          f"{', quick' if args.quick else ''}", file=sys.stderr, flush=True)
    clients: Optional[Clients] = None
    try:
        with gpuq.testing.Daemon(config, gpuqd=args.gpuqd) as d:
            with gpuq.connect(d.runtime_dir, name="bench_batching") as client:
                # Several in flight, so that both workers are likely to answer.
                futures = [client.submit_call("mlp_info", pool=POOL) for _ in range(8 * WORKERS)]
                kinds = {json.dumps(f.result(), sort_keys=True) for f in futures}
                info["workers_seen"] = [json.loads(k) for k in sorted(kinds)]
                models = {w["model"] for w in info["workers_seen"]}
                if models != {args.model}:
                    raise RuntimeError(f"the workers run {sorted(models)}, not {args.model}")
                where = {w.get("device", "cpu") for w in info["workers_seen"]}
                if where != {"cuda" if args.gpu else "cpu"}:
                    raise RuntimeError(f"the workers run on {sorted(where)}")
                info["runs_on"] = next(p.get("runs_on") for p in client.pools
                                       if p["name"] == POOL)
                print(f"pool {POOL} runs on {info['runs_on']}", file=sys.stderr, flush=True)
                info["correctness"] = check_correctness(client)
                print(f"correctness: ok ({info['correctness']})", file=sys.stderr, flush=True)
                info["batch_rows_metric"] = scrape_batch_rows(d.runtime_dir, BATCHED) is not None
                print(f"starting {args.clients[-1]} client processes", file=sys.stderr, flush=True)
                clients = Clients(args.clients[-1], d.runtime_dir, args.client_spin_us)
                pids = pool_worker_pids(d.status(), POOL)
                for rnd in range(args.rounds):
                    order = OPS if rnd % 2 == 0 else OPS[::-1]
                    for n in args.clients:
                        for op in order:
                            try:
                                before = scrape_batch_rows(d.runtime_dir, BATCHED) if op == BATCHED else None
                                b0, _ = machine_cpu()
                                c0 = worker_cpu_s(pids)
                                w0 = time.monotonic()
                                lat, total, cpu, ok = clients.run(n, op, args.warmup,
                                                                  args.duration)
                                b1, _ = machine_cpu()
                                c1 = worker_cpu_s(pids)
                                w1 = time.monotonic()
                                after = scrape_batch_rows(d.runtime_dir, BATCHED) if op == BATCHED else None
                                batch = (after[0] - before[0], after[1] - before[1]) \
                                    if before is not None and after is not None else None
                                st = run_stats(lat, total, cpu, ok, args.duration,
                                               (b1 - b0) / (w1 - w0),
                                               ncpu, batch, c1 - c0)
                                st["round"] = rnd + 1
                                st["first"] = op == order[0]
                                per_round[op].setdefault(n, []).append(st)
                                print(f"round {rnd + 1}/{args.rounds} {n:>2} clients "
                                      f"{LABEL[op]:<9}: {st['rows_per_s']:9,.0f} rows/s, p50 "
                                      f"{_fmt(st['p50_us'])} us, p99 {_fmt(st['p99_us'])} us"
                                      + (f", {st['mean_batch_rows']:.2f} rows/call"
                                         if st["mean_batch_rows"] is not None else ""),
                                      file=sys.stderr, flush=True)
                                if batch is not None and abs(batch[0] - total) > n:  # a scrape may miss the last
                                    print(f"  note: gpuq_batch_rows_sum grew by {batch[0]:g}, the "
                                          f"clients made {total} calls of {BATCHED}",
                                          file=sys.stderr, flush=True)
                                if st["mean_batch_rows"] is not None and st["mean_batch_rows"] < 1:
                                    print(f"  note: gpuq_batch_rows_count grew by {batch[1]:g}, more "
                                          f"than the {batch[0]:g} rows its _sum counts: the "
                                          "daemon's count looks wrong", file=sys.stderr, flush=True)
                                if not ok:
                                    failures.append(f"{LABEL[op]} {n} clients round {rnd + 1}: "
                                                    "a client's last result was wrong")
                                if not lat:
                                    failures.append(f"{LABEL[op]} {n} clients round {rnd + 1}: "
                                                    "no request ended in the window")
                            except Exception as e:  # noqa: BLE001
                                failures.append(f"{LABEL[op]} {n} clients round {rnd + 1}: "
                                                f"{type(e).__name__}: {e}")
                                traceback.print_exc(file=sys.stderr)
                clients.close()
                clients = None
                info["daemon_status"] = d.status()
    except Exception as e:  # noqa: BLE001 - e.g. the daemon did not start
        failures.append(f"run: {type(e).__name__}: {e}")
        traceback.print_exc(file=sys.stderr)
    finally:
        if clients is not None:
            clients.close()
    wall = time.perf_counter() - t_start
    busy1, steal1 = machine_cpu()
    own = own_cpu_s() - own0
    other = max(0.0, busy1 - busy0 - own)
    load_end = load_average()

    summary = summarize(per_round)
    ratios, tgts = ratios_and_targets(summary, per_round, args.clients)
    print(f"\nload average at start {load_start}, at end {load_end}")
    print(f"run {wall:.1f} s wall; CPU time: this benchmark and its processes {own:.1f} s, other "
          f"processes {other:.1f} s ({100 * other / (wall * ncpu):.0f}% of the machine), stolen "
          f"{steal1 - steal0:.1f} s")
    if "correctness" in info:
        print("correctness: the batched op (16 jobs in flight, and one 16-row job) gives the "
              "unbatched op's rows (np.allclose)")
    if info.get("batch_rows_metric") is False:
        print("rows/call: the daemon's metrics have no gpuq_batch_rows family")
    print_report(summary, ratios, tgts, args.clients, args.rounds)
    for f in failures:
        print(f"FAILURE {f}")

    if args.json:
        doc = {
            "benchmark": "bench_batching",
            "date": date.strftime("%Y-%m-%d"),
            "timestamp_utc": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join([sys.executable] + sys.argv),
            "hostname": socket.gethostname(),
            "machine": {"nproc": ncpu,
                        "nproc_usable": len(os.sched_getaffinity(0))
                        if hasattr(os, "sched_getaffinity") else None,
                        "cpu_model": cpu_model(),
                        "kernel": " ".join(platform.uname()[2:4]),
                        "python": sys.version,
                        "packages": package_versions(("gpuq", "numpy", "torch"))},
            "source_commit": source_commit(),
            "gpuqd": args.gpuqd,
            "daemon_config": config,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "interference": {"wall_s": wall, "own_cpu_s": own, "other_processes_cpu_s": other,
                             "other_processes_share": other / (wall * ncpu),
                             "steal_s": steal1 - steal0},
            "parameters": {"quick": args.quick, "model": args.model, "gpu": args.gpu,
                           "clients": args.clients,
                           "duration_s": args.duration, "warmup_s": args.warmup,
                           "rounds": args.rounds, "client_spin_us": args.client_spin_us,
                           "workers": WORKERS, "queue_factor": QUEUE_FACTOR,
                           "max_batch_size": MAX_BATCH_SIZE,
                           "max_queue_delay_us": MAX_QUEUE_DELAY_US,
                           "mlp": "Linear(256, 512), ReLU, Linear(512, 10), float32",
                           "request_rows": 1},
            "results": summary,
            "per_round": {LABEL[op]: {str(n): runs for n, runs in by_n.items()}
                          for op, by_n in per_round.items()},
            "ratios": ratios,
            "targets": tgts,
            "all_targets_met": bool(tgts) and all(t["met"] for t in tgts),
            "failures": failures,
            **info,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"\nresults: {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
