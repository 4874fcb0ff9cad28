"""Python ops for the GPU tests (python/tests/test_python_gpu.py): torch on a gpu Python pool,
numpy on a cpu one, so the same op can be compared across the two."""

import numpy as np

import gpuq

try:
    import torch
except ImportError:  # the cpu pool of a machine without torch
    torch = None


def _on_gpu():
    return torch is not None and gpuq.context().gpu


@gpuq.op("gpu_matmul")
def gpu_matmul(a, b):
    if _on_gpu():
        ta = torch.from_numpy(a).to("cuda", non_blocking=True)
        tb = torch.from_numpy(b).to("cuda", non_blocking=True)
        return (ta @ tb).cpu().numpy()
    return a @ b


@gpuq.op("gpu_info")
def gpu_info():
    if not _on_gpu():
        return {"gpu": False}
    ctx = gpuq.context()
    return {"gpu": True, "device": torch.cuda.current_device(),
            "stream": int(torch.cuda.current_stream().cuda_stream),
            "worker_stream": int(ctx.stream.cuda_stream),
            "default_stream": int(torch.cuda.default_stream().cuda_stream),
            "devices": torch.cuda.device_count(),
            "total": int(torch.cuda.get_device_properties(0).total_memory)}


@gpuq.op("gpu_alloc")
def gpu_alloc(nbytes):
    """Allocates nbytes on the device (past the pool's memory_limit: OutOfMemoryError)."""
    x = torch.empty(int(nbytes), dtype=torch.uint8, device="cuda")
    x.fill_(1)
    torch.cuda.synchronize()
    return int(x.numel())


@gpuq.op("gpu_pinned_copy")
def gpu_pinned_copy(x):
    """Whether the caller's segment is page-locked (a view of it pinned in torch's eyes)."""
    t = torch.from_numpy(x)
    return bool(t.is_pinned())


@gpuq.op("gpu_sticky_error")
def gpu_sticky_error():
    """An out-of-bounds index on the device: a device-side assert, which poisons the context."""
    x = torch.zeros(4, device="cuda")
    idx = torch.tensor([1 << 20], device="cuda")
    x[idx] = 1.0
    torch.cuda.synchronize()
    return 0
