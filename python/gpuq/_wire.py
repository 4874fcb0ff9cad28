"""The Python side of the Python ops' wire format: what the C++ codec (python/src/call_codec.cpp,
in gpuq._native) asks of Python while it encodes or decodes a call or an answer, dtypes and
JSON values as text and back. A leaf: it imports nothing of gpuq, so the codec, which imports it
at run time, and every module of the package may use it without an import circle."""

from __future__ import annotations

import json
import warnings
from typing import Any

import numpy as np

__all__ = ["dtype_text", "dtype_of_text", "json_text", "is_array"]


def dtype_spec(dt: np.dtype) -> Any:
    if dt.hasobject:
        raise TypeError(f"arrays of dtype {dt} (Python objects) cannot be shared")
    return dt.str if dt.fields is None else dt.descr


def dtype_from(spec: Any) -> np.dtype:
    """A dtype from dtype_spec's form: a string, or a structured dtype's descr as JSON lists
    (nested ones included)."""

    def fields(descr: Any) -> Any:
        if isinstance(descr, str):
            return descr
        if not isinstance(descr, list):
            raise ValueError(f"not a dtype: {descr!r}")
        return [
            (f[0], fields(f[1])) if len(f) < 3 else (f[0], fields(f[1]), tuple(f[2])) for f in descr
        ]

    return np.dtype(fields(spec))


def dtype_text(dt: np.dtype) -> str:
    """An array's dtype as the wire format writes it: numpy's ``dtype.str``, or a structured
    dtype's descr as JSON. TypeError for dtypes holding Python objects."""
    spec = dtype_spec(dt)
    return spec if isinstance(spec, str) else json.dumps(spec)


def dtype_of_text(text: str) -> np.dtype:
    """dtype_text's inverse, for what a peer wrote: ValueError when it is not a dtype, or one
    holding Python objects (an array of those over shared bytes would be pointers from
    another process)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated alias is refused too
            dt = dtype_from(json.loads(text)) if text.startswith("[") else np.dtype(text)
    except (TypeError, ValueError, Warning) as e:
        raise ValueError(f"{text[:80]!r} is not a dtype ({e})") from None
    if dt.hasobject:
        raise ValueError(f"dtype {text[:80]!r} holds Python objects, which cannot be shared")
    return dt


def json_text(v: Any, what: str) -> str:
    """A value that is neither an array nor a plain scalar, as JSON text; TypeError naming
    ``what`` when it is not JSON-able."""
    try:
        return json.dumps(v, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what}: {type(v).__name__} is neither an array nor JSON-able "
            f"({e}); pass numpy arrays, numbers, strings, lists or dicts"
        ) from None


def is_array(v: Any) -> bool:
    return isinstance(v, (np.ndarray, np.generic))
