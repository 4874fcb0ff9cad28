"""Many processes send small requests to one GPU model, and the worker batches them.

shared_gpu.py's clients send batches of 512 rows. An inference service's callers more often
send one row, or a few, each: a request handler per caller, each with its own input. Served
one job at a time, each request is one call of the model::

    @gpuq.op("classify")
    def classify(x):                       # x: 1 to 4 rows
        return model(torch.as_tensor(x, device="cuda")).softmax(1).max(1)

    # each of 16 client processes
    for x in requests:                     # 1 to 4 rows each
        labels, confidence = client.call("classify", x)

On a GPU a call of a small model costs about the same for 1 row as for 64 (kernel launches,
copies, Python), so the GPU spends its time on overhead and throughput is a few rows per
call. The usual fix is batching by hand: a queue and a thread in a server process that collect
requests, stack them, run the model, and hand each caller its rows.

Here the op is declared batched, and nothing else changes::

    @gpuq.op("classify_batched", max_batch_size=64, max_queue_delay_us=500)
    def classify_batched(x):               # x: the rows of several callers' jobs, stacked
        return classify(x)                 # one row per input row; each caller gets its own

The worker that takes a job of it gathers further queued jobs of the op, from any client,
until it has 64 rows or 500 us have passed, and calls the function once on their rows
concatenated; each caller gets its own rows back. The clients call it as before.

Each client process sends ``--requests`` requests of 1 to ``--max-rows`` rows, keeping
``--inflight`` of them in flight (``submit_call``; ``--inflight 1`` uses ``call``), first to
``classify`` and then to ``classify_batched``, and checks every answer against the model run
with numpy in its own process. The script prints both runs' totals and, when the daemon's
metrics have ``gpuq_batch_rows``, the mean number of rows per call of the batched op. It does
not require batching to have happened: the answers are the same either way.

Run, with gpuqd serving the pools of gpuqd-patterns.json (edit its paths first)::

    gpuqd --config examples/python/patterns/gpuqd-patterns.json
    python examples/python/patterns/shared_gpu_batched.py [--pool NAME] [--clients 16]

The pool is --pool, else $GPUQ_PATTERNS_POOL, else "patterns-gpu". The page:
docs/python/patterns/shared_gpu_batched.md.
"""
import argparse
import collections
import multiprocessing as mp
import os
import re
import threading
import time
import traceback

import numpy as np

import gpuq
import pattern_ops  # this folder is on sys.path: it is the script's own

OPS = ("classify", "classify_batched")


def requests(client, n, max_rows):
    """Client ``client``'s ``n`` requests: 1 to ``max_rows`` rows of 64 float32 each."""
    rng = np.random.default_rng([client, n, max_rows])
    return [rng.standard_normal((int(rng.integers(1, max_rows + 1)), pattern_ops.FEATURES),
                                dtype=np.float32) for _ in range(n)]


