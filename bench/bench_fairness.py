#!/usr/bin/env python3
"""A client's wait under other clients' floods (issue 41), side by side for one or more builds.

A pool of 2 cpu workers runs the built-in ``sleep`` op for 1 ms per job. The victim, a
``gpuqctl submit`` process, sends one job at a time (--concurrency 1) and reports its
submit-to-complete p50 and p99; the floods are other ``gpuqctl submit`` processes that each
keep 8 jobs in flight for as long as the victim runs. Scenarios: the victim alone, under 1, 2
and 8 floods; a victim keeping 4 jobs in flight under 8 floods, at normal priority and (for
builds whose gpuqctl has --priority) at high priority. Every build gets its own gpuqd (its layout is its own), and the builds take
turns, round by round, so that drift of the machine hits all alike.

Client weights (for builds whose gpuqd knows ``client_weights``; run as root): two floods at
once, one as this user and one as ``nobody`` (``setpriv``), each keeping 8 jobs in flight, with
the weights each scenario gives the two users; each flood's jobs completed per second over
--seconds, read from gpuqctl's progress line (it prints one every 200 ms to a terminal: here a
pseudo-terminal), and their ratio. The daemon of these scenarios lets ``nobody`` in
(``allowed_users``, ``group``: its socket, runtime directory and queue segment).

    python3 bench/bench_fairness.py --build before=/tmp/ab-base/build-device \\
        --build after=build --rounds 3 --jobs 400 --out bench/results/fairness-DATE
    python3 bench/bench_fairness.py --build after=build --only weights --rounds 3 \\
        --out bench/results/fairness-weights-DATE

Only the standard library: each build's gpuqd and gpuqctl do the work. Output: a table on
stdout (medians over the rounds), and with --out, FILE.json (every round) and FILE.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import pwd
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

JOB_US = 1000
FLOOD_INFLIGHT = 8
OTHER_USER = "nobody"  # the second flood's user in the weights scenarios
WARMUP_S = 1.0  # the weights scenarios: both floods run this long before the window opens


def parse_duration(text: str) -> float:
    """gpuqctl's format_ns ("950.0 us", "1.23 ms", "1.234 s", "800 ns") in milliseconds."""
    value, unit = text.split()
    scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[unit]
    return float(value) * scale


