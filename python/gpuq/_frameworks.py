"""The ML frameworks a Python pool's worker finds loaded (torch, CuPy, TensorFlow; never
imported here): on a GPU pool each is set up once for the worker's one GPU (its device, a
stream made current, the pool's ``memory_limit`` on its allocator; TensorFlow's memory growth
and a logical device of that size), clients' segments page-locked through them, a device
checked after a failure. Also which exceptions mean that memory ran out."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any, Dict, Optional, Tuple


def loaded() -> Tuple[Any, Any]:
    """torch and cupy, when the pool's modules loaded them (never imported here)."""
    return sys.modules.get("torch"), sys.modules.get("cupy")


NAMES = ("torch", "cupy", "tensorflow")  # what Frameworks.configure sets up


def log(message: str) -> None:
    """A line in gpuqd's log (a worker's stderr goes there)."""
    print(f"gpuq python worker: {message}", file=sys.stderr, flush=True)


def nvml_total_memory() -> Tuple[Optional[int], str]:
    """(the total memory of this worker's GPU in bytes, or None and why), from NVML through
    ctypes when libnvidia-ml is there: the GPU named by ``CUDA_VISIBLE_DEVICES`` (gpuqd sets
    its UUID, or its index in PCI bus order, which is NVML's). No CUDA context is made."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if not visible or visible == "-1":
        return None, "CUDA_VISIBLE_DEVICES names no GPU"
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return None, f"no NVML ({e})"

    class Memory(ctypes.Structure):  # nvmlMemory_t
        _fields_ = [
            ("total", ctypes.c_ulonglong),
            ("free", ctypes.c_ulonglong),
            ("used", ctypes.c_ulonglong),
        ]

    try:
        rc = nvml.nvmlInit_v2()
        if rc != 0:
            return None, f"nvmlInit_v2 failed ({rc})"
        try:
            handle = ctypes.c_void_p()
            if visible.isdigit():
                rc = nvml.nvmlDeviceGetHandleByIndex_v2(
                    ctypes.c_uint(int(visible)), ctypes.byref(handle)
                )
            else:
                rc = nvml.nvmlDeviceGetHandleByUUID(visible.encode(), ctypes.byref(handle))
            if rc != 0:
                return None, f"NVML does not know GPU {visible} ({rc})"
            mem = Memory()
            rc = nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem))
            if rc != 0:
                return None, f"nvmlDeviceGetMemoryInfo failed ({rc})"
            return int(mem.total), ""
        finally:
            nvml.nvmlShutdown()
    except AttributeError as e:  # an NVML without one of these functions
        return None, f"NVML lacks {e}"


# The frameworks' out-of-memory exceptions, as (module, attribute) looked up in sys.modules: a
# framework that is not loaded raised none of them, and is never imported here to find out.
_OOM_CLASSES = (
    ("torch", "OutOfMemoryError"),  # newer torch; torch.cuda.OutOfMemoryError names it too
    ("torch.cuda", "OutOfMemoryError"),
    ("cupy.cuda.memory", "OutOfMemoryError"),
    # tf.errors.ResourceExhaustedError: the class tf.errors names, in the module that defines it
    ("tensorflow.python.framework.errors_impl", "ResourceExhaustedError"),
)
# What torch before 1.13 (and code that wraps its message) raised: a plain RuntimeError.
_OOM_MESSAGE = "CUDA out of memory"


def out_of_memory(e: BaseException) -> bool:
    """Whether an op's exception says that memory ran out: a ``MemoryError`` (numpy's
    allocation failures are one), torch's ``OutOfMemoryError`` or a ``RuntimeError`` whose
    message starts "CUDA out of memory", CuPy's ``cupy.cuda.memory.OutOfMemoryError``,
    TensorFlow's ``tf.errors.ResourceExhaustedError``. Such a job ends ``OutOfMemory``."""
    if isinstance(e, MemoryError):
        return True
    for module, attr in _OOM_CLASSES:
        cls = getattr(sys.modules.get(module), attr, None)
        if isinstance(cls, type) and isinstance(e, cls):
            return True
    return isinstance(e, RuntimeError) and str(e).startswith(_OOM_MESSAGE)


