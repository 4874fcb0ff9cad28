#!/usr/bin/env python3
"""Step-level batching (issue 42, point 3): a small autoregressive model serving sequences of 4
to 64 tokens to many clients, with step-level batching against request-level batching and
against none, side by side in one run on one machine.

The model: a GRU language model in torch, float32 (64 tokens, embedding 32, ``GRUCell(32,
128)``, a linear head 128 -> 64, greedy decoding: each step takes the argmax), defined in
bench_steps_ops.py with its weights made once per worker from a fixed seed (its ``on_start``
hook; ``torch.set_num_threads(1)``, ``torch.inference_mode()``). A sequence is asked for by a
start token (0 to 63) and a length; its tokens are a function of the two. Three ops serve it,
asked for in four modes:

  step      ``gen_step``: ``@gpuq.step_op("gen_step", start=..., max_batch_size=32)``; each step
            runs the cell once for the live sequences of the worker (from any client), a new
            sequence joins at the next step and a done one leaves. Asked for with
            ``client.stream("gen_step", token, length, window=4, part_bytes=256)``: each token
            comes as a part as its step ends;
  request   ``gen_batched``: ``@gpuq.op("gen_batched", max_batch_size=32,
            max_queue_delay_us=500)``; a job is one row (``tokens`` and ``lengths``, int64 arrays
            of shape (1,)); a worker gathers queued jobs (up to 32 rows, until 500 us have
            passed) and runs all of their rows, padded, until the longest sequence of the call
            has ended: a short sequence waits for the longest of its batch, and queued requests
            wait for the whole batch. Asked for with ``client.call``: the answer, (1, longest)
            int64, comes at once at the end;
  none      ``gen_single``: ``@gpuq.op("gen_single")``, one sequence per call, ``client.call``;
  step-call a diagnostic: the step op asked for with ``client.call("gen_step", token, length)``,
            its tokens gathered in the worker and answered at the end (the same step-level
            batching without a part streamed per token: what streaming costs).

Setup: a private gpuqd (``gpuq.testing.Daemon``) with one Python pool ``py`` of 2 CPU workers
(--workers; this interpreter, importing bench_steps_ops.py from this directory) and
``queue_factor`` 32, so that the pool's ring (64 cells with 2 workers) holds every request of
32 clients at once. Two workers: one per core of the 2-core machine this was written on; each
worker runs its own step loop (up to 32 live sequences) or its own request-level batches, and
the clients share the same cores. The same pool serves the three ops.

Clients: N processes (``multiprocessing``, spawn; --clients, 32), started once for the whole
run and reused, each connected with ``gpuq.connect(runtime_dir)``. In a run, told a common start
time, each client asks for sequences in a closed loop (one in flight per client) for a warm-up
(--warmup, 0.5 s) and then the measured window (--duration, 4 s): each sequence's start token
(0 to 63) and length (4 to 64, uniform) come from the client's own ``random.Random(1000 +
index)``, made anew for every run, so every op sees the same sequences. Each sequence is timed
with ``time.monotonic_ns`` from before the submit to its first token (time to first token,
TTFT) and to its last (the sequence's latency). For the step op the first token is the
stream's first part; for the request-level op, the unbatched one and step-call, whose answer
comes whole at the end, the first token arrives with the last: their TTFT is their latency. The
sequences whose last token arrives inside the window count. Figures per mode and run: tokens/s
(the tokens of the sequences counted, over the window's length), sequences/s, TTFT p50 and p99,
latency p50 and p99 (nearest rank over all the clients' sequences in the window), the clients'
CPU per token (``getrusage``), the workers' CPU (/proc/<pid>/stat) per token they made (their
counters; both over the whole run, warm-up included) and the machine's busy share
(/proc/stat). Every sequence's token count is checked,
and each client's last sequence of every run is checked against the unbatched op's tokens for
the same start token and length (asked for after the run).

Rows per call: when the daemon's metrics (``gpuq.metrics(runtime_dir)``) have the family
``gpuq_batch_rows`` (rows per call of a batched op's function; for a step op, sequences per
step), the mean for each batched mode in each run is its ``_sum`` over its ``_count`` between a
scrape before and one after the run; without it, "-". Where a step's time goes: the ops module
counts, per worker and per step size, the steps, their time inside the step function, and the
time from the end of one step's function to the start of the next (the worker's own work
between two steps: the parts encoded and published, sequences ended and admitted, the calls
into Python; and, on a busy machine, the time it waits for a core; gaps over 5 ms, an idle
worker, are left out); ``gen_stats`` reports them, asked of each worker before and after every
run, and the report shows their means per run and, for the streamed step mode, by step size.
The request-level op's counters give its rows and steps per call and the share of its rows'
steps that made no token (padding).

Method: the runs are interleaved, so that drift of the machine falls on all ops alike: each
round (--rounds, 3) measures every client count in every mode (--modes, default step, request,
none, step-call), their order rotated by one each round (step, request, none, step-call;
request, none, step-call, step; ...). A figure is the median of its rounds' values (the JSON
keeps each round's). Before the rounds, correctness: 24 (token,
length) pairs (lengths 4 to 64, 4 and 64 included) sent to the unbatched op one by one give
the reference; the step op streamed (24 streams open at once, so that they share steps) and
called (24 calls in flight), and the request-level op as 24 one-row jobs in flight and as one
24-row job, must give exactly the same tokens. The model is float32, and the cell's arithmetic
may differ in its last bits between batch sizes; greedy decoding turns such a difference into a
different token only at a near-tie of two logits, and none was seen (the check is exact, and so
is each client's check of its last sequence; a mismatch would fail the run, not be hidden).

Targets (printed as met/missed; the exit status does not depend on them), at 32 clients:
  tokens/s step / tokens/s request >= 2;
  TTFT p99 step < TTFT p50 request.

Usage (from the repository root, in a venv with ``pip install ./python numpy torch``)::

    GPUQ_GPUQD=build/daemon/gpuqd python bench/python/bench_steps.py [--json FILE]

The gpuqd binary: --gpuqd, else $GPUQ_GPUQD, else <repo>/build/daemon/gpuqd. A default run
takes about a minute and a half (3 rounds x 4 modes x about 5 s, plus starting 32 client
processes and the daemon); ``--quick`` is a smoke run (one round of 0.5 s runs; its figures mean
nothing). ``--json FILE`` writes every figure with the machine's facts (CPU model, nproc,
Python, torch and numpy versions, date, git commit). Options: --clients (comma-separated, e.g.
8,32; default 32), --modes (step,request,none,step-call), --duration (4 s), --warmup (0.5 s),
--rounds (3), --workers (2), --window (the step op's stream window, 4), --client-spin-us
(default: gpuq.connect's), --gpuqd, --quick, --json. Exit status: 0 when every run ran and
every checked result was right, 1 on any failure, 2 on bad arguments. See BENCHMARKS.md,
"Step-level batching".
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
import random
import resource
import shlex
import signal
import socket
import sys
import time
import traceback
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from bench_python import (
    median,
    package_versions,
    pool_worker_pids,
    scrape_batch_rows,
    worker_cpu_s,
)
from bench_python import (
    cpu_model,
    load_average,
    machine_cpu,
    own_cpu_s,
    percentile,
    source_commit,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OPS_DIR = os.path.dirname(os.path.abspath(__file__))

WORKERS = 2
QUEUE_FACTOR = 32  # a ring of 32 cells per worker: every request of 32 clients fits
POOL = "py"
VOCAB, MIN_LENGTH, MAX_LENGTH = 64, 4, 64
STEP, BATCHED, SINGLE = "gen_step", "gen_batched", "gen_single"
# The modes, each an op and how it is asked: "step-call" (the step op through client.call, its
# tokens gathered in the worker: no part streamed) only when --modes names it.
MODE_OP = {"step": STEP, "request": BATCHED, "none": SINGLE, "step-call": STEP}
MODES = ("step", "request", "none", "step-call")
MAX_BATCH_SIZE, MAX_QUEUE_DELAY_US = (
    32,
    500,
)  # as in bench_steps_ops.py (for the record)
WINDOW, PART_BYTES = (
    4,
    256,
)  # the step op's streams: 4 cells of 256 bytes (a part is a token)
CHECK_PAIRS = 24
CALL_TIMEOUT = 120.0
TARGET_TOKENS_RATIO, TARGET_CLIENTS = 2.0, 32
SIZE_BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 24), (25, 32))


def daemon_config(workers: int) -> Dict[str, Any]:
    """A Python pool of ``workers`` CPU workers importing bench_steps_ops."""
    return {
        "queue_factor": QUEUE_FACTOR,
        "pools": [
            {
                "name": POOL,
                "kind": "cpu",
                "workers": workers,
                "python": {
                    "interpreter": sys.executable,
                    "modules": ["bench_steps_ops"],
                    "path": [OPS_DIR],
                },
            }
        ],
    }


# ---- the client processes ----------------------------------------------------------------------


def one_sequence(
    client: Any, mode: str, token: int, length: int, window: int = WINDOW
) -> Tuple[int, int, List[int]]:
    """Asks for one sequence as ``mode`` says: (ns to its first token, ns to its last, its
    tokens), the times from just before the submit."""
    clock = time.monotonic_ns
    t1 = clock()
    if mode == "step":
        with client.stream(
            STEP,
            token,
            length,
            pool=POOL,
            window=window,
            part_bytes=PART_BYTES,
            timeout=CALL_TIMEOUT,
        ) as s:
            first = s.next(timeout=CALL_TIMEOUT)
            tf = clock()
            tokens = [int(first)]
            for part in s:
                tokens.append(int(part))
        t2 = clock()
        return tf - t1, t2 - t1, tokens
    if mode == "step-call":
        r = client.call(STEP, token, length, pool=POOL, timeout=CALL_TIMEOUT)
        t2 = clock()
        return t2 - t1, t2 - t1, [int(p) for p in r]
    if mode == "request":
        r = client.call(
            BATCHED,
            np.array([token], dtype=np.int64),
            np.array([length], dtype=np.int64),
            pool=POOL,
            timeout=CALL_TIMEOUT,
        )
        t2 = clock()
        row = np.asarray(r)
        if row.ndim != 2 or row.shape[0] != 1 or row.shape[1] < length:
            raise RuntimeError(
                f"{BATCHED}: an answer of shape {row.shape} for length {length}"
            )
        return t2 - t1, t2 - t1, row[0, :length].tolist()
    r = client.call(SINGLE, token, length, pool=POOL, timeout=CALL_TIMEOUT)
    t2 = clock()
    return t2 - t1, t2 - t1, np.asarray(r).tolist()


def client_main(
    index: int, runtime_dir: str, spin_us: Optional[float], window: int, conn: Any
) -> None:
    """A client process: connects, checks one sequence of each op, reports ready, then serves
    ("run", mode, t0_ns, begin_ns, end_ns) commands until ("stop",)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us
    try:
        import gpuq

        if spin_us is None:
            client = gpuq.connect(runtime_dir, name=f"bench_steps_{index}")
        else:
            client = gpuq.Client(
                runtime_dir, name=f"bench_steps_{index}", spin_us=spin_us
            )
        token, length = (
            index % VOCAB,
            MIN_LENGTH + index % (MAX_LENGTH - MIN_LENGTH + 1),
        )
        want = one_sequence(client, "none", token, length)[2]
        for mode in ("step", "step-call", "request"):
            got = one_sequence(client, mode, token, length, window)[2]
            if got != want:
                raise RuntimeError(
                    f"client {index}: {mode} ({token}, {length}) gave {got}, {SINGLE} {want}"
                )
        conn.send(("ready", index))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    clock = time.monotonic_ns
    while True:
        cmd = conn.recv()
        if cmd[0] == "stop":
            break
        _, mode, t0, begin, end = cmd
        try:
            gc.collect()
            rng = random.Random(1000 + index)  # the same sequences for every op
            ttft = array.array("q")
            lat = array.array("q")
            tokens_in_window = 0
            n_all = 0
            bad: List[str] = []
            wait = (t0 - clock()) / 1e9
            if wait > 0:
                time.sleep(wait)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            last: Tuple[int, int, List[int]] = (0, 0, [])
            while True:
                token, length = (
                    rng.randrange(VOCAB),
                    rng.randint(MIN_LENGTH, MAX_LENGTH),
                )
                first_ns, all_ns, got = one_sequence(
                    client, mode, token, length, window
                )
                t2 = clock()
                n_all += 1
                if len(got) != length and len(bad) < 3:
                    bad.append(f"{mode} ({token}, {length}) gave {len(got)} tokens")
                last = (token, length, got)
                if t2 > end:
                    break
                if t2 >= begin:
                    ttft.append(first_ns)
                    lat.append(all_ns)
                    tokens_in_window += len(got)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
            token, length, got = last
            want = np.asarray(
                client.call(SINGLE, token, length, pool=POOL, timeout=CALL_TIMEOUT)
            ).tolist()
            if got != want:
                bad.append(
                    f"the last sequence, {mode} ({token}, {length}): {got} != {want}"
                )
            conn.send(
                (
                    "done",
                    ttft.tobytes(),
                    lat.tobytes(),
                    tokens_in_window,
                    n_all,
                    cpu,
                    bad,
                )
            )
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    client.close()


