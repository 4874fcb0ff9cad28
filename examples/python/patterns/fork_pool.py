"""A fork-started multiprocessing.Pool whose workers run their GPU work through gpuq.

The naive version loads the model onto the GPU in the parent and forks a Pool whose workers
use it::

    model = Net().cuda()                         # the parent creates a CUDA context
    def embed(batch):
        return model(torch.from_numpy(batch).cuda()).cpu().numpy()
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(embed, batches)
    # RuntimeError: Cannot re-initialize CUDA in forked subprocess. To use CUDA with
    # multiprocessing, you must use the 'spawn' start method

A forked child inherits the parent's memory but not a usable CUDA context, and CUDA cannot be
initialised again in it. The usual ways out are the spawn start method (every child imports
everything again, creates a CUDA context of its own and loads its own copy of the model) or
keeping CUDA out of the parent (fragile: one import that touches CUDA breaks it).

Here the children do no CUDA at all. The model lives in the workers of a gpuq Python pool (on
the GPU in a gpu pool), loaded once by ``pattern_ops.load_models``; a child hands its arrays to
the ``embed`` op through its shared-memory segment (``client.call("embed", x)``) and gets the
result back the same way. gpuq's client is fork-safe: each child connects for itself (here with
``gpuq.connect()`` in the Pool's initializer; a client made before the fork would also connect
anew on its first call in the child), and the parent's own connection, and a job it has in
flight across the fork, are not disturbed.

Run, with gpuqd serving the pools of gpuqd-patterns.json (edit its paths first)::

    gpuqd --config examples/python/patterns/gpuqd-patterns.json
    python examples/python/patterns/fork_pool.py [--pool NAME] [--processes 4]

The pool is --pool, else $GPUQ_PATTERNS_POOL, else "patterns-gpu". The page:
docs/python/patterns/fork_pool.md.
"""
import argparse
import multiprocessing as mp
import os
import time

import numpy as np

import gpuq
import pattern_ops  # this folder is on sys.path: it is the script's own

ROWS = 256  # rows of one batch
PARENT_BATCH = 10_000  # the index of the batch the parent embeds itself

_client = None  # each Pool process's own connection (made by connect_child)
_pool = None


def batch(i):
    """Batch ``i``: ROWS x 64 float32, the same in every process."""
    return np.random.default_rng(i).standard_normal((ROWS, pattern_ops.FEATURES),
                                                    dtype=np.float32)


def connect_child(pool):
    """The Pool's initializer: runs once in each forked child."""
    global _client, _pool
    _client = gpuq.connect(name=f"fork_pool child {os.getpid()}")
    _pool = pool


def embed_batch(i):
    """A Pool task: embed batch ``i`` in the gpuq pool."""
    return os.getpid(), i, _client.call("embed", batch(i), pool=_pool)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=pattern_ops.default_pool(),
                        help="the gpuq Python pool (default: $GPUQ_PATTERNS_POOL, else "
                             "patterns-gpu)")
    parser.add_argument("--processes", type=int, default=4, help="Pool processes")
    parser.add_argument("--batches", type=int, default=48, help="batches to embed")
    args = parser.parse_args()

    weights = pattern_ops.mlp_weights()  # the model, as numpy, to check the pool's answers

    with gpuq.connect(name="fork_pool parent") as client:
        info = client.call("model_info", pool=args.pool)
        # A job of the parent's, submitted before the fork and collected after it.
        in_flight = client.submit_call("embed", batch(PARENT_BATCH), pool=args.pool)

        t0 = time.perf_counter()
        with mp.get_context("fork").Pool(args.processes, initializer=connect_child,
                                         initargs=(args.pool,)) as pool:
            results = pool.map(embed_batch, range(args.batches))
        elapsed = time.perf_counter() - t0

        parent_result = in_flight.result()
        np.testing.assert_allclose(parent_result,
                                   pattern_ops.embed_numpy(weights, batch(PARENT_BATCH)),
                                   rtol=1e-3, atol=1e-5)
        client.call("model_info", pool=args.pool)  # the parent's connection still serves

    pids = {}
    for pid, i, e in results:
        assert e.shape == (ROWS, pattern_ops.EMBED) and e.dtype == np.float32
        np.testing.assert_allclose(e, pattern_ops.embed_numpy(weights, batch(i)),
                                   rtol=1e-3, atol=1e-5, err_msg=f"batch {i}")
        pids[pid] = pids.get(pid, 0) + 1
    assert os.getpid() not in pids, "the batches should run in the forked children"
    assert sorted(i for _, i, _ in results) == list(range(args.batches))

    print(f"pool {args.pool!r}: model on {info['backend']} {info['device']}")
    print(f"{args.batches} batches of {ROWS} rows embedded by {len(pids)} forked children in "
          f"{elapsed:.2f} s, each checked against numpy:")
    for pid, count in sorted(pids.items()):
        print(f"  child {pid}: {count} batches")
    print("the parent's job submitted before the fork: done, right")
    print("ok")


if __name__ == "__main__":
    main()
