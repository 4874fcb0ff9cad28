"""The Python ops of bench_gpu_python.py's pool: gpuqd's Python workers import this module (the
pool's ``python.path`` is this directory); the benchmark's "direct" client processes import it
too, for the same model code, and so does the benchmark itself, for the in-process no-op.

The model: an MLP 512-1024-1024-10 (Linear 512->1024, ReLU, Linear 1024->1024, ReLU, Linear
1024->10), float32, weights from a fixed seed, so that every worker and every direct process
computes the same function. Ops:

  mlp          ``@gpuq.op("mlp")`` (not batched): a float32 array (rows, 512), a read-only view
               of the caller's memory -> a float32 numpy array (rows, 10);
  torch_noop   ``@gpuq.op("torch_noop")``: wraps its array as a CPU tensor (``torch.from_numpy``,
               no copy, no GPU work) and returns None (``noop`` is a built-in op's name);
  mlp_info     where the worker's model is: {"model", "device", "pid", ...} (20 ms).

``BENCH_GPU_PYTHON_MODEL`` (``torch`` or ``numpy``) and ``BENCH_GPU_PYTHON_DEVICE`` (``cuda`` or
``cpu``) in the worker's environment (the pool's ``python.env``) pick the implementation: torch
(``torch.set_num_threads(1)``, TF32 off, ``torch.inference_mode()``) on the worker's one GPU or
on the CPU, or the same shapes as numpy matmuls (for a machine without torch). With torch the
module imports it at its top, so that a gpu worker sets up its stream, its ``memory_limit``
budget and the pinning of client segments before ``on_start`` builds the model
(docs/python.md, "In the worker"). ``on_start`` also runs one forward pass, so that the worker
is warm (cuBLAS initialised) before it serves.
"""

from __future__ import annotations

import importlib
import os
import time
import warnings
from typing import Any, Callable, Dict, Tuple

import numpy as np

import gpuq

IN, HIDDEN, OUT = 512, 1024, 10
SEED = 1234
MLP = "Linear(512, 1024), ReLU, Linear(1024, 1024), ReLU, Linear(1024, 10), float32"

MODEL = os.environ.get("BENCH_GPU_PYTHON_MODEL", "")
DEVICE = os.environ.get("BENCH_GPU_PYTHON_DEVICE", "cpu")
if MODEL == "torch":
    importlib.import_module("torch")  # at the top, in the workers only: see the docstring

Forward = Callable[[np.ndarray], np.ndarray]

_forward: Forward = None  # type: ignore[assignment]  # set by on_start
_as_tensor: Callable[[np.ndarray], Any] = np.asarray


def use(model: str) -> None:
    """Sets what ``torch_noop`` wraps its array with: ``torch.from_numpy`` or ``np.asarray``."""
    global _as_tensor
    if model == "torch":
        import torch
        # The op gets a read-only view; the wrapped tensor is never written.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        _as_tensor = torch.from_numpy
    else:
        _as_tensor = np.asarray


def build_forward(model: str, device: str) -> Tuple[Forward, Callable[[], Dict[str, Any]]]:
    """The MLP as a function (rows, 512) float32 -> (rows, 10) float32 numpy array, and a
    function describing where it runs. Not warmed up: the first call pays torch's lazy setup."""
    if model == "torch":
        import torch
        with warnings.catch_warnings():  # torch >= 2.9 has fp32_precision, and warns on the old
            warnings.simplefilter("ignore")
            if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
                torch.backends.cuda.matmul.fp32_precision = "ieee"
            else:
                torch.backends.cuda.matmul.allow_tf32 = False
        torch.set_num_threads(1)
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        torch.manual_seed(SEED)  # weights made on the CPU: the same on every device
        net = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(),
                                  torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                  torch.nn.Linear(HIDDEN, OUT)).eval()
        net.requires_grad_(False)
        from_numpy, inference_mode = torch.from_numpy, torch.inference_mode
        if device == "cuda":
            dev = torch.device("cuda", 0)  # a gpu worker sees its GPU alone, as device 0
            net = net.to(dev)

            def forward(x: np.ndarray) -> np.ndarray:
                with inference_mode():
                    return net(from_numpy(x).to(dev, non_blocking=True)).cpu().numpy()
        else:
            def forward(x: np.ndarray) -> np.ndarray:
                with inference_mode():
                    return net(from_numpy(x)).numpy()

        def info() -> Dict[str, Any]:
            d: Dict[str, Any] = {"model": "torch", "torch": torch.__version__,
                                 "device": str(next(net.parameters()).device),
                                 "pid": os.getpid()}
            if device == "cuda":
                d["gpu_name"] = torch.cuda.get_device_name(0)
                d["stream"] = str(torch.cuda.current_stream())
                d["memory_allocated_mib"] = torch.cuda.memory_allocated(0) / 2**20
                d["memory_reserved_mib"] = torch.cuda.memory_reserved(0) / 2**20
            return d

        return forward, info
    if model != "numpy" or device != "cpu":
        raise ValueError(f"model {model!r} on {device!r}: want torch (cpu or cuda) or numpy (cpu)")
    rng = np.random.default_rng(SEED)
    layers = []
    for fan_in, fan_out in ((IN, HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, OUT)):
        bound = 1.0 / np.sqrt(fan_in)  # torch.nn.Linear's default init range
        layers.append((rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32),
                       rng.uniform(-bound, bound, fan_out).astype(np.float32)))

    def forward_np(x: np.ndarray) -> np.ndarray:
        h = x
        for i, (w, b) in enumerate(layers):
            h = h @ w
            h += b
            if i < len(layers) - 1:
                np.maximum(h, 0, out=h)
        return h

    return forward_np, lambda: {"model": "numpy", "device": "cpu", "pid": os.getpid()}


_info: Callable[[], Dict[str, Any]] = dict


@gpuq.on_start
def _load() -> None:
    global _forward, _info
    _forward, _info = build_forward(MODEL or "torch", DEVICE)
    _forward(np.zeros((1, IN), np.float32))  # warm: the worker serves with cuBLAS set up
    use(MODEL or "torch")


@gpuq.op("mlp")
def mlp(x: np.ndarray) -> np.ndarray:
    """The MLP 512-1024-1024-10: (rows, 512) float32 -> (rows, 10) float32."""
    return _forward(x)


@gpuq.op("torch_noop")
def torch_noop(x: np.ndarray) -> None:
    """Wraps x as a CPU tensor (no copy, no GPU work) and returns None."""
    _as_tensor(x)


@gpuq.op("mlp_info")
def mlp_info() -> Dict[str, Any]:
    """Where this worker's model runs: {"model", "device", "pid", ...}. Takes 20 ms, so that
    calls in flight at once spread over the pool's workers."""
    time.sleep(0.02)
    return _info()