class Clients:
    """The client processes, started once and reused by every run."""

    def __init__(
        self, n: int, runtime_dir: str, spin_us: Optional[float], window: int
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.procs: List[Any] = []
        self.conns: List[Any] = []
        try:
            for i in range(n):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=client_main,
                    args=(i, runtime_dir, spin_us, window, child),
                    name=f"bench_steps_client_{i}",
                    daemon=True,
                )
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            for i, c in enumerate(self.conns):
                if not c.poll(180):
                    raise RuntimeError(f"client {i} did not start within 180 s")
                msg = c.recv()
                if msg[0] != "ready":
                    raise RuntimeError(f"client {i} failed to start:\n{msg[1]}")
        except BaseException:
            self.close()
            raise

    def run(
        self, n: int, mode: str, warmup_s: float, duration_s: float
    ) -> Dict[str, Any]:
        """One run of the first n clients: their TTFTs and latencies in the window (ns), the
        tokens of the sequences in the window, the sequences made in all, their CPU seconds,
        and what their checks found wrong."""
        clock = time.monotonic_ns
        t0 = clock() + 100_000_000  # 0.1 s for the commands to arrive
        begin = t0 + int(warmup_s * 1e9)
        end = begin + int(duration_s * 1e9)
        for c in self.conns[:n]:
            c.send(("run", mode, t0, begin, end))
        out: Dict[str, Any] = {
            "ttft": [],
            "lat": [],
            "tokens": 0,
            "all": 0,
            "cpu": 0.0,
            "bad": [],
        }
        errors = []
        for i, c in enumerate(self.conns[:n]):
            if not c.poll(duration_s + warmup_s + 2 * CALL_TIMEOUT):
                raise RuntimeError(f"client {i} did not finish its run")
            msg = c.recv()
            if msg[0] != "done":
                errors.append(f"client {i}:\n{msg[1]}")
                continue
            for key, raw in (("ttft", msg[1]), ("lat", msg[2])):
                a = array.array("q")
                a.frombytes(raw)
                out[key].extend(a)
            out["tokens"] += msg[3]
            out["all"] += msg[4]
            out["cpu"] += msg[5]
            out["bad"].extend(f"client {i}: {b}" for b in msg[6])
        if errors:
            raise RuntimeError("\n".join(errors))
        return out

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


