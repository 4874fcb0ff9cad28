"""joblib with the loky backend: its worker processes submit gpuq jobs.

loky starts its workers fresh (no fork of this process); each connects to the daemon on its
first gpuq call, through the default client, and keeps that connection for its later tasks.
$GPUQ_RUNTIME_DIR passes to them in the environment. Run:

    python examples/python/joblib_loky.py
"""
import os

import numpy as np
from joblib import Parallel, delayed

import gpuq


def inputs(seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((16, 32), dtype=np.float32),
            rng.standard_normal((32, 8), dtype=np.float32))


def layer(seed):
    x, w = inputs(seed)
    x = gpuq.array(x)                            # into this worker's segment (w is copied in)
    y = gpuq.default_client().gemm(x, w).result()
    return os.getpid(), y                        # y pickles as a copy of its data


if __name__ == "__main__":
    results = Parallel(n_jobs=2, backend="loky")(delayed(layer)(seed) for seed in range(20))
    for seed, (_, y) in enumerate(results):
        x, w = inputs(seed)
        np.testing.assert_allclose(y, x @ w, rtol=1e-4, atol=1e-4)
    print(f"20 gemm results right, from loky worker processes {sorted({p for p, _ in results})}")
    print("ok")
