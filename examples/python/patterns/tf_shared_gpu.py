"""Many processes share one GPU through one TensorFlow worker, without running out of its memory.

The naive version gives every process its own TensorFlow and its own copy of the model::

    def client(i):
        import tensorflow as tf
        model = tf.keras.models.load_model("classifier.keras")   # per process
        for x in batches(i):
            labels = tf.argmax(model(x, training=False), axis=1).numpy()
    for i in range(16):
        multiprocessing.get_context("spawn").Process(target=client, args=(i,)).start()
    # tensorflow.python.framework.errors_impl.ResourceExhaustedError: OOM when allocating ...

By default TensorFlow maps nearly all of a GPU's memory in the first process that touches it,
so the second process already finds little left; with memory growth turned on by hand in each,
16 processes still pay 16 CUDA contexts, 16 copies of the weights and 16 allocators that keep
what they once took.

Here the model is loaded once per worker of a gpuq Python pool (one worker per GPU in
gpuqd-tf-patterns.json's gpu pool; two on its cpu pool), and the 16 client processes, which
never import TensorFlow, send their batches to its ``tf_classify`` op. On a gpu pool gpuq
configures TensorFlow in each worker before it touches the GPU: memory growth on, and one
logical GPU of the pool's ``memory_limit`` (a fraction of the device's memory, or bytes), so
the worker cannot grow past its share; a job that would fails with ``gpuq.OutOfMemory`` and the
worker serves on. More clients only mean a longer queue: the daemon's ring holds
``queue_factor x workers`` jobs and ``submit`` waits for room.

Each client submits all its jobs at once and then collects them; it checks its results against
the model run with numpy in its own process (pattern_ops.py's perceptron: the same weights). The
script prints, per client, its jobs and which workers ran them, and the totals.

Run, with gpuqd serving the pools of gpuqd-tf-patterns.json (edit its paths first; its venv
needs TensorFlow, this script only numpy and gpuq)::

    gpuqd --config examples/python/patterns/gpuqd-tf-patterns.json
    python examples/python/patterns/tf_shared_gpu.py [--pool NAME] [--clients 16]

The pool is --pool, else $GPUQ_TF_POOL, else "tf-gpu". The page:
docs/python/patterns/tensorflow.md.
"""
import argparse
import collections
import multiprocessing as mp
import os
import threading
import time
import sys
import traceback

import numpy as np

import gpuq
import pattern_ops  # this folder is on sys.path: the same perceptron in numpy, to check against


def batch(client, job, rows):
    return np.random.default_rng([client, job]).standard_normal(
        (rows, pattern_ops.FEATURES), dtype=np.float32)