# ---- checks and counters -----------------------------------------------------------------------


def check_correctness(client: Any) -> Dict[str, Any]:
    """24 (token, length) pairs: the unbatched op one by one (the reference), the step op as
    24 streams open at once and as 24 calls in flight, the request-level op as 24 one-row jobs
    in flight and as one 24-row job. Raises on a difference."""
    rng = random.Random(7)
    pairs = [
        (rng.randrange(VOCAB), rng.randint(MIN_LENGTH, MAX_LENGTH))
        for _ in range(CHECK_PAIRS)
    ]
    pairs[0] = (pairs[0][0], MIN_LENGTH)
    pairs[1] = (pairs[1][0], MAX_LENGTH)
    ref = [
        np.asarray(client.call(SINGLE, t, n, pool=POOL, timeout=CALL_TIMEOUT)).tolist()
        for t, n in pairs
    ]
    streams = [
        client.stream(STEP, t, n, pool=POOL, window=WINDOW, part_bytes=PART_BYTES)
        for t, n in pairs
    ]
    streamed = []
    for s in streams:
        with s:
            streamed.append([int(p) for p in s])
    futures = [client.submit_call(STEP, t, n, pool=POOL) for t, n in pairs]
    called = [[int(p) for p in f.result(timeout=CALL_TIMEOUT)] for f in futures]
    futures = [
        client.submit_call(
            BATCHED,
            np.array([t], dtype=np.int64),
            np.array([n], dtype=np.int64),
            pool=POOL,
        )
        for t, n in pairs
    ]
    rows = [np.asarray(f.result(timeout=CALL_TIMEOUT)) for f in futures]
    in_flight = [r[0, :n].tolist() for r, (_, n) in zip(rows, pairs)]
    padded_ok = all(bool((r[0, n:] == -1).all()) for r, (_, n) in zip(rows, pairs))
    whole = np.asarray(
        client.call(
            BATCHED,
            np.array([t for t, _ in pairs], dtype=np.int64),
            np.array([n for _, n in pairs], dtype=np.int64),
            pool=POOL,
            timeout=CALL_TIMEOUT,
        )
    )
    if whole.shape != (CHECK_PAIRS, MAX_LENGTH):
        raise RuntimeError(
            f"correctness: the 24-row {BATCHED} job answered {whole.shape}, want "
            f"({CHECK_PAIRS}, {MAX_LENGTH})"
        )
    one_job = [whole[i, :n].tolist() for i, (_, n) in enumerate(pairs)]
    for name, got in (
        ("step_streamed", streamed),
        ("step_called", called),
        ("request_in_flight", in_flight),
        ("request_one_job", one_job),
    ):
        bad = [i for i in range(CHECK_PAIRS) if got[i] != ref[i]]
        if bad:
            i = bad[0]
            raise RuntimeError(
                f"correctness: {name} differs from {SINGLE} for pairs {bad}; e.g. "
                f"{pairs[i]}: {got[i]} != {ref[i]}"
            )
    if not padded_ok:
        raise RuntimeError(f"correctness: {BATCHED}'s rows are not padded with -1")
    return {
        "pairs": CHECK_PAIRS,
        "distinct_sequences": len({tuple(r) for r in ref}),
        "exact": True,
    }


