"""The gpuq pool's module (examples/web/gpuqd_config.py puts this folder on the pool's
python.path): the model lives here, in the pool's workers, loaded once per worker; the web
workers only call the op "classify" by name.

The op is batched: a worker takes the queued calls of many web requests (from any web worker)
and runs the model once on all their rows, up to 64 rows, waiting at most 2 ms for more while
the load is steady (docs/python.md, "Dynamic batching"). Each caller gets its own rows back.
"""

from __future__ import annotations

import os

import gpuq
from model import forward, make_weights

MODEL = os.environ.get("WEB_MODEL", "small")  # the pool's "env" (gpuqd_config.py)
layers = None


@gpuq.on_start
def load() -> None:
    global layers
    layers = make_weights(MODEL)


@gpuq.op("classify", max_batch_size=64, max_queue_delay_us=2000)
def classify(x):
    """x: the rows of the calls gathered (n x d_in float32) -> (labels, probs), row by row."""
    return forward(layers, x)


@gpuq.op("model_info")
def model_info():
    return {"model": MODEL, "dims": [int(w.shape[0]) for w, _ in layers] +
            [int(layers[-1][0].shape[1])], "pid": os.getpid()}