def check(weights, x, labels, confidence):
    """The pool's answer against the model run here with numpy: the confidences to float32
    precision, and the labels wherever the top two classes are not a near tie."""
    z = pattern_ops.logits_numpy(weights, x)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(confidence, p.max(axis=1), rtol=1e-3, atol=1e-6)
    top2 = np.sort(z, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-3
    assert np.array_equal(labels[clear], p.argmax(axis=1)[clear]), "labels differ"


def run_client(i, pool, jobs, rows, start, results):
    """One client process: connects, waits for the others, submits its jobs, checks them."""
    try:
        with gpuq.connect(name=f"tf_shared_gpu client {i}") as c:
            xs = [batch(i, j, rows) for j in range(jobs)]
            start.wait(timeout=60)
            t0 = time.perf_counter()
            futures = [c.submit_call("tf_classify", x, pool=pool) for x in xs]
            answers = [f.result() for f in futures]
            elapsed = time.perf_counter() - t0
            by_worker = collections.Counter(f.info.worker_id for f in futures)
        weights = pattern_ops.mlp_weights()
        for x, (labels, confidence) in zip(xs, answers):
            check(weights, x, labels, confidence)
        assert "tensorflow" not in sys.modules, "a client never imports TensorFlow"
        results.put((i, os.getpid(), jobs, jobs * rows, dict(by_worker), elapsed, None))
    except BaseException:  # reported to the parent, which fails
        start.abort()  # a parent still waiting for the clients to be ready stops waiting
        results.put((i, os.getpid(), 0, 0, {}, 0.0, traceback.format_exc()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=os.environ.get("GPUQ_TF_POOL") or "tf-gpu",
                        help="the gpuq Python pool (default: $GPUQ_TF_POOL, else tf-gpu)")
    parser.add_argument("--clients", type=int, default=16, help="client processes")
    parser.add_argument("--jobs", type=int, default=8, help="jobs per client")
    parser.add_argument("--rows", type=int, default=512, help="rows per job")
    parser.add_argument("--start-method", default="fork", choices=["fork", "spawn", "forkserver"])
    args = parser.parse_args()

    with gpuq.connect(name="tf_shared_gpu parent") as client:
        if args.pool not in {p["name"] for p in client.pools}:
            raise SystemExit(f"this daemon has no pool {args.pool!r}; start gpuqd with "
                             "examples/python/patterns/gpuqd-tf-patterns.json or pass --pool")
        runs_on = next(p["runs_on"] for p in client.pools if p["name"] == args.pool)
        workers = pattern_ops.pool_workers(client, args.pool)

        def jobs_done():
            pool = next(p for p in client.status()["pools"] if p["name"] == runs_on)
            return {w["id"]: w["jobs_done"] for w in pool["workers"]}

        done_before = jobs_done()
        ctx = mp.get_context(args.start_method)
        start = ctx.Barrier(args.clients + 1)
        results = ctx.Queue()
        procs = [ctx.Process(target=run_client,
                             args=(i, args.pool, args.jobs, args.rows, start, results))
                 for i in range(args.clients)]
        for p in procs:
            p.start()
        try:
            start.wait(timeout=60)  # every client connected and ready
        except threading.BrokenBarrierError:
            pass  # a client failed before it was ready: its error is in results
        got = sorted(results.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        info = client.call("tf_model_info", pool=args.pool)
        served = collections.Counter()
        for _, _, _, _, by_worker, _, _ in got:
            served.update(by_worker)
        # What the daemon counted agrees with what the clients saw. A worker counts a job just
        # after its client can see the result: wait for the counts, briefly.
        deadline = time.monotonic() + 10
        while True:
            done_after = jobs_done()
            counted = all(done_after.get(w, 0) - done_before.get(w, 0) >= n
                          for w, n in served.items())
            if counted or time.monotonic() > deadline:
                break
            time.sleep(0.01)

    failed = [(i, err) for i, _, _, _, _, _, err in got if err is not None]
    assert not failed, f"client {failed[0][0]} failed:\n{failed[0][1]}"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

    print(f"pool {args.pool!r} (runs on {runs_on!r}, {workers} workers; model on "
          f"{info['backend']} {info['tensorflow']} {info['device']}): {args.clients} client "
          f"processes "
          f"({args.start_method}), {args.jobs} jobs of {args.rows} rows each")
    for i, pid, jobs, rows, by_worker, elapsed, _ in got:
        per_worker = ", ".join(f"worker {w}: {n}" for w, n in sorted(by_worker.items()))
        print(f"  client {i:2} (pid {pid}): {jobs} jobs, {rows} rows in {elapsed:5.2f} s "
              f"({per_worker})")
    total_jobs = sum(g[2] for g in got)
    total_rows = sum(g[3] for g in got)
    wall = max(g[5] for g in got)  # from the start to the last client's last result
    assert total_jobs == args.clients * args.jobs
    assert counted, f"the daemon counted {done_after} (from {done_before}), the clients {served}"
    print(f"total: {total_jobs} jobs, {total_rows} rows in {wall:.2f} s "
          f"({total_rows / wall:,.0f} rows/s), then checked against numpy; served by "
          + ", ".join(f"worker {w} ({n} jobs)" for w, n in sorted(served.items())))
    if info["gpus"]:
        given = info["memory_limit_mib"]
        print(f"one worker's GPU memory: {info['peak_allocated'] / 2**20:.1f} MiB at peak "
              f"allocated, of the {given[0] if given else 'unlimited'} MiB TensorFlow was "
              f"given, memory growth {'on' if info['memory_growth'] else 'off'}; the clients "
              "hold none")
    else:
        print(f"one worker's model: {info['model_bytes'] / 2**10:.0f} KiB of weights on the "
              "CPU; the clients load none")
    print("ok")


if __name__ == "__main__":
    main()
