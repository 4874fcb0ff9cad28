#!/usr/bin/env python3
"""A client's wait under other clients' floods (issue 41), side by side for one or more builds.

A pool of 2 cpu workers runs the built-in ``sleep`` op for 1 ms per job. The victim, a
``gpuqctl submit`` process, sends one job at a time (--concurrency 1) and reports its
submit-to-complete p50 and p99; the floods are other ``gpuqctl submit`` processes that each
keep 8 jobs in flight for as long as the victim runs. Scenarios: the victim alone, under 1, 2
and 8 floods; a victim keeping 4 jobs in flight under 8 floods, at normal priority and (for
builds whose gpuqctl has --priority) at high priority. Every build gets its own gpuqd (its layout is its own), and the builds take
turns, round by round, so that drift of the machine hits all alike.

    python3 bench/bench_fairness.py --build before=/tmp/ab-base/build-device \\
        --build after=build --rounds 3 --jobs 400 --out bench/results/fairness-DATE

Only the standard library: each build's gpuqd and gpuqctl do the work. Output: a table on
stdout (medians over the rounds), and with --out, FILE.json (every round) and FILE.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

JOB_US = 1000
FLOOD_INFLIGHT = 8


def parse_duration(text: str) -> float:
    """gpuqctl's format_ns ("950.0 us", "1.23 ms", "1.234 s", "800 ns") in milliseconds."""
    value, unit = text.split()
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    return float(value) * scale


class Daemon:
    def __init__(self, build: Path, workdir: Path):
        self.build = build
        self.dir = Path(tempfile.mkdtemp(prefix="fairness-", dir=workdir))
        config = {
            "log_level": "warning",
            "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}],
        }
        (self.dir / "config.json").write_text(json.dumps(config))
        self.log = open(self.dir / "gpuqd.log", "w")
        self.proc = subprocess.Popen(
            [
                str(build / "daemon" / "gpuqd"),
                "--config",
                str(self.dir / "config.json"),
                "--runtime-dir",
                str(self.dir),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        ready = self.ctl(["ready", "--wait", "30"], check=False)
        if ready.returncode != 0:
            self.stop()
            raise SystemExit(f"gpuqd of {build} did not get ready: {ready.stdout}")

    def ctl(self, args: list, check: bool = True) -> subprocess.CompletedProcess:
        r = subprocess.run(
            [str(self.build / "tools" / "gpuqctl"), "--runtime-dir", str(self.dir), *args],
            capture_output=True,
            text=True,
        )
        if check and r.returncode != 0:
            raise SystemExit(f"gpuqctl {' '.join(args)}: {r.stdout}{r.stderr}")
        return r

    def flood(self) -> subprocess.Popen:
        return subprocess.Popen(
            [
                str(self.build / "tools" / "gpuqctl"),
                "--runtime-dir",
                str(self.dir),
                "submit",
                "sleep",
                "--param",
                f"us={JOB_US}",
                "--count",
                "100000000",
                "--concurrency",
                str(FLOOD_INFLIGHT),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def victim(self, jobs: int, priority: str | None, inflight: int) -> dict:
        args = ["submit", "sleep", "--param", f"us={JOB_US}", "--count", str(jobs)]
        args += ["--concurrency", str(inflight)]
        if priority is not None:
            args += ["--priority", priority]
        out = self.ctl(args).stdout
        m = re.search(r"p50 ([\d.]+ \w+), p90 ([\d.]+ \w+), p99 ([\d.]+ \w+)", out)
        if m is None:
            raise SystemExit(f"no latency line in gpuqctl's output: {out}")
        return {
            "p50_ms": parse_duration(m.group(1)),
            "p90_ms": parse_duration(m.group(2)),
            "p99_ms": parse_duration(m.group(3)),
        }

    def supports_priority(self) -> bool:
        return "--priority" in self.ctl(["--help"], check=False).stdout

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


# (label, floods, the victim's priority, the victim's jobs in flight)
SCENARIOS = [
    ("alone", 0, None, 1),
    ("1 flood", 1, None, 1),
    ("2 floods", 2, None, 1),
    ("8 floods", 8, None, 1),
    ("4 in flight, 8 floods", 8, None, 4),
    ("high, 4 in flight, 8 floods", 8, "high", 4),
]


def run_scenario(d: Daemon, floods: int, priority: str | None, inflight: int, jobs: int) -> dict:
    procs = [d.flood() for _ in range(floods)]
    try:
        time.sleep(0.5 if floods else 0.1)  # the floods' queues fill
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a flood exited early ({p.returncode})")
        return d.victim(jobs, priority, inflight)
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=BUILD_DIR")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=400, help="victim jobs per scenario and round")
    ap.add_argument("--out", help="write OUT.json and OUT.txt")
    a = ap.parse_args()
    builds = []
    for spec in a.build:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"--build {spec!r}: NAME=BUILD_DIR")
        builds.append((name, Path(path).resolve()))
    workdir = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    results: dict = {name: {s[0]: [] for s in SCENARIOS} for name, _ in builds}
    for r in range(a.rounds):
        for name, build in builds:
            d = Daemon(build, workdir)
            try:
                high = d.supports_priority()
                for label, floods, priority, inflight in SCENARIOS:
                    if priority is not None and not high:
                        continue
                    res = run_scenario(d, floods, priority, inflight, a.jobs)
                    results[name][label].append(res)
                    print(
                        f"round {r + 1} {name:>8} {label:<28} p50 {res['p50_ms']:6.2f} ms"
                        f"  p99 {res['p99_ms']:6.2f} ms",
                        flush=True,
                    )
            finally:
                d.stop()
    lines = [
        f"victim: 1 job at a time (or as the scenario says), sleep {JOB_US} us per job, 2 cpu "
        f"workers; floods keep "
        f"{FLOOD_INFLIGHT} in flight each; {a.jobs} victim jobs per round, medians of "
        f"{a.rounds} rounds (ms)",
        "",
        "| scenario | " + " | ".join(f"{n} p50 | {n} p99" for n, _ in builds) + " |",
        "| --- | " + " | ".join("---: | ---:" for _ in builds) + " |",
    ]
    for label, _, _, _ in SCENARIOS:
        cells = []
        for name, _ in builds:
            runs = results[name][label]
            if not runs:
                cells += ["-", "-"]
                continue
            cells.append(f"{statistics.median(x['p50_ms'] for x in runs):.2f}")
            cells.append(f"{statistics.median(x['p99_ms'] for x in runs):.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print()
    print(text)
    if a.out:
        meta = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "host_cpus": os.cpu_count(),
            "builds": {n: str(p) for n, p in builds},
            "rounds": a.rounds,
            "victim_jobs": a.jobs,
            "job_us": JOB_US,
            "flood_inflight": FLOOD_INFLIGHT,
            "results": results,
        }
        Path(a.out + ".json").write_text(json.dumps(meta, indent=1) + "\n")
        Path(a.out + ".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