class Frameworks:
    """The frameworks of one GPU worker (gpuq._worker's Runtime has one on a GPU pool):
    ``context`` is the worker's :class:`gpuq.WorkerContext`, whose device and stream this
    fills in; ``memory_limit`` is (bytes, fraction of the device), what gpuqd gave the worker."""

    def __init__(self, context: Any) -> None:
        self.context = context
        self.memory_limit: Tuple[int, float] = (0, 0.0)
        self.configured: set = set()
        self.registered: Dict[int, int] = {}  # client -> base address page-locked

    def configure_new(self) -> None:
        """Sets up a framework the job's code has imported since the last look."""
        if len(self.configured) < len(NAMES):
            self.configure()

    def configure(self) -> None:
        """Sets up each framework loaded since the last call (once each)."""
        ctx = self.context
        torch, cupy = loaded()
        tf = sys.modules.get("tensorflow")
        limit_bytes, fraction = self.memory_limit
        if torch is not None and "torch" not in self.configured:
            self.configured.add("torch")
            torch.cuda.set_device(0)
            ctx.torch_device = torch.device("cuda", 0)
            stream = torch.cuda.Stream(device=0)
            torch.cuda.set_stream(stream)
            ctx.stream = stream
            total = torch.cuda.get_device_properties(0).total_memory
            frac = min(1.0, limit_bytes / total) if limit_bytes else fraction
            torch.cuda.set_per_process_memory_fraction(frac, 0)
        if cupy is not None and "cupy" not in self.configured:
            self.configured.add("cupy")
            cupy.cuda.Device(0).use()
            if torch is not None and ctx.stream is not None:
                s = cupy.cuda.ExternalStream(ctx.stream.cuda_stream)
            else:
                s = cupy.cuda.Stream(non_blocking=True)
            s.use()
            ctx.cupy_stream = s
            if ctx.stream is None:
                ctx.stream = s
            pool = cupy.get_default_memory_pool()
            if limit_bytes:
                pool.set_limit(size=limit_bytes)
            else:
                pool.set_limit(fraction=fraction)
        if tf is not None and "tensorflow" not in self.configured:
            self.configured.add("tensorflow")
            self._configure_tensorflow(tf)

    def _device_total_memory(self) -> Tuple[Optional[int], str]:
        """The worker's GPU's memory in bytes, from a framework that has its CUDA context
        already (torch, CuPy), else from NVML; (None, why) when none can tell."""
        torch, cupy = loaded()
        if "torch" in self.configured and torch is not None:
            return int(torch.cuda.get_device_properties(0).total_memory), ""
        if "cupy" in self.configured and cupy is not None:
            return int(cupy.cuda.Device(0).mem_info[1]), ""
        return nvml_total_memory()

    def _configure_tensorflow(self, tf: Any) -> None:
        """TensorFlow's budget on a GPU pool: memory growth (it takes device memory as it needs
        it, not all of it at start) and one logical GPU of the pool's ``memory_limit`` in MiB.
        TensorFlow accepts both only before it has initialised its GPUs, so this runs right
        after the pool's modules are imported, before ``on_start``."""
        try:
            gpus = tf.config.list_physical_devices("GPU")
        except Exception as e:  # noqa: BLE001 - a broken install: said, not fatal
            log(f"tensorflow: cannot list its GPUs ({type(e).__name__}: {e}); not configured")
            return
        if not gpus:
            log(
                "tensorflow sees no GPU (a CPU-only build such as tensorflow-cpu, or one "
                "built without this CUDA): its ops run on the CPU, with no memory budget"
            )
            return
        gpu = gpus[0]  # the worker sees its one GPU
        limit_bytes, fraction = self.memory_limit
        total, why = self._device_total_memory()
        if limit_bytes:  # capped at the device's memory, as for torch
            limit_mib = (min(limit_bytes, total) if total else limit_bytes) >> 20
        else:
            limit_mib = int(total * fraction) >> 20 if total and fraction > 0 else 0
        try:
            if tf.config.get_logical_device_configuration(gpu):
                log(
                    "tensorflow: the pool's module gave its GPU logical devices itself; "
                    "left as they are (no memory_limit from the pool)"
                )
                return
            # Growth first: TensorFlow refuses to change it once the device has a logical
            # configuration.
            tf.config.experimental.set_memory_growth(gpu, True)
            if limit_mib:
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=limit_mib)]
                )
        except (RuntimeError, ValueError) as e:
            # "Physical devices cannot be modified after being initialized"
            log(
                f"tensorflow had initialised its GPU before the worker could configure it "
                f"({e}): no memory growth and no memory_limit for it; import tensorflow at "
                "the top of the pool's module and use it only in on_start or in ops"
            )
            return
        if limit_mib:
            log(f"tensorflow: memory growth on, one logical GPU of {limit_mib} MiB")
        else:
            log(
                f"tensorflow: memory growth on, but no memory_limit: the GPU's total memory "
                f"is unknown ({why}), so the pool's fraction {fraction} cannot be made MiB"
            )

    @staticmethod
    def versions() -> Dict[str, Any]:
        """The versions of the frameworks loaded, by name (the worker's status)."""
        torch, cupy = loaded()
        d: Dict[str, Any] = {}
        if torch is not None:
            d["torch"] = torch.__version__
        if cupy is not None:
            d["cupy"] = cupy.__version__
        tf = sys.modules.get("tensorflow")
        if tf is not None:
            d["tensorflow"] = getattr(tf, "__version__", "?")
        return d

    def page_lock(self, client: int, base: int, size: int) -> None:
        """Page-locks a client's segment as it is mapped (faster copies to and from the GPU;
        pageable copies still work when it cannot)."""
        torch, cupy = loaded()
        if torch is not None:
            err = torch.cuda.cudart().cudaHostRegister(base, size, 0)
            if int(err) == 0:
                self.registered[client] = base
        elif cupy is not None:
            try:
                cupy.cuda.runtime.hostRegister(base, size, 0)
                self.registered[client] = base
            except Exception:  # noqa: BLE001 - pageable copies still work
                pass

    def page_unlock(self, client: int, base: int, size: int) -> None:
        """Undoes page_lock before a client's segment is unmapped."""
        if self.registered.pop(client, None) is None:
            return
        torch, cupy = loaded()
        if torch is not None:
            torch.cuda.cudart().cudaHostUnregister(base)
        elif cupy is not None:
            cupy.cuda.runtime.hostUnregister(base)

    def device_works(self) -> bool:
        """After a failure: whether the CUDA context still works (a sticky error poisons it;
        the worker then exits to be replaced, after this job's outcome)."""
        torch, cupy = loaded()
        try:
            if torch is not None:
                torch.cuda.synchronize()
            elif cupy is not None:
                cupy.cuda.runtime.deviceSynchronize()
        except Exception:  # noqa: BLE001 - any error here means the context is gone
            return False
        return True
