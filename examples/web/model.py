"""The model the web examples serve: a numpy MLP (rows of features in, class probabilities
out). Only the gpuq pool's workers import this module (model_ops.py); the web workers never do:
they send rows and get answers.

Two sizes: "small" (64 -> 256 -> 10, 68 KB of weights: CI) and "large" (2048 -> 8192 -> 8192
-> 1000, 368 MB of float32 weights: bench/python/bench_web_memory.py, a model of a realistic
size). The weights are made from a seed, as a stand-in for loading a checkpoint (np.load,
torch.load): either way they end up in the process's private memory.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

SIZES = {"small": (64, 256, 10), "large": (2048, 8192, 8192, 1000)}


def make_weights(size: str = "small", seed: int = 0) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The layers' (W, b), float32, W scaled so that activations stay O(1)."""
    dims = SIZES[size]
    rng = np.random.default_rng(seed)
    layers = []
    for d_in, d_out in zip(dims, dims[1:]):
        w = rng.standard_normal((d_in, d_out), dtype=np.float32)
        w *= np.float32(1.0 / np.sqrt(d_in))
        b = rng.standard_normal(d_out, dtype=np.float32) * np.float32(0.1)
        layers.append((w, b))
    return layers


def weight_bytes(layers: List[Tuple[np.ndarray, np.ndarray]]) -> int:
    return sum(w.nbytes + b.nbytes for w, b in layers)


def forward(layers: List[Tuple[np.ndarray, np.ndarray]],
            x: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """x: n x d_in float32 -> (labels: n int64, probs: n x classes float32). Row i of the
    answer depends on row i of x only (what a batched op needs: docs/python.md, "Dynamic
    batching")."""
    h = np.asarray(x, np.float32)
    for i, (w, b) in enumerate(layers):
        h = h @ w + b
        if i < len(layers) - 1:
            np.maximum(h, 0, out=h)
    h -= h.max(axis=1, keepdims=True)
    np.exp(h, out=h)
    h /= h.sum(axis=1, keepdims=True)
    return h.argmax(axis=1).astype(np.int64), h
