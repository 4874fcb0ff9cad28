#!/usr/bin/env python3
"""Rolling restarts (issue 40, point 6): call latency during a rolling restart of a 2-worker
torch pool against steady state, and how long a rollout takes.

Setup: a private gpuqd (``gpuq.testing.Daemon``) with one Python pool ``torch`` of 2 workers
(a cpu pool pinned to CPUs 0 and 1 with one surge seat, the default; ``--gpu``: a gpu pool on
GPU 0, 2 workers per GPU, ``rollout_surge_workers: 1``; ``--seat spare``: a spare instead)
whose module (bench_rollout_ops.py, copied to a temporary folder with a version.txt) imports
torch and makes a small MLP in ``on_start``; the interpreter is --python (a venv with torch and
gpuq). --clients client processes each call ``infer`` on 8 rows of 256 floats in a closed loop
(one call in flight each) and stamp every call (CLOCK_MONOTONIC, send to result).

Then: a steady window of --steady seconds; then --rollouts rolling restarts one after the other
(``gpuq.restart_pool``), the module's version raised before each, each followed by --gap seconds
of steady calls. A call is "during a rollout" when it overlaps one (it started before the
rollout returned and ended after the rollout was asked for); every other call after warm-up is
steady. Reported: p50, p99 and max latency and calls/s, steady and during, their ratios; each
rollout's duration (the call to ``restart_pool``, and gpuqd's own start-to-done from its log);
failed calls (must be 0); the versions each client saw last (must be the last). One run, one
machine.

  python bench/python/bench_rollout.py --python /path/to/venv/bin/python \\
      --json bench/results/rollout-2026-12-05.json --text bench/results/rollout-2026-12-05.txt
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent


def _client(runtime_dir, index, stop, out):
    """Calls infer until told to stop: (start, end, version) per call, and failures."""
    import numpy as np

    x = np.random.default_rng(index).standard_normal((8, 256), dtype=np.float32)
    calls, failures = [], []
    with gpuq.connect(runtime_dir, name=f"rollout-bench-{index}") as c:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                r = c.call("infer", x, pool="torch", timeout=120)
                calls.append((t0, time.monotonic(), r["version"]))
            except Exception as e:  # noqa: BLE001 - every failure is reported
                failures.append(repr(e))
    out.put((index, calls, failures))


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))] if s else float("nan")


def summary(lat_ms, seconds):
    return {"calls": len(lat_ms), "calls_per_s": len(lat_ms) / seconds if seconds > 0 else 0.0,
            "p50_ms": pct(lat_ms, 0.5), "p99_ms": pct(lat_ms, 0.99),
            "max_ms": max(lat_ms) if lat_ms else float("nan")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="interpreter of the pool (torch and gpuq)")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--steady", type=float, default=10.0, help="seconds of steady calls first")
    ap.add_argument("--rollouts", type=int, default=5)
    ap.add_argument("--gap", type=float, default=3.0, help="seconds of steady calls after each")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of calls not counted")
    ap.add_argument("--seat", choices=["surge", "spare"], default="surge")
    ap.add_argument("--gpu", action="store_true", help="a gpu pool on GPU 0")
    ap.add_argument("--json")
    ap.add_argument("--text")
    args = ap.parse_args()

    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-rollout."))
    shutil.copy(HERE / "bench_rollout_ops.py", work / "bench_rollout_ops.py")
    (work / "version.txt").write_text("1")
    pool = {"name": "torch", "python": {"interpreter": args.python,
                                        "modules": ["bench_rollout_ops"], "path": [str(work)],
                                        "env": {"OMP_NUM_THREADS": "1"}}}
    if args.gpu:
        pool.update({"kind": "gpu", "gpus": [0], "workers_per_gpu": 2})
        pool.update({"spare_workers": 1} if args.seat == "spare" else {"rollout_surge_workers": 1})
    else:
        pool.update({"kind": "cpu", "workers": 2, "cpus": [0, 1]})
        if args.seat == "spare":
            pool.update({"spare_workers": 1, "rollout_surge_workers": 0})
    config = {"pools": [pool]}
    torch_version = os.popen(f"{args.python} -c 'import torch; print(torch.__version__)'").read()

    rollouts = []
    with gpuq.testing.Daemon(config, start_timeout=300) as d:
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_client, args=(d.runtime_dir, i, stop, out))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        t_begin = time.monotonic()
        time.sleep(args.warmup + args.steady)
        for v in range(2, args.rollouts + 2):
            (work / "version.txt").write_text(str(v))
            t0 = time.monotonic()
            g = gpuq.restart_pool("torch", runtime_dir=d.runtime_dir, timeout=600)
            t1 = time.monotonic()
            rollouts.append({"generation": g, "asked": t0, "returned": t1,
                             "seconds": t1 - t0})
            time.sleep(args.gap)
        stop.set()
        results = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join(60)
        log = d.log()

    counted_from = t_begin + args.warmup
    steady, during, failures, last_versions = [], [], [], []
    for _, calls, fails in results:
        failures += fails
        if calls:
            last_versions.append(calls[-1][2])
        for t0, t1, _ in calls:
            if t0 < counted_from:
                continue
            in_rollout = any(t0 < r["returned"] and t1 > r["asked"] for r in rollouts)
            (during if in_rollout else steady).append((t1 - t0) * 1e3)
    rolling_s = sum(r["seconds"] for r in rollouts)
    end = max((c[-1][1] for _, c, _ in results if c), default=counted_from)
    steady_s = (end - counted_from) - rolling_s
    s_sum, d_sum = summary(steady, steady_s), summary(during, rolling_s)
    durations = [r["seconds"] for r in rollouts]
    doc = {
        "bench": "rollout", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "torch": torch_version.strip(), "pool": pool, "clients": args.clients,
        "seat": args.seat, "steady": s_sum, "during": d_sum,
        "ratio_p50": d_sum["p50_ms"] / s_sum["p50_ms"] if s_sum["calls"] else None,
        "ratio_p99": d_sum["p99_ms"] / s_sum["p99_ms"] if s_sum["calls"] else None,
        "rollouts": [{"generation": r["generation"], "seconds": r["seconds"]} for r in rollouts],
        "rollout_seconds_median": statistics.median(durations) if durations else None,
        "failures": failures[:20], "failed_calls": len(failures),
        "last_versions": sorted(set(last_versions)),
        "log_rollout_lines": [line for line in log.splitlines() if "rolling restart" in line],
    }
    lines = [
        f"bench_rollout: torch {doc['torch']}, {'gpu' if args.gpu else 'cpu'} pool of 2 workers, "
        f"seat {args.seat}, {args.clients} clients, {os.cpu_count()} CPUs, "
        f"{args.rollouts} rollouts",
        f"steady  p50 {s_sum['p50_ms']:.2f} ms  p99 {s_sum['p99_ms']:.2f} ms  max "
        f"{s_sum['max_ms']:.1f} ms  {s_sum['calls']} calls  {s_sum['calls_per_s']:.0f}/s",
        f"during  p50 {d_sum['p50_ms']:.2f} ms  p99 {d_sum['p99_ms']:.2f} ms  max "
        f"{d_sum['max_ms']:.1f} ms  {d_sum['calls']} calls  {d_sum['calls_per_s']:.0f}/s",
        f"ratio during/steady: p50 {doc['ratio_p50']:.2f}x  p99 {doc['ratio_p99']:.2f}x",
        "rollout seconds: " + ", ".join(f"{x:.2f}" for x in durations)
        + f" (median {doc['rollout_seconds_median']:.2f})",
        f"failed calls: {len(failures)}; last versions seen: {doc['last_versions']}",
    ]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.text:
        pathlib.Path(args.text).write_text(text)
    shutil.rmtree(work, ignore_errors=True)
    return 0 if not failures and doc["last_versions"] == [args.rollouts + 1] else 1


if __name__ == "__main__":
    sys.exit(main())
