"""Parallel text generation, gretel-synthetics style: gpuq.Executor in place of loky.

gretel-synthetics (``generate_parallel.py``) generates synthetic text in loky worker processes.
Each worker's initializer hides the GPUs (``CUDA_VISIBLE_DEVICES=-1``) and loads the model, and
the parent keeps at most ``10 * num_workers`` chunks pending, waiting for the first to finish
before handing out more. The workers run on CPUs because N processes, each with a CUDA context
and a copy of the model, do not fit on one GPU; and every run pays for starting the workers and
loading the model in each of them.

This script runs that loop twice on the same prompts and seeds: first with loky, as gretel
does, then with ``gpuq.Executor``, whose tasks run in the warm workers of a gpuq Python pool.
Then one chunk again as a stream (``Client.stream`` of a generator op): its letters arrive 20 at
a time while the rest are generated, as a chat UI shows tokens. Last, 16 chunks of mixed
lengths streamed at once from a step op (``@gpuq.step_op``: every step makes the next letters of
every live chunk in one call, and a short chunk leaves as soon as it is done) and from the
generator op (a chunk at a time per worker).
gpuqd started those workers and loaded the model in each once (``pattern_ops.load_models``, an
``@gpuq.on_start``); on a gpu pool the model is on the GPU, in one process per GPU. The two
runs must generate the same lines. The generator is a small character-level Markov chain
(``pattern_ops``), so what the timings show is mostly the cost of starting and feeding
workers, not of a model.

Run, with gpuqd serving the pools of gpuqd-patterns.json (edit its paths first)::

    gpuqd --config examples/python/patterns/gpuqd-patterns.json
    python examples/python/patterns/textgen_executor.py [--pool NAME] [--lines 400]

The pool is --pool, else $GPUQ_PATTERNS_POOL, else "patterns-gpu". The page:
docs/python/patterns/textgen_executor.md.
"""
import argparse
import concurrent.futures as futures
import os
import time

import loky
import numpy as np

import gpuq
import pattern_ops  # this folder is on sys.path: it is the script's own

PROMPTS = ["the daemon ", "a worker ", "the model ", "when the queue ", "each job "]