def check(weights, x, labels, confidence):
    """The pool's answer for ``x`` against the model run here with numpy: one label and one
    confidence per row of ``x`` (its own rows, not another caller's), the confidences to
    float32 precision, the labels wherever the top two classes are not a near tie."""
    assert labels.shape == confidence.shape == (len(x),), (labels.shape, confidence.shape)
    z = pattern_ops.logits_numpy(weights, x)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(confidence, p.max(axis=1), rtol=1e-3, atol=1e-6)
    top2 = np.sort(z, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert np.array_equal(labels[clear], p.argmax(axis=1)[clear]), "labels differ"


def send_all(c, op, pool, xs, inflight):
    """Sends the requests ``xs`` to ``op``, at most ``inflight`` unanswered at a time; returns
    the answers in order and how many each worker ran."""
    answers = [None] * len(xs)
    by_worker = collections.Counter()
    if inflight == 1:  # one request at a time, as a caller that waits for each does
        for j, x in enumerate(xs):
            answers[j] = c.call(op, x, pool=pool)
        return answers, by_worker
    pending = collections.deque()
    for j, x in enumerate(xs):
        if len(pending) == inflight:
            k, f = pending.popleft()
            answers[k] = f.result()
            by_worker[f.info.worker_id] += 1
        pending.append((j, c.submit_call(op, x, pool=pool)))
    for k, f in pending:
        answers[k] = f.result()
        by_worker[f.info.worker_id] += 1
    return answers, by_worker


def run_client(i, pool, ops, n, max_rows, inflight, start, results):
    """One client process: connects, then for each op waits for the others, sends its
    requests, and checks the answers."""
    try:
        weights = pattern_ops.mlp_weights()
        xs = requests(i, n, max_rows)
        with gpuq.connect(name=f"shared_gpu_batched client {i}") as c:
            for op in ops:
                start.wait(timeout=60)
                t0 = time.perf_counter()
                answers, by_worker = send_all(c, op, pool, xs, inflight)
                elapsed = time.perf_counter() - t0
                for x, (labels, confidence) in zip(xs, answers):
                    check(weights, x, labels, confidence)
                rows = sum(len(x) for x in xs)
                results.put((op, i, os.getpid(), n, rows, dict(by_worker), elapsed, None))
    except BaseException:  # reported to the parent, which fails
        start.abort()  # the parent and the other clients stop waiting
        results.put(("", i, os.getpid(), 0, 0, {}, 0.0, traceback.format_exc()))


def batch_totals(op):
    """(calls, rows) of the batched op ``op`` so far, summed over its pools and workers, from
    the daemon's ``gpuq_batch_rows`` histogram; None when the daemon has no such metric."""
    text = gpuq.metrics()
    if "gpuq_batch_rows" not in text:
        return None
    totals = {"count": 0.0, "sum": 0.0}
    for m in re.finditer(r"^gpuq_batch_rows_(count|sum)\{([^}]*)\} (\S+)$", text, re.M):
        if f'op="{op}"' in m.group(2):
            totals[m.group(1)] += float(m.group(3))
    return int(totals["count"]), int(totals["sum"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=pattern_ops.default_pool(),
                        help="the gpuq Python pool (default: $GPUQ_PATTERNS_POOL, else "
                             "patterns-gpu)")
    parser.add_argument("--clients", type=int, default=16, help="client processes")
    parser.add_argument("--requests", type=int, default=200, help="requests per client")
    parser.add_argument("--max-rows", type=int, default=4, help="rows of a request: 1 to this")
    parser.add_argument("--inflight", type=int, default=8,
                        help="requests a client keeps in flight (1: call() one at a time)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help="the ops to send the requests to, in turn (default: %(default)s)")
    parser.add_argument("--start-method", default="fork", choices=["fork", "spawn", "forkserver"])
    args = parser.parse_args()
    ops = args.ops.split(",")
    assert set(ops) <= set(OPS) and ops, f"--ops: choose from {OPS}"
    assert 1 <= args.max_rows <= 64 and args.inflight >= 1 and args.requests >= 1

    with gpuq.connect(name="shared_gpu_batched parent") as client:
        runs_on = next(p["runs_on"] for p in client.pools if p["name"] == args.pool)
        workers = pattern_ops.pool_workers(client, args.pool)
        info = client.call("model_info", pool=args.pool)
        before = batch_totals("classify_batched")
        ctx = mp.get_context(args.start_method)
        start = ctx.Barrier(args.clients + 1)  # each op's run starts with every client ready
        results = ctx.Queue()
        procs = [ctx.Process(target=run_client,
                             args=(i, args.pool, ops, args.requests, args.max_rows,
                                   args.inflight, start, results))
                 for i in range(args.clients)]
        for p in procs:
            p.daemon = True  # not left behind if a failure ends the script early
            p.start()
        got = []
        for _ in ops:
            try:
                start.wait(timeout=60)
            except threading.BrokenBarrierError:
                pass  # a client failed: its error is in results
            got += [results.get(timeout=300) for _ in procs]
            if any(g[-1] is not None for g in got):
                break
        for p in procs:
            p.join(timeout=30)
        after = batch_totals("classify_batched")

    failed = [(i, err) for _, i, _, _, _, _, _, err in got if err is not None]
    assert not failed, f"client {failed[0][0]} failed:\n{failed[0][1]}"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    print(f"pool {args.pool!r} (runs on {runs_on!r}, {workers} workers; model on "
          f"{info['backend']} {info['device']}): {args.clients} client processes "
          f"({args.start_method}), {args.requests} requests of 1 to {args.max_rows} rows each, "
          f"{args.inflight} in flight per client")
    for op in ops:
        mine = [g for g in got if g[0] == op]
        jobs, rows = sum(g[3] for g in mine), sum(g[4] for g in mine)
        wall = max(g[6] for g in mine)  # from the start to the last client's last answer
        served = collections.Counter()
        for g in mine:
            served.update(g[5])
        assert jobs == args.clients * args.requests, (op, jobs)
        print(f"{op + ':':18} {jobs} jobs, {rows} rows in {wall:5.2f} s ({jobs / wall:,.0f} "
              f"jobs/s, {rows / wall:,.0f} rows/s), each checked against numpy"
              + ("; served by " + ", ".join(f"worker {w} ({n} jobs)"
                                            for w, n in sorted(served.items()))
                 if served else ""))
    if "classify_batched" in ops:
        if before is None or after is None:
            print("batches: this daemon has no gpuq_batch_rows metric")
        else:
            calls, rows = after[0] - before[0], after[1] - before[1]
            mean = f"{rows / calls:.1f} rows per call" if calls else "no calls counted"
            print(f"batches (gpuq_batch_rows): classify_batched ran {calls} calls for "
                  f"{rows} rows, {mean}")
    print("ok")


if __name__ == "__main__":
    main()
