#!/usr/bin/env python3
"""A small Python op in Ray tasks: through the node's gpuqd, against the same work done in the
Ray task itself (BENCHMARKS.md, "Ray tasks through gpuq").

Measured in one run on one machine, a one-node Ray (``ray.init(num_cpus=2)``) whose workers
inherit ``GPUQ_RUNTIME_DIR`` of a private gpuqd started here (``gpuq.testing.Daemon``) with one
Python pool ``py`` of 2 workers importing examples/scale-out/node_ops.py:

  plain  ``ray.get(f.remote(x, w))``, ``f`` computing ``np.tanh(x @ w)`` in the Ray worker;
  gpuq   the same, ``f`` calling ``gpuq.default_client().call("score", x, w)``: op ``score`` of
         node_ops, the same ``np.tanh(x @ w)``, run by a worker of the node's gpuqd.

``x`` is 4 x 16 and ``w`` 16 x 8 float32, passed as task arguments (inline in the task spec);
the result, 4 x 8 float32, comes back through Ray. Every result is checked.

Figures per system:

  latency     one task in flight, back to back: ``ray.get(f.remote(x, w))`` timed with
              ``time.perf_counter_ns``; p50 and p99 by nearest rank over all rounds' samples;
  throughput  tasks/s: N tasks submitted at once (``[f.remote(x, w) for ...]``), then
              ``ray.get`` of the list; N over the time from the first submit to the last result;
              the median over the rounds;
  in-task     the op alone as a Ray task sees it: one task times N calls of its work (``np.tanh(x
              @ w)`` in the task; ``client.call`` for gpuq), p50: what gpuq adds to each task.

Method: Ray, its 2 workers (each with its gpuq client connected) and the daemon are started and
warmed up before the first measurement. The run is split into rounds (--rounds); each measures
both systems, the order alternating. Other load moves every figure on a 2-CPU machine: the load
average before and after is recorded.

Ray picks the machine's non-loopback address for its node, so run it where loopback is the only
interface, as the scaleout test stage does (the script refuses otherwise):

    GPUQ_GPUQD=build/daemon/gpuqd bash tests/scaleout/netns.sh build-scaleout/venv/bin/python \\
        build-scaleout/venv/bin/python bench/python/bench_ray_gpuq.py

The results go to bench/results/scaleout-ray-<UTC date>.json and .txt (--out-prefix).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[2]
SYSTEMS = ("plain", "gpuq")


def percentile(samples: List[int], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))] / 1000.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--latency", type=int, default=2000, help="round trips per system and round")
    ap.add_argument("--throughput", type=int, default=4000, help="tasks per system and round")
    ap.add_argument("--in-task", type=int, default=20000, help="calls in the in-task figure")
    ap.add_argument("--worker-spin-us", type=int, default=None,
                    help="the Python pool's worker_spin_us (default: the pool's, 300 for a "
                         "Python pool; docs/config.md)")
    ap.add_argument("--quick", action="store_true", help="a smoke run; its figures mean nothing")
    ap.add_argument("--out-prefix", default=None,
                    help="results path without .json/.txt (default "
                         "bench/results/scaleout-ray-<UTC date>; '' writes none)")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.latency, args.throughput, args.in_task = 1, 50, 200, 200
    if [n for _, n in socket.if_nameindex()] != ["lo"]:
        sys.exit("bench_ray_gpuq: run it in a network namespace of its own (see the docstring):"
                 " Ray would use this machine's non-loopback address")

    # No usage reports, and no auth token written to ~/.ray: nothing outside this network
    # namespace can reach this Ray.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    import gpuq
    import gpuq.testing

    config = {"pools": [{"name": "py", "kind": "cpu", "workers": 2, "python": {
        "interpreter": sys.executable, "modules": ["node_ops"],
        "path": [str(REPO / "examples" / "scale-out")]}}]}
    if args.worker_spin_us is not None:
        config["pools"][0]["worker_spin_us"] = args.worker_spin_us
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16), dtype=np.float32)
    w = rng.standard_normal((16, 8), dtype=np.float32)
    want = np.tanh(x @ w)

    @ray.remote
    def plain(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return np.tanh(x @ w)

    @ray.remote
    def via_gpuq(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        return gpuq.default_client().call("score", x, w)

    @ray.remote
    def in_task(system: str, n: int, x: np.ndarray, w: np.ndarray) -> List[int]:
        client = gpuq.default_client()
        out = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            if system == "plain":
                np.tanh(x @ w)
            else:
                client.call("score", x, w)
            out.append(time.perf_counter_ns() - t0)
        return out

    remote = {"plain": plain, "gpuq": via_gpuq}
    load_before = os.getloadavg()
    with gpuq.testing.Daemon(config) as daemon:
        os.environ["GPUQ_RUNTIME_DIR"] = daemon.runtime_dir  # Ray's workers inherit it
        ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20,
                 log_to_driver=False, logging_level="warning")
        try:
            for f in remote.values():  # warm-up: both Ray workers up, their clients connected
                for y in ray.get([f.remote(x, w) for _ in range(400)]):
                    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
            latency: Dict[str, List[int]] = {s: [] for s in SYSTEMS}
            throughput: Dict[str, List[float]] = {s: [] for s in SYSTEMS}
            for r in range(args.rounds):
                for s in (SYSTEMS if r % 2 == 0 else SYSTEMS[::-1]):
                    f = remote[s]
                    for _ in range(args.latency):
                        t0 = time.perf_counter_ns()
                        y = ray.get(f.remote(x, w))
                        latency[s].append(time.perf_counter_ns() - t0)
                    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
                    t0 = time.perf_counter()
                    ys = ray.get([f.remote(x, w) for _ in range(args.throughput)])
                    throughput[s].append(args.throughput / (time.perf_counter() - t0))
                    for y in ys:
                        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
            inside = {s: ray.get(in_task.remote(s, args.in_task, x, w)) for s in SYSTEMS}
            jobs = sum(int(float(line.rsplit(" ", 1)[1]))
                       for line in gpuq.metrics(daemon.runtime_dir).splitlines()
                       if line.startswith("gpuq_jobs_total{") and 'op="score"' in line
                       and 'outcome="ok"' in line)
        finally:
            ray.shutdown()
    load_after = os.getloadavg()

    figures = {s: {"latency_p50_us": percentile(latency[s], 50),
                   "latency_p99_us": percentile(latency[s], 99),
                   "tasks_per_s": statistics.median(throughput[s]),
                   "tasks_per_s_rounds": [round(t) for t in throughput[s]],
                   "in_task_p50_us": percentile(inside[s], 50)} for s in SYSTEMS}
    lines = [
        f"Ray tasks running a small Python op (tanh(x @ w), x 4x16, w 16x8 float32), "
        f"{args.rounds} rounds, {args.latency} round trips and {args.throughput} tasks per "
        f"system and round",
        "",
        "| system | p50 round trip (µs) | p99 (µs) | tasks/s (median; rounds) "
        "| op in the task, p50 (µs) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for s in SYSTEMS:
        f = figures[s]
        rounds = ", ".join(f"{t:,}" for t in f["tasks_per_s_rounds"])
        lines.append(f"| {s} | {f['latency_p50_us']:.0f} | {f['latency_p99_us']:.0f} | "
                     f"{f['tasks_per_s']:,.0f} ({rounds}) | {f['in_task_p50_us']:.1f} |")
    ratio = figures["gpuq"]["tasks_per_s"] / figures["plain"]["tasks_per_s"]
    added = figures["gpuq"]["latency_p50_us"] - figures["plain"]["latency_p50_us"]
    lines += ["", f"gpuq/plain: throughput {ratio:.2f}x, p50 round trip {added:+.0f} µs; the "
                  f"daemon ran {jobs} score jobs; load average before {load_before[0]:.2f}, "
                  f"after {load_after[0]:.2f}"]
    text = "\n".join(lines)
    print(text)

    prefix = args.out_prefix
    if prefix is None:
        day = datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        prefix = str(REPO / "bench" / "results" / f"scaleout-ray-{day}")
    if prefix:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        doc: Dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                     "kernel": platform.release(), "python": platform.python_version()},
            "versions": {"ray": ray.__version__, "numpy": np.__version__,
                         "gpuq": gpuq.__version__},
            "commit": commit, "command": sys.argv, "params": vars(args),
            "daemon_config": config, "figures": figures, "score_jobs": jobs,
            "loadavg_before": load_before, "loadavg_after": load_after}
        pathlib.Path(prefix + ".json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        pathlib.Path(prefix + ".txt").write_text(text + "\n")
        print(f"results: {prefix}.json, {prefix}.txt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
