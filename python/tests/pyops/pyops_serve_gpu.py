"""The op of the gpu pool `gpuq serve --gpus all` starts in python/tests/test_serve.py (a GPU
machine only: scripts/device_check.sh)."""
import torch

import gpuq


@gpuq.op("where_am_i")
def where_am_i(x):
    """The device the op's tensor is on, and its sum."""
    t = torch.as_tensor(x).to(gpuq.context().torch_device)
    return {"device": str(t.device), "sum": float(t.sum())}
