#!/usr/bin/env python3
"""Spare workers (issue 29, point 3): how long a pool is a worker short after a worker is
stopped for a job that hangs, and after a worker crashes, with spare_workers 0 and 1.

Setup: a private gpuqd (``gpuq.testing.Daemon``) with one cpu Python pool ``torch`` of 2
workers pinned to CPUs 0 and 1 whose module (bench_spares_ops.py) imports torch (a start of
2 to 4 s), cancel_grace_ms 500, a restart back-off of 100 ms (the default's first, for every
crash: the rounds' deaths would double it); the interpreter is --python (a venv with
torch and gpuq). Per spare count (0, 1) and scenario, --repeats rounds; each round starts with
the pool whole (both workers, and the spare, ready), puts a ``busy`` job (it runs until
cancelled) on one worker, so that only the other one's replacement can serve, and then:

  forced  submits ``hang`` with time_limit 0.5 s (it ignores its flag: the worker is stopped
          0.5 s + cancel_grace_ms later) and, right behind it, ``serve``; measured, to
          ``serve``'s result: from the forced stop (the hung worker's /proc/<pid>/stat, polled
          every 0.5 ms from a thread, first showing PF_EXITING: the supervisor's SIGKILL was
          delivered), from its death (state Z, once the kernel has torn it down) and from the
          hung job's TimedOut in the client's hands (negative: ``serve`` was answered first;
          the client waits for ``serve`` before it looks at the hung job);
  crash   submits ``hang`` (no limit) and ``serve`` behind it, then SIGKILLs the hung worker
          from here; measured: from the kill, and from the hung job's WorkerDied, to
          ``serve``'s result.

``serve`` returns the pid that ran it: with a spare it must be the spare's (promoted, not a
new process). Then ``busy`` is cancelled and the next round waits for the pool to be whole.
Medians, min and max per case, and the ratio of medians 0 spares / 1 spare. One run, one
machine; CLOCK_MONOTONIC throughout.

  python bench/python/bench_spares.py --python /path/to/venv/bin/python \\
      --json bench/results/spares-2026-11-28.json --text bench/results/spares-2026-11-28.txt
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import threading
import time

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent


def pool_status(d):
    return next(p for p in d.status()["pools"] if p["name"] == "torch")


def wait_whole(d, spares, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = pool_status(d)
        if (st["workers_ready"] == 2 and st["spares_ready"] == spares
                and all(w["state"] == "ready" for w in st["workers"])):
            return st
        time.sleep(0.01)
    raise RuntimeError(f"pool not whole within {timeout} s: {pool_status(d)}")


def wait_busy(d, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = pool_status(d)
        busy = [w for w in st["workers"] if w["busy"] and w["role"] == "active"]
        if busy:
            return st, busy[0]
        time.sleep(0.005)
    raise RuntimeError("the busy job did not start")


class DeathWatch(threading.Thread):
    """Polls /proc/<pid>/stat every 0.5 ms: `exiting_at` is when the process was first seen
    exiting (PF_EXITING in its flags: a SIGKILL was delivered, the kernel tears it down), `at`
    when it was first seen dead (state Z, or gone)."""

    PF_EXITING = 0x4

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.at, self.exiting_at, self.stop = pid, None, None, False

    def run(self):
        path = f"/proc/{self.pid}/stat"
        while not self.stop:
            try:
                with open(path) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                state, flags = fields[0], int(fields[6])
            except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
                state, flags = "X", 0
            now = time.monotonic()
            if self.exiting_at is None and (flags & self.PF_EXITING or state in ("Z", "X")):
                self.exiting_at = now
            if state in ("Z", "X"):
                self.at = now
                return
            time.sleep(0.0005)


def one_round(d, c, scenario, spares):
    wait_whole(d, spares)
    spare_pid = next((w["pid"] for w in pool_status(d)["workers"] if w["role"] == "spare"), None)
    busy = c.submit_call("busy", pool="torch")
    st, busy_worker = wait_busy(d)
    [victim] = [w for w in st["workers"] if w["role"] == "active" and w["id"] != busy_worker["id"]]
    watch = DeathWatch(victim["pid"])
    watch.start()
    r = {"scenario": scenario, "spares": spares, "victim_pid": victim["pid"],
         "spare_pid": spare_pid}
    if scenario == "forced":
        hung = c.submit_call("hang", pool="torch", time_limit=0.5)
        nxt = c.submit_call("serve", pool="torch")
        # The next job first: it may be served before the hung job's end is written (at the
        # stopped worker's exit).
        served = nxt.result(timeout=120)
        t_served = time.monotonic()
        try:
            hung.result(timeout=60)
            raise RuntimeError("the hung job ended")
        except gpuq.TimedOut:
            t_err = time.monotonic()
        watch.join(10)
        r["from_stop_ms"] = (t_served - watch.exiting_at) * 1e3 if watch.exiting_at else None
        r["from_death_ms"] = (t_served - watch.at) * 1e3 if watch.at else None
        r["from_error_ms"] = (t_served - t_err) * 1e3
    else:
        hung = c.submit_call("hang", pool="torch")
        # The hung job runs on the victim (the other worker is busy) before it is killed.
        deadline = time.monotonic() + 30
        while not next(w for w in pool_status(d)["workers"] if w["id"] == victim["id"])["busy"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the hung job did not start")
            time.sleep(0.002)
        nxt = c.submit_call("serve", pool="torch")
        t_kill = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        served = nxt.result(timeout=120)
        t_served = time.monotonic()
        try:
            hung.result(timeout=60)
            raise RuntimeError("the hung job ended")
        except gpuq.WorkerDied:
            t_err = time.monotonic()
        watch.join(10)
        r["from_kill_ms"] = (t_served - t_kill) * 1e3
        r["from_error_ms"] = (t_served - t_err) * 1e3
        r["from_death_ms"] = (t_served - watch.at) * 1e3 if watch.at else None
    watch.stop = True
    r["served_by"] = served["pid"]
    r["served_by_spare"] = served["pid"] == spare_pid
    if spares and not r["served_by_spare"]:
        raise RuntimeError(f"with a spare, the next job ran in pid {served['pid']}, not the "
                           f"spare's {spare_pid}: {r}")
    busy.stop()
    try:
        busy.result(timeout=30)
    except gpuq.Cancelled:
        pass
    return r


def summary(values):
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable,
                    help="the workers' interpreter (with torch and gpuq)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--text")
    args = ap.parse_args()

    probe = subprocess.run([args.python, "-c", "import time; t=time.monotonic(); import torch; "
                            "print(torch.__version__, time.monotonic()-t)"],
                           capture_output=True, text=True, check=True)
    torch_version, import_s = probe.stdout.split()
    rounds = []
    starts = {}
    for spares in (0, 1):
        cfg = {"pools": [{"name": "torch", "kind": "cpu", "workers": 2, "spare_workers": spares,
                          "cpus": [0, 1],
                          "python": {"interpreter": args.python,
                                     "modules": ["bench_spares_ops"], "path": [str(HERE)]}}],
               "cancel_grace_ms": 500,
               # Every crash waits the back-off of a first death (100 ms), not one doubled by
               # the rounds before it.
               "restart_backoff_initial_ms": 100, "restart_backoff_max_ms": 100}
        with gpuq.testing.Daemon(cfg, start_timeout=180) as d, \
                gpuq.connect(d.runtime_dir, name="bench-spares") as c:
            st = wait_whole(d, spares)
            starts[spares] = [w["start_ms"] for w in st["workers"]]
            for scenario in ("forced", "crash"):
                for i in range(args.repeats):
                    try:
                        r = one_round(d, c, scenario, spares)
                    except BaseException:
                        sys.stderr.write(d.log()[-20000:])
                        raise
                    r["round"] = i
                    rounds.append(r)
                    print(json.dumps(r), flush=True)
    cases = {}
    for scenario in ("forced", "crash"):
        for spares in (0, 1):
            rs = [r for r in rounds if r["scenario"] == scenario and r["spares"] == spares]
            cases[f"{scenario}/{spares}"] = {
                k: summary([r.get(k) for r in rs])
                for k in ("from_stop_ms", "from_kill_ms", "from_death_ms", "from_error_ms")
                if k in rs[0]}
            cases[f"{scenario}/{spares}"]["served_by_spare"] = sum(r["served_by_spare"] for r in rs)
    ratios = {}
    for scenario in ("forced", "crash"):
        for k, v in cases[f"{scenario}/0"].items():
            w = cases[f"{scenario}/1"].get(k)
            if isinstance(v, dict) and isinstance(w, dict) and w["median"] > 0:
                ratios[f"{scenario}/{k}"] = v["median"] / w["median"]
    doc = {"benchmark": "bench_spares", "command": " ".join([sys.executable] + sys.argv),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                       "python": platform.python_version(), "torch": torch_version,
                       "torch_import_s": float(import_s)},
           "worker_start_ms": starts, "cases": cases, "ratios_0_over_1": ratios,
           "rounds": rounds}
    lines = [f"bench_spares: torch {torch_version} (import {float(import_s):.2f} s), "
             f"{os.cpu_count()} CPUs, {args.repeats} rounds per case",
             f"worker start (status start_ms): {starts}"]
    for case, v in cases.items():
        parts = [f"{k} median {s['median']:.1f} (min {s['min']:.1f}, max {s['max']:.1f})"
                 for k, s in v.items() if isinstance(s, dict)]
        lines.append(f"{case:9s} " + "; ".join(parts) + f"; served by the spare {v['served_by_spare']}")
    lines.append("ratios of medians, 0 spares / 1 spare: " +
                 ", ".join(f"{k} {r:.0f}x" for k, r in ratios.items()))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    if args.text:
        pathlib.Path(args.text).write_text(text)


if __name__ == "__main__":
    main()