def worker_stats(client: Any, workers: int) -> Optional[Dict[int, Dict[str, Any]]]:
    """Every worker's ``gen_stats``, by pid (several asked at once until each worker has
    answered), or None when some worker did not answer in 20 tries."""
    seen: Dict[int, Dict[str, Any]] = {}
    for _ in range(20):
        futures = [
            client.submit_call("gen_stats", pool=POOL) for _ in range(4 * workers)
        ]
        for f in futures:
            s = f.result(timeout=CALL_TIMEOUT)
            seen[int(s["pid"])] = s
        if len(seen) >= workers:
            return seen
    return None


def stats_delta(
    before: Optional[Dict[int, Dict[str, Any]]],
    after: Optional[Dict[int, Dict[str, Any]]],
) -> Optional[Dict[str, Any]]:
    """What the workers' counters grew by between two looks, summed over the workers: "step":
    {size: [steps, ns in step, gaps, ns between]}, "batched": [calls, rows, steps, ns, tokens,
    row-steps], "single": [calls, steps, ns]."""
    if before is None or after is None or set(before) != set(after):
        return None
    step: Dict[int, List[int]] = {}
    batched = [0] * 6
    single = [0, 0, 0]
    for pid, a in after.items():
        b = before[pid]
        for size, v in a["step"].items():
            w = b["step"].get(size, [0, 0, 0, 0])
            acc = step.setdefault(int(size), [0, 0, 0, 0])
            for i in range(4):
                acc[i] += v[i] - w[i]
        for i in range(6):
            batched[i] += a["batched"][i] - b["batched"][i]
        for i in range(3):
            single[i] += a["single"][i] - b["single"][i]
    return {
        "step": {k: v for k, v in sorted(step.items()) if v[0]},
        "batched": batched,
        "single": single,
    }


def step_summary(step: Dict[int, List[int]]) -> Dict[str, Optional[float]]:
    """Means over every step of a step-op run: sequences per step, us in the step function and
    between steps (per step)."""
    steps = sum(v[0] for v in step.values())
    gaps = sum(v[2] for v in step.values())
    return {
        "steps": steps,
        "mean_step_size": sum(k * v[0] for k, v in step.items()) / steps
        if steps
        else None,
        "step_fn_us": sum(v[1] for v in step.values()) / steps / 1e3 if steps else None,
        "between_steps_us": sum(v[3] for v in step.values()) / gaps / 1e3
        if gaps
        else None,
    }


# ---- the run -----------------------------------------------------------------------------------