class Daemon:
    def __init__(self, build: Path, workdir: Path, extra: dict | None = None):
        self.build = build
        self.dir = Path(tempfile.mkdtemp(prefix="fairness-", dir=workdir))
        config = {
            "log_level": "warning",
            "pools": [{"name": "cpu", "kind": "cpu", "workers": 2}],
            **(extra or {}),
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

    def flood_argv(self) -> list:
        return [
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
        ]

    def flood(self) -> subprocess.Popen:
        return subprocess.Popen(
            self.flood_argv(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
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

    def client_weights(self) -> dict:
        """pid -> (client index, weight) of the clients with jobs (status' client_jobs)."""
        doc = json.loads(self.ctl(["status", "--json"]).stdout)
        return {c["pid"]: (c["client"], c.get("weight")) for c in doc.get("client_jobs", [])}

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


def knows_client_weights(build: Path) -> bool:
    """Whether the build's gpuqd takes the config key client_weights (--check-config)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(
            {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "client_weights": []}, f
        )
        f.flush()
        r = subprocess.run(
            [str(build / "daemon" / "gpuqd"), "--config", f.name, "--check-config"],
            capture_output=True,
            text=True,
        )
    return r.returncode == 0


class Progress:
    """A flood whose jobs completed are read over time from gpuqctl submit's progress line
    ("N/M jobs done, F failed, R jobs/s"), which it prints every 200 ms when its stdout is a
    terminal: here a pseudo-terminal, read by a thread that stamps each line as it comes."""

    LINE = re.compile(rb"(\d+)/\d+ jobs done, (\d+) failed, \d+ jobs/s")

    def __init__(self, argv: list):
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=subprocess.DEVNULL
        )
        os.close(slave)
        self.master = master
        self.lock = threading.Lock()
        self.last: tuple | None = None  # (monotonic seconds, jobs done, jobs failed)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: the flood has exited
                return
            if not chunk:
                return
            now = time.monotonic()
            buf += chunk
            lines = list(self.LINE.finditer(buf))
            if lines:
                with self.lock:
                    self.last = (now, int(lines[-1].group(1)), int(lines[-1].group(2)))
                buf = buf[lines[-1].end() :]

    def sample(self) -> tuple:
        with self.lock:
            if self.last is None:
                raise SystemExit("a flood printed no progress line")
            return self.last

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)
        self.thread.join(5)


def other_user() -> tuple:
    """(uid, gid, "") of OTHER_USER, or (None, None, why this process cannot run as it)."""
    try:
        pw = pwd.getpwnam(OTHER_USER)
    except KeyError:
        return None, None, f"no user {OTHER_USER!r}"
    r = subprocess.run(
        [
            "setpriv",
            f"--reuid={pw.pw_uid}",
            f"--regid={pw.pw_gid}",
            "--clear-groups",
            "true",
        ],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        return None, None, f"setpriv to {OTHER_USER} failed (run as root): {r.stderr.strip()}"
    return pw.pw_uid, pw.pw_gid, ""


# (label, weight of this user's flood, weight of OTHER_USER's flood)
WEIGHT_SCENARIOS = [
    ("3:1", 3, 1),
    ("1:3", 1, 3),
    ("1:1", 1, 1),
]


def run_weights(
    build: Path, workdir: Path, mine: int, theirs: int, uid: int, gid: int, seconds: float
) -> dict:
    """Two floods at once, this user's at weight `mine`, OTHER_USER's at `theirs`: each one's
    jobs completed per second over `seconds`, after WARMUP_S of both running."""
    me = os.getuid()
    extra = {
        "group": gid,
        "allowed_users": [me, uid],
        "client_weights": [{"user": me, "weight": mine}, {"user": uid, "weight": theirs}],
    }
    d = Daemon(build, workdir, extra)
    floods = []
    try:
        setpriv = ["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups"]
        floods = [Progress(d.flood_argv()), Progress(setpriv + d.flood_argv())]
        time.sleep(WARMUP_S)
        for f in floods:
            if f.proc.poll() is not None:
                raise SystemExit(f"a flood exited early ({f.proc.returncode})")
        first = [f.sample() for f in floods]
        seen = d.client_weights()
        time.sleep(seconds)
        last = [f.sample() for f in floods]
        rates = []
        for a, b in zip(first, last):
            if b[2] != a[2]:
                raise SystemExit(f"a flood's jobs failed: {b[2] - a[2]}")
            rates.append((b[1] - a[1]) / (b[0] - a[0]))
        return {
            "jobs_per_s": {"mine": rates[0], "theirs": rates[1]},
            "ratio": rates[0] / rates[1] if rates[1] else None,
            "window_s": [last[0][0] - first[0][0], last[1][0] - first[1][0]],
            # What the daemon showed for each flood: its client index and weight.
            "seen": {
                "mine": seen.get(floods[0].proc.pid),
                "theirs": seen.get(floods[1].proc.pid),
            },
        }
    finally:
        for f in floods:
            f.stop()
        d.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", action="append", required=True, help="NAME=BUILD_DIR")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=400, help="victim jobs per scenario and round")
    ap.add_argument("--seconds", type=float, default=4.0, help="each weights scenario's window")
    ap.add_argument("--only", choices=["latency", "weights"], help="run only these scenarios")
    ap.add_argument("--out", help="write OUT.json and OUT.txt")
    a = ap.parse_args()
    builds = []
    for spec in a.build:
        name, _, path = spec.partition("=")
        if not path:
            ap.error(f"--build {spec!r}: NAME=BUILD_DIR")
        builds.append((name, Path(path).resolve()))
    workdir = Path(tempfile.mkdtemp(prefix="bench-fairness-"))
    latency = a.only in (None, "latency")
    weights = a.only in (None, "weights")
    me = pwd.getpwuid(os.getuid()).pw_name
    uid, gid, why_not = other_user() if weights else (None, None, "not asked for")
    if weights and uid is None:
        print(f"weights scenarios skipped: {why_not}", flush=True)
    if uid is not None:
        os.chmod(workdir, 0o711)  # OTHER_USER reaches the runtime directories inside
    knows = {name: uid is not None and knows_client_weights(build) for name, build in builds}
    results: dict = {name: {s[0]: [] for s in SCENARIOS} for name, _ in builds}
    wresults: dict = {name: {s[0]: [] for s in WEIGHT_SCENARIOS} for name, _ in builds}
    for r in range(a.rounds):
        for name, build in builds:
            if latency:
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
            if not knows[name]:
                continue
            for label, mine, theirs in WEIGHT_SCENARIOS:
                res = run_weights(build, workdir, mine, theirs, uid, gid, a.seconds)
                wresults[name][label].append(res)
                rates = res["jobs_per_s"]
                print(
                    f"round {r + 1} {name:>8} weights {me} : {OTHER_USER} {label:<5}"
                    f" {rates['mine']:7.1f} : {rates['theirs']:7.1f} jobs/s,"
                    f" ratio {res['ratio']:.2f}  (daemon saw {res['seen']})",
                    flush=True,
                )
    lines = []
    if latency:
        lines += [
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
    if weights:
        if lines:
            lines.append("")
        if uid is None:
            lines.append(f"weights scenarios skipped: {why_not}")
        else:
            lines += [
                f"weights: two floods at once, one as {me} and one as {OTHER_USER}, each keeping "
                f"{FLOOD_INFLIGHT} in flight, sleep {JOB_US} us per job, 2 cpu workers; "
                f"client_weights {me} : {OTHER_USER} as the scenario says; each flood's jobs "
                f"completed per second over {a.seconds:g} s after {WARMUP_S:g} s of both "
                f"running, medians of {a.rounds} rounds (the ratio: the median of the rounds' "
                f"ratios)",
                "",
                "| weights | "
                + " | ".join(
                    f"{n} {me} jobs/s | {n} {OTHER_USER} jobs/s | {n} ratio" for n, _ in builds
                )
                + " |",
                "| --- | " + " | ".join("---: | ---: | ---:" for _ in builds) + " |",
            ]
            for label, _, _ in WEIGHT_SCENARIOS:
                cells = []
                for name, _ in builds:
                    runs = wresults[name][label]
                    if not runs:
                        cells += ["-", "-", "-"]
                        continue
                    cells.append(f"{statistics.median(x['jobs_per_s']['mine'] for x in runs):.0f}")
                    cells.append(
                        f"{statistics.median(x['jobs_per_s']['theirs'] for x in runs):.0f}"
                    )
                    cells.append(f"{statistics.median(x['ratio'] for x in runs):.2f}")
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
            "results": results if latency else {},
        }
        if weights:
            meta["weights"] = {
                "users": {"mine": me, "theirs": OTHER_USER},
                "skipped": why_not if uid is None else None,
                "scenarios": {label: [m, t] for label, m, t in WEIGHT_SCENARIOS},
                "warmup_s": WARMUP_S,
                "window_s": a.seconds,
                "results": wresults,
            }
        Path(a.out + ".json").write_text(json.dumps(meta, indent=1) + "\n")
        Path(a.out + ".txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
