"""A Python op's answer (docs/python.md, "Wire format"): made from what the op returned and
written at the start of the job's output buffer (the worker), and read back (the caller).

The format is encoded and decoded by one C++ codec (python/src/call_codec.hpp, in gpuq._native);
``_native.write_result`` writes the common results itself, and what it leaves to Python (a
framework's tensors, str and dict) is converted here. Named ops never exchange pickles: a worker's
answer to a named op is arrays and JSON only."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _native
from ._wire import is_array, json_text


def result_arrays(result: Any) -> Tuple[str, List[np.ndarray], Any]:
    """(kind, arrays, json value) of what an op returned."""
    if result is None:
        return "none", [], None
    if is_array(result):
        return ("array" if isinstance(result, np.ndarray) else "scalar"), [np.asarray(result)], None
    if isinstance(result, (bool, int, float, complex)):
        return "scalar", [np.asarray(result)], None
    if isinstance(result, (tuple, list)) and all(
        is_array(x) or isinstance(x, (bool, int, float, complex)) for x in result
    ):
        return "tuple", [np.asarray(x) for x in result], None
    # A framework's tensor (torch, CuPy, JAX): to host memory, through numpy.
    conv = _to_numpy(result)
    if conv is not None:
        return "array", [conv], None
    if isinstance(result, (tuple, list)):
        arrays = [_to_numpy(x) if not is_array(x) else np.asarray(x) for x in result]
        if all(a is not None for a in arrays):
            return "tuple", arrays, None  # type: ignore[return-value]
    if isinstance(result, (str, dict, list)):
        json_text(result, "the op's result")  # TypeError when it is not JSON-able
        return "json", [], result
    raise TypeError(
        f"the op returned {type(result).__name__}; return a numpy array (or a "
        "torch/CuPy/JAX/TensorFlow array), a tuple of them, a scalar, a str, dict or "
        "list, or None"
    )


def _to_numpy(x: Any) -> Optional[np.ndarray]:
    """A framework's array in host memory as numpy, told by its class's module (so no
    framework is imported here); None for anything else."""
    mod = type(x).__module__.split(".")[0]
    if mod == "torch":
        return x.detach().cpu().numpy()
    if mod == "cupy":
        return x.get()
    if mod in ("jax", "jaxlib"):
        return np.asarray(x)
    if mod == "tensorflow" and hasattr(x, "numpy"):  # an EagerTensor, a tf.Variable's value
        return np.asarray(x.numpy())
    if mod == "keras" and hasattr(x, "__array__"):  # a Keras 3 Variable (model.weights)
        return np.asarray(x)
    return None


def write_answer(out: memoryview, header: Dict[str, Any], arrays: Sequence[np.ndarray]) -> int:
    """Writes an answer at the start of ``out``: ``header``'s "kind" (default "error") and its
    other keys as the answer's extra JSON, and the arrays; the bytes used. Raises
    ResultTooLarge when they do not fit."""
    extra = {k: v for k, v in header.items() if k != "kind"}
    kind = header.get("kind", "error")
    n = _native.write_answer(
        out, kind, [np.asarray(a) for a in arrays], json.dumps(extra) if extra else ""
    )
    if n < 0:
        raise ResultTooLarge(-n, len(out))
    return n


def write_result(out: memoryview, result: Any) -> int:
    n = _native.write_result(out, result)  # the common results, in C++
    if n is None:
        kind, arrays, value = result_arrays(result)
        header: Dict[str, Any] = {"kind": kind}
        if kind == "json":
            header["value"] = value
        return write_answer(out, header, arrays)
    if n < 0:
        raise ResultTooLarge(-n, len(out))
    return n


def write_error(out: memoryview, kind: str, message: str, tb: str, **extra: Any) -> int:
    """The failure record (type, message, traceback), trimmed to fit; 0 when none fits."""
    for limit in (len(tb), 16384, 2048, 0):
        rec = {
            "error": dict(
                {
                    "type": kind,
                    "message": message[:4096],
                    "traceback": tb[-limit:] if limit else "",
                },
                **extra,
            )
        }
        try:
            return write_answer(out, rec, [])
        except ResultTooLarge:
            continue
    return 0


class ResultTooLarge(Exception):
    def __init__(self, needed: int, capacity: int) -> None:
        super().__init__()
        self.needed = needed
        self.capacity = capacity
        self.part: Optional[int] = None  # a stream's part (gpuq._parts): its cell was too small

    def __str__(self) -> str:
        if self.part is not None:
            return (
                f"part {self.part} of the stream needs {self.needed} bytes, and each part's "
                f"cell holds {self.capacity}: pass part_bytes={self.needed} (or more) to "
                "Client.stream"
            )
        return (
            f"the result needs {self.needed} bytes, and the job's output buffer holds "
            f"{self.capacity}: pass output_bytes={self.needed} (or more)"
        )


def read_answer(out: np.ndarray, nbytes: int) -> Dict[str, Any]:
    """The answer the worker wrote at the start of ``out`` (a uint8 array): its extra JSON
    keys, "kind", and "arrays" as views of ``out``."""
    kind, views, extra = _native.read_answer(out, nbytes)
    header = json.loads(extra) if extra else {}
    if not isinstance(header, dict):
        raise ValueError("the worker's answer is malformed (its extra is not a JSON object)")
    header["kind"] = kind
    header["arrays"] = views
    return header
