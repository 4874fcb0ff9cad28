"""The Python op that the scale-out examples run on each node's gpuqd (docs/scale-out.md).

Every node's daemon imports this module in its Python pool (examples/scale-out/gpuqd.json):
the Ray and Dask tasks send it arrays and get arrays back, and never import it themselves.
"""

import numpy as np

import gpuq


@gpuq.op("score")
def score(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A small model: tanh(x @ w) in float32 (x: n x k, w: k x m)."""
    return np.tanh(x @ w)