def loky_init_worker():
    """What gretel's ``_loky_init_worker`` does: CPU only, the model loaded once per worker."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"  # before anything in this process touches CUDA
    pattern_ops.load_models()


def generate_all(executor, num_workers, num_lines, chunk_size, length):
    """gretel's scheduling loop, for any concurrent.futures executor: chunks of ``chunk_size``
    lines, at most ``10 * num_workers`` of them pending. Returns {seed: lines}; the seed of a
    chunk is its index, its prompt one of PROMPTS."""
    max_pending = 10 * num_workers
    sizes = [min(chunk_size, num_lines - start) for start in range(0, num_lines, chunk_size)]
    todo = list(enumerate(sizes))[::-1]  # popped from the end: chunk 0 first
    pending = {}
    results = {}
    while todo or pending:
        while todo and len(pending) < max_pending:
            seed, n = todo.pop()
            f = executor.submit(pattern_ops.generate_lines, PROMPTS[seed % len(PROMPTS)], seed,
                                n, length)
            pending[f] = seed
        done, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
        for f in done:
            results[pending.pop(f)] = f.result()
    return results


def read_streams(client, op, lengths, pool):
    """Streams chunk ``seed`` of length ``lengths[seed]`` for every seed, all submitted before
    any is read, and reads them in order. (seconds to the last part, to the first, {seed:
    lines})."""
    t0 = time.perf_counter()
    streams = [client.stream(op, PROMPTS[seed % len(PROMPTS)], seed, n_lines=5, length=length,
                             step=20, pool=pool) for seed, length in enumerate(lengths)]
    first = None
    lines = {}
    for seed, s in enumerate(streams):
        with s:
            got = [PROMPTS[seed % len(PROMPTS)]] * 5
            for letters in s:
                if first is None:
                    first = time.perf_counter() - t0
                got = [line + more for line, more in zip(got, letters)]
        lines[seed] = got
    return time.perf_counter() - t0, first, lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=pattern_ops.default_pool(),
                        help="the gpuq Python pool (default: $GPUQ_PATTERNS_POOL, else "
                             "patterns-gpu)")
    parser.add_argument("--lines", type=int, default=400, help="lines to generate")
    parser.add_argument("--chunk-size", type=int, default=5, help="lines per task (gretel: 5)")
    parser.add_argument("--length", type=int, default=160, help="letters per line")
    args = parser.parse_args()

    with gpuq.connect(name="textgen_executor") as client:
        workers = pattern_ops.pool_workers(client, args.pool)
        runs_on = next(p["runs_on"] for p in client.pools if p["name"] == args.pool)

        # Before: loky, CPU-only workers started for this run, the model loaded in each.
        t0 = time.perf_counter()
        pool = loky.get_reusable_executor(max_workers=workers, initializer=loky_init_worker)
        before = generate_all(pool, workers, args.lines, args.chunk_size, args.length)
        t_loky = time.perf_counter() - t0
        pool.shutdown(wait=True, kill_workers=True)

        # After: the same loop on gpuq.Executor, in the pool's warm workers.
        t0 = time.perf_counter()
        with gpuq.Executor(pool=args.pool, client=client) as ex:
            after = generate_all(ex, workers, args.lines, args.chunk_size, args.length)
        t_gpuq = time.perf_counter() - t0

        # The named-op form of the same generator, for pools that do not allow callables.
        named = client.call("generate_text", PROMPTS[1], 1, n_lines=len(before[1]),
                            length=args.length, pool=args.pool)
        # And as a stream (docs/python.md, "Streaming"): each line's next 20 letters as soon as
        # the worker has made them, instead of the whole chunk at its end.
        t0 = time.perf_counter()
        streamed = [PROMPTS[1]] * len(before[1])
        with client.stream("generate_text_stream", PROMPTS[1], 1, n_lines=len(before[1]),
                           length=args.length, step=20, pool=args.pool) as parts:
            for i, letters in enumerate(parts):
                if i == 0:
                    t_first = time.perf_counter() - t0
                streamed = [line + more for line, more in zip(streamed, letters)]
        t_stream = time.perf_counter() - t0
        # Many chunks at once, of mixed lengths, as streams of a step op (docs/python.md,
        # "Step-level batching"): each step makes the next 20 letters of every live chunk in
        # one call, a short chunk leaves as soon as it is complete, against the same chunks as
        # streams of the generator op (one chunk at a time per worker).
        lengths = [args.length // 4 * (1 + seed % 4) for seed in range(16)]
        t_steps, first_steps, by_steps = read_streams(client, "generate_text_steps", lengths,
                                                      args.pool)
        t_gen, first_gen, by_gen = read_streams(client, "generate_text_stream", lengths,
                                                args.pool)
        info = client.call("model_info", pool=args.pool)

    assert sorted(before) == sorted(after) == list(range(len(before))), "chunks missing"
    n = sum(len(lines) for lines in after.values())
    assert n == args.lines, f"{n} lines generated, {args.lines} asked for"
    differ = [seed for seed in before if before[seed] != after[seed]]
    assert not differ, f"loky and gpuq differ for seeds {differ[:10]}"
    assert named["lines"] == before[1], "the generate_text op differs from generate_lines"
    assert streamed == before[1], "the streamed lines differ from generate_lines"
    model = pattern_ops.train_text_model()
    for seed, length in enumerate(lengths):
        want = [PROMPTS[seed % len(PROMPTS)] + pattern_ops.text_of(line) for line in np.stack(
            list(pattern_ops.letters_numpy(model, PROMPTS[seed % len(PROMPTS)], seed, 5,
                                           length))).T]
        assert by_steps[seed] == want, f"generate_text_steps differs for seed {seed}"
        assert by_gen[seed] == want, f"generate_text_stream differs for seed {seed}"

    print(f"pool {args.pool!r} (runs on {runs_on!r}, {workers} workers, model on "
          f"{info['backend']} {info['device']}); {len(before)} chunks of {args.chunk_size} "
          f"lines, at most {10 * workers} pending")
    print(f"  loky, {workers} CPU-only workers started for the run: {t_loky:6.2f} s "
          f"({n / t_loky:7.0f} lines/s)")
    print(f"  gpuq.Executor, the pool's warm workers:     {t_gpuq:6.2f} s "
          f"({n / t_gpuq:7.0f} lines/s)")
    print(f"  the same {n} lines from both; e.g. seed 0: {after[0][0][:72]!r}...")
    print(f"  streamed ({len(before[1])} lines, 20 letters a part): first part after "
          f"{t_first * 1e3:.1f} ms, all {args.length} letters after {t_stream * 1e3:.1f} ms")
    print(f"  16 chunks of {min(lengths)} to {max(lengths)} letters at once, streamed: step op "
          f"(all live chunks in one call a step) first part {first_steps * 1e3:.1f} ms, all "
          f"{t_steps * 1e3:.1f} ms; generator op (a chunk at a time per worker) first part "
          f"{first_gen * 1e3:.1f} ms, all {t_gen * 1e3:.1f} ms")
    print("ok")


if __name__ == "__main__":
    main()