def run_stats(
    mode: str,
    r: Dict[str, Any],
    duration: float,
    busy: float,
    ncpu: int,
    batch: Optional[Tuple[float, float]],
    worker_cpu: float,
    counters: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    ttft, lat = sorted(r["ttft"]), sorted(r["lat"])
    # The tokens the workers made in the whole run (warm-up and tail included), from their
    # counters: what their CPU time is shared over.
    made = None
    if counters is not None:
        made = (
            sum(k * v[0] for k, v in counters["step"].items())
            + counters["batched"][4]
            + counters["single"][1]
        )
    out = {
        "tokens_per_s": r["tokens"] / duration,
        "sequences_per_s": len(lat) / duration,
        "sequences_in_window": len(lat),
        "tokens_in_window": r["tokens"],
        "sequences_all": r["all"],
        "ttft_p50_us": percentile(ttft, 50) if ttft else None,
        "ttft_p99_us": percentile(ttft, 99) if ttft else None,
        "latency_p50_us": percentile(lat, 50) if lat else None,
        "latency_p99_us": percentile(lat, 99) if lat else None,
        "latency_mean_us": sum(lat) / len(lat) / 1e3 if lat else None,
        "mean_tokens_per_sequence": r["tokens"] / len(lat) if lat else None,
        "client_cpu_us_per_token": r["cpu"] / r["tokens"] * 1e6
        if r["tokens"]
        else None,
        "worker_cpu_s": worker_cpu,
        "tokens_made": made,
        "worker_cpu_us_per_token": worker_cpu / made * 1e6 if made else None,
        "machine_busy_share": busy / ncpu,
        "batch_calls": batch[1] if batch else None,
        "batch_rows_sum": batch[0] if batch else None,
        "mean_batch_rows": batch[0] / batch[1] if batch and batch[1] else None,
        "check_failures": list(r["bad"]),
    }
    if counters is not None:
        out["worker_counters"] = {
            "step": {str(k): v for k, v in counters["step"].items()},
            "batched": counters["batched"],
            "single": counters["single"],
        }
        if MODE_OP[mode] == STEP and counters["step"]:
            out.update(step_summary(counters["step"]))
        b = counters["batched"]
        if mode == "request" and b[0]:
            out["request_rows_per_call"] = b[1] / b[0]
            out["request_steps_per_call"] = b[2] / b[0]
            out["request_us_per_step"] = b[3] / b[2] / 1e3 if b[2] else None
            # The share of the rows' steps that made no token of their sequence (padding).
            out["request_padded_share"] = 1 - b[4] / b[5] if b[5] else None
        s = counters["single"]
        if mode == "none" and s[0]:
            out["single_us_per_step"] = s[2] / s[1] / 1e3 if s[1] else None
    return out


SUMMARY_KEYS = (
    "tokens_per_s",
    "sequences_per_s",
    "ttft_p50_us",
    "ttft_p99_us",
    "latency_p50_us",
    "latency_p99_us",
    "latency_mean_us",
    "mean_tokens_per_sequence",
    "client_cpu_us_per_token",
    "machine_busy_share",
    "mean_batch_rows",
    "mean_step_size",
    "step_fn_us",
    "between_steps_us",
    "request_rows_per_call",
    "request_steps_per_call",
    "request_us_per_step",
    "request_padded_share",
    "single_us_per_step",
    "worker_cpu_us_per_token",
)


def summarize(
    per_round: Dict[str, Dict[int, List[Dict[str, Any]]]],
) -> Dict[str, Dict[str, Dict[str, Any]]]:
    out: Dict[str, Dict[str, Dict[str, Any]]] = {}
    for mode, by_n in per_round.items():
        for n, runs in by_n.items():
            row: Dict[str, Any] = {"rounds": len(runs)}
            for key in SUMMARY_KEYS:
                vals = [r.get(key) for r in runs]
                if all(v is None for v in vals):
                    continue
                row[key] = median(vals)
                row["per_round_" + key] = vals
            out.setdefault(mode, {})[str(n)] = row
    return out


def ratios_and_targets(
    summary: Dict[str, Dict[str, Dict[str, Any]]],
    per_round: Dict[str, Dict[int, List[Dict[str, Any]]]],
    clients: Sequence[int],
) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    ratios: Dict[str, Any] = {}
    for n in clients:
        st = summary.get("step", {}).get(str(n))
        for other in [m for m in per_round if m != "step"]:
            o = summary.get(other, {}).get(str(n))
            if not st or not o:
                continue
            key = f"tokens_per_s_step_over_{other}_{n}"
            ratios[key] = (
                st["tokens_per_s"] / o["tokens_per_s"]
                if st.get("tokens_per_s") and o.get("tokens_per_s")
                else None
            )
            # Paired by round (measured in the same round), for the drift.
            ro = {r["round"]: r for r in per_round[other].get(n, [])}
            pairs = [
                (x, ro[x["round"]])
                for x in per_round["step"].get(n, [])
                if x["round"] in ro
            ]
            ratios["per_round_" + key] = [
                x["tokens_per_s"] / y["tokens_per_s"] if y["tokens_per_s"] else None
                for x, y in pairs
            ]
        rq = summary.get("request", {}).get(str(n))
        if (
            st
            and rq
            and st.get("ttft_p99_us") is not None
            and rq.get("ttft_p50_us") is not None
        ):
            ratios[f"ttft_p99_step_over_p50_request_{n}"] = (
                st["ttft_p99_us"] / rq["ttft_p50_us"]
            )
    targets = []
    key = f"tokens_per_s_step_over_request_{TARGET_CLIENTS}"
    if key in ratios:
        r = ratios[key]
        targets.append(
            {
                "name": f"tokens/s step / request, {TARGET_CLIENTS} clients",
                "value": r,
                "bound": TARGET_TOKENS_RATIO,
                "upper_bound": False,
                "unit": "",
                "met": None if r is None else r >= TARGET_TOKENS_RATIO,
            }
        )
    st = summary.get("step", {}).get(str(TARGET_CLIENTS))
    rq = summary.get("request", {}).get(str(TARGET_CLIENTS))
    if st and rq:
        v, b = st.get("ttft_p99_us"), rq.get("ttft_p50_us")
        targets.append(
            {
                "name": f"TTFT p99 step < p50 request, {TARGET_CLIENTS} clients",
                "value": None if v is None else v / 1e3,
                "bound": None if b is None else b / 1e3,
                "upper_bound": True,
                "strict": True,
                "unit": " ms",
                "met": None if v is None or b is None else v < b,
            }
        )
    return ratios, targets


def _fmt(v: Optional[float], digits: int = 1) -> str:
    if v is None:
        return "-"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def _ms(us: Optional[float]) -> str:
    return "-" if us is None else f"{us / 1e3:.2f}"


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def bucket_table(step: Dict[int, List[int]]) -> List[Dict[str, Any]]:
    """The step op's steps by size bucket: steps, mean us in the step function, mean us
    between steps."""
    rows = []
    for lo, hi in SIZE_BUCKETS:
        v = [step[k] for k in step if lo <= k <= hi]
        steps = sum(x[0] for x in v)
        if not steps:
            continue
        gaps = sum(x[2] for x in v)
        rows.append(
            {
                "sizes": f"{lo}-{hi}" if lo != hi else str(lo),
                "steps": steps,
                "mean_size": sum(k * step[k][0] for k in step if lo <= k <= hi) / steps,
                "step_fn_us": sum(x[1] for x in v) / steps / 1e3,
                "between_steps_us": sum(x[3] for x in v) / gaps / 1e3 if gaps else None,
            }
        )
    return rows


def print_report(
    summary: Dict[str, Dict[str, Dict[str, Any]]],
    ratios: Dict[str, Any],
    targets: List[Dict[str, Any]],
    clients: Sequence[int],
    modes: Sequence[str],
    rounds: int,
    workers: int,
    buckets: Optional[List[Dict[str, Any]]],
) -> None:
    print(
        f"\nsequences of 4-64 tokens from the GRU, one in flight per client, {workers} workers; "
        f"medians of {rounds} round(s); times in ms (request, none and step-call: TTFT = "
        "latency, the answer comes whole)"
    )
    print(
        f"  {'clients':>7} {'mode':<9} {'tokens/s':>9} {'seq/s':>7} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'lat p50':>8} {'lat p99':>8} {'rows/call':>9} {'cli cpu us/tok':>14} "
        f"{'busy':>5}"
    )
    for n in clients:
        for mode in modes:
            r = summary.get(mode, {}).get(str(n))
            if not r:
                continue
            busy = r.get("machine_busy_share")
            print(
                f"  {n:>7} {mode:<9} {_fmt(r.get('tokens_per_s'), 0):>9}"
                f" {_fmt(r.get('sequences_per_s'), 0):>7}"
                f" {_ms(r.get('ttft_p50_us')):>9} {_ms(r.get('ttft_p99_us')):>9}"
                f" {_ms(r.get('latency_p50_us')):>8} {_ms(r.get('latency_p99_us')):>8}"
                f" {_fmt(r.get('mean_batch_rows'), 2) if mode != 'none' else '':>9}"
                f" {_fmt(r.get('client_cpu_us_per_token')):>14}"
                f" {'-' if busy is None else f'{100 * busy:.0f}%':>5}"
            )
    print("\n  in the workers (medians of the rounds' means):")
    for n in clients:
        for mode in modes:
            r = summary.get(mode, {}).get(str(n))
            if not r:
                continue
            if MODE_OP[mode] == STEP:
                what = (
                    f"{_fmt(r.get('mean_step_size'), 2)} sequences/step, "
                    f"{_fmt(r.get('step_fn_us'))} us in the step function + "
                    f"{_fmt(r.get('between_steps_us'))} us between steps"
                )
            elif mode == "request":
                what = (
                    f"{_fmt(r.get('request_rows_per_call'), 2)} rows/call, "
                    f"{_fmt(r.get('request_steps_per_call'))} steps/call, "
                    f"{_fmt(r.get('request_us_per_step'))} us/step, "
                    f"{_pct(r.get('request_padded_share'))} of the rows' steps padding"
                )
            else:
                what = f"{_fmt(r.get('single_us_per_step'))} us/step"
            print(
                f"  {n:>3} clients {mode:<9}: {what}; the workers' CPU "
                f"{_fmt(r.get('worker_cpu_us_per_token'))} us per token made"
            )
    if buckets:
        print(
            "\n  the streamed step mode's steps by size (all its runs): sizes, steps, mean "
            "size, us in the step function, us between steps"
        )
        for b in buckets:
            print(
                f"  {b['sizes']:>7} {b['steps']:>8} {_fmt(b['mean_size']):>6} "
                f"{_fmt(b['step_fn_us']):>8} {_fmt(b['between_steps_us']):>8}"
            )
    print(
        "\n  tokens/s of step over the other modes (medians; each round's in brackets):"
    )
    for n in clients:
        parts = []
        for mode in modes:
            k = f"tokens_per_s_step_over_{mode}_{n}"
            if k in ratios:
                rounds_ = ", ".join(
                    _fmt(v, 2) for v in ratios.get("per_round_" + k, [])
                )
                parts.append(f"{mode} {_fmt(ratios[k], 2)} ({rounds_})")
        if parts:
            print(f"  {n:>3} clients: " + "; ".join(parts))
        t = ratios.get(f"ttft_p99_step_over_p50_request_{n}")
        if t is not None:
            print(
                f"  {n:>3} clients: TTFT p99 of step / TTFT p50 of request {_fmt(t, 3)}"
            )
    if targets:
        print(f"\n  {'target':<44} {'measured':>10} {'goal':>12}  result")
    for t in targets:
        op = ("<" if t.get("strict") else "<=") if t["upper_bound"] else ">="
        goal = "-" if t["bound"] is None else f"{op} {t['bound']:.2f}{t['unit']}"
        value = "-" if t["value"] is None else f"{t['value']:.2f}{t['unit']}"
        verdict = "n/a" if t["met"] is None else ("met" if t["met"] else "missed")
        print(f"  {t['name']:<44} {value:>10} {goal:>12}  {verdict}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Step-level batching: 32 client processes asking a small GRU for sequences "
        "of 4 to 64 tokens, through a step op (streamed, and called), a request-level batched op "
        "and an unbatched op (see the module docstring and BENCHMARKS.md)."
    )
    p.add_argument(
        "--gpuqd",
        default=os.environ.get("GPUQ_GPUQD")
        or os.path.join(REPO, "build", "daemon", "gpuqd"),
        help="the gpuqd binary (default: $GPUQ_GPUQD, else <repo>/build/daemon/gpuqd)",
    )
    p.add_argument(
        "--clients",
        default="32",
        help="comma-separated client counts (default 32; e.g. 8,32)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="measured seconds per run (default 4; 0.5 with --quick)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds of requests before each run's window (default 0.5; 0.2 with --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds, each running every client count in every mode (default 3; 1 with --quick)",
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes, of step, request, none and step-call (the step op through "
        "client.call: no part streamed) (default step,request,none,step-call)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=WINDOW,
        help=f"the step op's stream window, 1 to 8 (default {WINDOW})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=WORKERS,
        help=f"the pool's workers (default {WORKERS})",
    )
    p.add_argument(
        "--client-spin-us",
        type=float,
        default=None,
        help="the clients' wait spin (gpuq.Client(spin_us=...)); default: gpuq.connect's (50 us)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one round of 0.5 s runs (its figures mean nothing)",
    )
    p.add_argument(
        "--json", metavar="FILE", help="write every figure and the machine's facts here"
    )
    a = p.parse_args(argv)
    try:
        a.clients = sorted({int(c) for c in a.clients.split(",") if c.strip()})
    except ValueError:
        p.error(f"--clients: bad list {a.clients!r}")
    if not a.clients or a.clients[0] < 1 or a.clients[-1] > 60:
        p.error("--clients: from 1 to 60 each (the daemon takes 64 clients)")
    if a.duration is None:
        a.duration = 0.5 if a.quick else 4.0
    if a.warmup is None:
        a.warmup = 0.2 if a.quick else 0.5
    if a.rounds is None:
        a.rounds = 1 if a.quick else 3
    if a.duration <= 0 or a.warmup < 0 or a.rounds < 1:
        p.error("--duration must be > 0, --warmup >= 0, --rounds >= 1")
    a.modes = tuple(dict.fromkeys(m.strip() for m in a.modes.split(",") if m.strip()))
    if not a.modes or any(m not in MODE_OP for m in a.modes):
        p.error(f"--modes: {a.modes!r}: each one of {', '.join(MODE_OP)}")
    if not 1 <= a.window <= 8:
        p.error("--window: from 1 to 8")
    if not 1 <= a.workers <= 16:
        p.error("--workers: from 1 to 16")
    if importlib.util.find_spec("torch") is None:
        p.error(
            "this interpreter cannot import torch (the workers run the GRU in torch)"
        )
    return a


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the daemon
    import gpuq
    import gpuq.testing

    date = datetime.datetime.now(datetime.timezone.utc)
    ncpu = os.cpu_count() or 1
    config = daemon_config(args.workers)
    failures: List[str] = []
    per_round: Dict[str, Dict[int, List[Dict[str, Any]]]] = {m: {} for m in args.modes}
    step_counts: Dict[int, List[int]] = {}
    info: Dict[str, Any] = {}
    load_start = load_average()
    busy0, steal0 = machine_cpu()
    own0 = own_cpu_s()
    t_start = time.perf_counter()
    print(
        f"bench_steps: {ncpu} CPUs ({cpu_model()}), Python {platform.python_version()}, gpuqd "
        f"{args.gpuqd}, {args.workers} workers, clients {args.clients}, {args.rounds} round(s) "
        f"of {args.warmup:g} + {args.duration:g} s runs{', quick' if args.quick else ''}",
        file=sys.stderr,
        flush=True,
    )
    clients: Optional[Clients] = None
    try:
        with gpuq.testing.Daemon(config, gpuqd=args.gpuqd) as d:
            with gpuq.connect(d.runtime_dir, name="bench_steps") as client:
                stats = worker_stats(client, args.workers)
                if stats is None:
                    raise RuntimeError(
                        f"not every one of the {args.workers} workers answered"
                    )
                info["torch_in_workers"] = sorted({s["torch"] for s in stats.values()})
                pool = next(p for p in client.pools if p["name"] == POOL)
                info["runs_on"] = pool.get("runs_on")
                info["pool_batching"] = pool.get("python", {}).get("batching")
                info["correctness"] = check_correctness(client)
                print(
                    f"correctness: ok ({info['correctness']})",
                    file=sys.stderr,
                    flush=True,
                )
                info["batch_rows_metric"] = (
                    scrape_batch_rows(d.runtime_dir, STEP) is not None
                )
                print(
                    f"starting {args.clients[-1]} client processes",
                    file=sys.stderr,
                    flush=True,
                )
                t_clients = time.perf_counter()
                clients = Clients(
                    args.clients[-1], d.runtime_dir, args.client_spin_us, args.window
                )
                info["client_start_s"] = time.perf_counter() - t_clients
                pids = pool_worker_pids(d.status(), POOL)
                for rnd in range(args.rounds):
                    k = rnd % len(args.modes)
                    order = args.modes[k:] + args.modes[:k]
                    for n in args.clients:
                        for mode in order:
                            op = MODE_OP[mode]
                            try:
                                before = (
                                    scrape_batch_rows(d.runtime_dir, op)
                                    if op != SINGLE
                                    else None
                                )
                                s0 = worker_stats(client, args.workers)
                                b0, _ = machine_cpu()
                                c0 = worker_cpu_s(pids)
                                w0 = time.monotonic()
                                r = clients.run(n, mode, args.warmup, args.duration)
                                b1, _ = machine_cpu()
                                c1 = worker_cpu_s(pids)
                                w1 = time.monotonic()
                                s1 = worker_stats(client, args.workers)
                                after = (
                                    scrape_batch_rows(d.runtime_dir, op)
                                    if op != SINGLE
                                    else None
                                )
                                batch = (
                                    (after[0] - before[0], after[1] - before[1])
                                    if before is not None and after is not None
                                    else None
                                )
                                counters = stats_delta(s0, s1)
                                if counters is not None and mode == "step":
                                    for size, v in counters["step"].items():
                                        acc = step_counts.setdefault(size, [0, 0, 0, 0])
                                        for i in range(4):
                                            acc[i] += v[i]
                                st = run_stats(
                                    mode,
                                    r,
                                    args.duration,
                                    (b1 - b0) / (w1 - w0),
                                    ncpu,
                                    batch,
                                    c1 - c0,
                                    counters,
                                )
                                st["round"] = rnd + 1
                                st["position"] = order.index(mode)
                                per_round[mode].setdefault(n, []).append(st)
                                print(
                                    f"round {rnd + 1}/{args.rounds} {n:>2} clients "
                                    f"{mode:<9}: {st['tokens_per_s']:9,.0f} tokens/s, "
                                    f"TTFT p50 {_ms(st['ttft_p50_us'])} p99 "
                                    f"{_ms(st['ttft_p99_us'])} ms, latency p50 "
                                    f"{_ms(st['latency_p50_us'])} p99 "
                                    f"{_ms(st['latency_p99_us'])} ms"
                                    + (
                                        f", {st['mean_batch_rows']:.2f} rows/call"
                                        if st["mean_batch_rows"] is not None
                                        else ""
                                    )
                                    + f", busy {100 * st['machine_busy_share']:.0f}%",
                                    file=sys.stderr,
                                    flush=True,
                                )
                                for b in st["check_failures"]:
                                    failures.append(
                                        f"{mode} {n} clients round {rnd + 1}: {b}"
                                    )
                                if not r["lat"]:
                                    failures.append(
                                        f"{mode} {n} clients round {rnd + 1}: "
                                        "no sequence ended in the window"
                                    )
                            except Exception as e:  # noqa: BLE001
                                failures.append(
                                    f"{mode} {n} clients round {rnd + 1}: {type(e).__name__}: {e}"
                                )
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
    buckets = bucket_table(step_counts) if step_counts else None
    print(f"\nload average at start {load_start}, at end {load_end}")
    print(
        f"run {wall:.1f} s wall (client processes started in "
        f"{_fmt(info.get('client_start_s'))} s); CPU time: this benchmark and its processes "
        f"{own:.1f} s, other processes {other:.1f} s ({100 * other / (wall * ncpu):.0f}% of the "
        f"machine), stolen {steal1 - steal0:.1f} s"
    )
    if "correctness" in info:
        print(
            f"correctness: the step op (streamed, and called) and the request-level op (jobs in "
            f"flight, and one {CHECK_PAIRS}-row job) give exactly the unbatched op's tokens for "
            f"{CHECK_PAIRS} (token, length) pairs"
        )
    if info.get("batch_rows_metric") is False:
        print("rows/call: the daemon's metrics have no gpuq_batch_rows family")
    print_report(
        summary,
        ratios,
        tgts,
        args.clients,
        args.modes,
        args.rounds,
        args.workers,
        buckets,
    )
    for f in failures:
        print(f"FAILURE {f}")

    if args.json:
        doc = {
            "benchmark": "bench_steps",
            "date": date.strftime("%Y-%m-%d"),
            "timestamp_utc": date.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "command": shlex.join([sys.executable] + sys.argv),
            "hostname": socket.gethostname(),
            "machine": {
                "nproc": ncpu,
                "nproc_usable": len(os.sched_getaffinity(0))
                if hasattr(os, "sched_getaffinity")
                else None,
                "cpu_model": cpu_model(),
                "kernel": " ".join(platform.uname()[2:4]),
                "python": sys.version,
                "packages": package_versions(("gpuq", "numpy", "torch")),
            },
            "source_commit": source_commit(),
            "gpuqd": args.gpuqd,
            "daemon_config": config,
            "load_average_start": load_start,
            "load_average_end": load_end,
            "interference": {
                "wall_s": wall,
                "own_cpu_s": own,
                "other_processes_cpu_s": other,
                "other_processes_share": other / (wall * ncpu),
                "steal_s": steal1 - steal0,
            },
            "parameters": {
                "quick": args.quick,
                "clients": args.clients,
                "duration_s": args.duration,
                "warmup_s": args.warmup,
                "rounds": args.rounds,
                "client_spin_us": args.client_spin_us,
                "workers": args.workers,
                "queue_factor": QUEUE_FACTOR,
                "max_batch_size": MAX_BATCH_SIZE,
                "max_queue_delay_us": MAX_QUEUE_DELAY_US,
                "modes": list(args.modes),
                "stream_window": args.window,
                "part_bytes": PART_BYTES,
                "lengths": [MIN_LENGTH, MAX_LENGTH],
                "model": "GRU LM: Embedding(64, 32), GRUCell(32, 128), Linear(128, 64), "
                "float32, greedy",
            },
            "results": summary,
            "per_round": {
                mode: {str(n): runs for n, runs in by_n.items()}
                for mode, by_n in per_round.items()
            },
            "step_sizes": buckets,
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
