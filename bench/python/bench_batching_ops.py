"""The Python ops of bench_batching.py's Python pool: gpuqd's Python workers import this module
(the pool's ``python.path`` is this directory).

One small MLP, 256-512-10 (Linear 256->512, ReLU, Linear 512->10), float32, served by two ops:

  mlp          ``@gpuq.op("mlp", max_batch_size=64, max_queue_delay_us=500)``: batched (the
               worker calls it with the rows of several queued jobs concatenated along axis 0);
  mlp_single   ``@gpuq.op("mlp_single")``: the same function, unbatched (one job, one call).

Both take a float32 array of shape (rows, 256) (a read-only view of the caller's memory) and
return a float32 numpy array of shape (rows, 10).

The model is made once per worker, in the ``on_start`` hook, from a fixed seed, so every worker
(and both ops) compute the same function. ``BENCH_BATCHING_MODEL`` in the worker's environment
(the pool's ``python.env``, set by bench_batching.py) picks it: ``torch`` (``torch.nn``,
``torch.set_num_threads(1)``, run under ``torch.inference_mode()``) or ``numpy`` (the same
shapes as numpy matmuls, for a venv without torch). Torch is imported in ``on_start``, not at
the top, so that gpuqd's op listing (``--list-ops``) does not pay for it.
"""

import os
import warnings

import numpy as np

import gpuq

IN, HIDDEN, OUT = 256, 512, 10
SEED = 1234

_forward = None  # (rows, 256) float32 array -> (rows, 10) float32 numpy array
_kind = None


@gpuq.on_start
def _load() -> None:
    global _forward, _kind
    _kind = os.environ.get("BENCH_BATCHING_MODEL", "torch")
    if _kind == "torch":
        import torch
        torch.set_num_threads(1)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only before any parallel work; harmless to skip
            pass
        # The op gets a read-only view; torch only reads it, under inference_mode.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        torch.manual_seed(SEED)
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, OUT)).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        from_numpy, inference_mode = torch.from_numpy, torch.inference_mode
        # On a gpu pool (bench_batching.py --gpu, BENCH_BATCHING_DEVICE=cuda): the model on the
        # worker's one GPU (device 0 of what it sees), inputs copied from the caller's segment,
        # outputs back to host memory. (gpuq.context().torch_device is set only once torch is
        # loaded, which this hook does itself.)
        device = torch.device("cuda", 0) \
            if os.environ.get("BENCH_BATCHING_DEVICE") == "cuda" else None
        if device is not None:
            model = model.to(device)

            def forward(x: np.ndarray) -> np.ndarray:
                with inference_mode():
                    return model(from_numpy(x).to(device, non_blocking=True)).cpu().numpy()
        else:
            def forward(x: np.ndarray) -> np.ndarray:
                with inference_mode():
                    return model(from_numpy(x)).numpy()

        forward(np.zeros((1, IN), np.float32))  # first call: torch's lazy setup
    elif _kind == "numpy":
        rng = np.random.default_rng(SEED)
        # torch.nn.Linear's default init range: U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
        b1_ = 1.0 / np.sqrt(IN)
        b2_ = 1.0 / np.sqrt(HIDDEN)
        w1 = rng.uniform(-b1_, b1_, (IN, HIDDEN)).astype(np.float32)
        b1 = rng.uniform(-b1_, b1_, HIDDEN).astype(np.float32)
        w2 = rng.uniform(-b2_, b2_, (HIDDEN, OUT)).astype(np.float32)
        b2 = rng.uniform(-b2_, b2_, OUT).astype(np.float32)

        def forward(x: np.ndarray) -> np.ndarray:
            h = x @ w1
            h += b1
            np.maximum(h, 0, out=h)
            y = h @ w2
            y += b2
            return y

    else:
        raise ValueError(f"BENCH_BATCHING_MODEL: {_kind!r} (want torch or numpy)")
    _forward = forward


@gpuq.op("mlp", max_batch_size=64, max_queue_delay_us=500)
def mlp(x):
    """The MLP 256-512-10, batched: (rows, 256) float32 -> (rows, 10) float32."""
    return _forward(x)


@gpuq.op("mlp_single")
def mlp_single(x):
    """The MLP 256-512-10, unbatched: (rows, 256) float32 -> (rows, 10) float32."""
    return _forward(x)


@gpuq.op("mlp_info")
def mlp_info():
    """Which model this worker runs, where, and its pid: {"model": "torch"|"numpy", "device":
    "cpu"|"cuda:0", "pid": N}."""
    return {"model": _kind, "device": os.environ.get("BENCH_BATCHING_DEVICE", "cpu"),
            "pid": os.getpid()}
