"""A fork-started multiprocessing.Pool whose workers run a TensorFlow model through gpuq.

The naive version loads the Keras model in the parent and forks a Pool whose workers call it::

    import tensorflow as tf
    model = tf.keras.models.load_model("embedder.keras")   # TensorFlow starts in the parent
    def embed(batch):
        return model(batch, training=False).numpy()
    with multiprocessing.get_context("fork").Pool(4) as pool:
        pool.map(embed, batches)

On a GPU the children cannot use it: the parent's CUDA context does not carry over a fork and
CUDA cannot be initialised again in a forked child, and TensorFlow's runtime, started in the
parent, is not made to be forked. The usual ways out are the spawn start method (each child
imports TensorFlow, takes GPU memory of its own, by default nearly all of it, and loads its
own copy of the model) or keeping TensorFlow out of the parent.

Here the children never import TensorFlow. The model lives in the workers of a gpuq Python pool
(on the GPU in a gpu pool, where gpuq turns on TensorFlow's memory growth and caps it at the
pool's ``memory_limit``), built once by ``tf_ops.load_model``; a child hands its arrays to the
``tf_embed`` op through its shared-memory segment (``client.call("tf_embed", x)``) and gets a
numpy array back: the op returns a TensorFlow tensor, which the worker converts. gpuq's client is
fork-safe: each child connects for itself, and the parent's own connection, and a job it has
in flight across the fork, are not disturbed.

Run, with gpuqd serving the pools of gpuqd-tf-patterns.json (edit its paths first; its venv
needs TensorFlow, this script only numpy and gpuq)::

    gpuqd --config examples/python/patterns/gpuqd-tf-patterns.json
    python examples/python/patterns/tf_fork_pool.py [--pool NAME] [--processes 4]

The pool is --pool, else $GPUQ_TF_POOL, else "tf-gpu". The page:
docs/python/patterns/tensorflow.md.
"""
import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

import gpuq
import pattern_ops  # this folder is on sys.path: the same perceptron in numpy, to check against

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
    _client = gpuq.connect(name=f"tf_fork_pool child {os.getpid()}")
    _pool = pool


def embed_batch(i):
    """A Pool task: embed batch ``i`` in the gpuq pool."""
    return os.getpid(), i, _client.call("tf_embed", batch(i), pool=_pool)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", default=os.environ.get("GPUQ_TF_POOL") or "tf-gpu",
                        help="the gpuq Python pool (default: $GPUQ_TF_POOL, else tf-gpu)")
    parser.add_argument("--processes", type=int, default=4, help="Pool processes")
    parser.add_argument("--batches", type=int, default=48, help="batches to embed")
    args = parser.parse_args()

    weights = pattern_ops.mlp_weights()  # the model, as numpy, to check the pool's answers

    with gpuq.connect(name="tf_fork_pool parent") as client:
        if args.pool not in {p["name"] for p in client.pools}:
            raise SystemExit(f"this daemon has no pool {args.pool!r}; start gpuqd with "
                             "examples/python/patterns/gpuqd-tf-patterns.json or pass --pool")
        info = client.call("tf_model_info", pool=args.pool)
        # A job of the parent's, submitted before the fork and collected after it.
        in_flight = client.submit_call("tf_embed", batch(PARENT_BATCH), pool=args.pool)

        t0 = time.perf_counter()
        with mp.get_context("fork").Pool(args.processes, initializer=connect_child,
                                         initargs=(args.pool,)) as pool:
            results = pool.map(embed_batch, range(args.batches))
        elapsed = time.perf_counter() - t0

        parent_result = in_flight.result()
        np.testing.assert_allclose(parent_result,
                                   pattern_ops.embed_numpy(weights, batch(PARENT_BATCH)),
                                   rtol=1e-3, atol=1e-5)
        client.call("tf_model_info", pool=args.pool)  # the parent's connection still serves

    pids = {}
    for pid, i, e in results:
        assert isinstance(e, np.ndarray), type(e)  # a TensorFlow tensor in the op, numpy here
        assert e.shape == (ROWS, pattern_ops.EMBED) and e.dtype == np.float32
        np.testing.assert_allclose(e, pattern_ops.embed_numpy(weights, batch(i)),
                                   rtol=1e-3, atol=1e-5, err_msg=f"batch {i}")
        pids[pid] = pids.get(pid, 0) + 1
    assert os.getpid() not in pids, "the batches should run in the forked children"
    assert sorted(i for _, i, _ in results) == list(range(args.batches))
    assert "tensorflow" not in sys.modules, "the client side never imports TensorFlow"

    print(f"pool {args.pool!r}: model on {info['backend']} {info['tensorflow']} "
          f"{info['device']}")
    print(f"{args.batches} batches of {ROWS} rows embedded by {len(pids)} forked children in "
          f"{elapsed:.2f} s, each checked against numpy:")
    for pid, count in sorted(pids.items()):
        print(f"  child {pid}: {count} batches")
    print("the parent's job submitted before the fork: done, right")
    print("ok")


if __name__ == "__main__":
    main()
