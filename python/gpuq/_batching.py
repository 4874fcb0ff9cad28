"""A batched op's jobs in the worker (docs/python.md, "Dynamic batching"): each job's arguments
decoded, the key of the jobs that may share a call, their arrays concatenated along axis 0, and
the call's result cut back into each job's rows."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from . import _native
from ._answers import result_arrays


def decode_call(buf: memoryview, params: Dict[str, Any]) -> Tuple[list, dict]:
    """The job's args and kwargs from its input span (the native codec): arrays as views of
    ``buf`` (read-only when it is)."""
    try:
        h = int(params[_native.PARAM_HEADER])
        n = int(params[_native.PARAM_HEADER_BYTES])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            "not a Python op job: its params lack py.h and py.n (submit it with gpuq.Client.call)"
        ) from None
    if h < 0 or n < 0:
        raise ValueError(f"the header [{h}, +{n}) lies outside the job's {len(buf)}-byte input")
    _, args, kwargs = _native.decode_call(buf, h, n, False)
    return args, kwargs


def batch_key(args: Sequence[Any], kwargs: Dict[str, Any]) -> Tuple[Any, int]:
    """A batched op's job: (what jobs must share to be called together, its rows). The key is
    None for a job that runs alone: no array argument, a 0-d one, or arrays whose first axes
    differ. Jobs share a call when their JSON arguments, and their arrays' dtypes and shapes
    past axis 0, are the same."""
    rows = -1
    alone = False

    def part(v: Any) -> Any:
        nonlocal rows, alone
        if isinstance(v, np.ndarray):
            if v.ndim == 0 or (rows >= 0 and v.shape[0] != rows):
                alone = True
                return None
            rows = v.shape[0]
            return (
                "nd",
                v.dtype.str if v.dtype.fields is None else repr(v.dtype.descr),
                v.shape[1:],
            )
        return ("js", json.dumps(v, sort_keys=True, allow_nan=True))

    key = (tuple(part(a) for a in args), tuple((k, part(v)) for k, v in sorted(kwargs.items())))
    if alone or rows < 0:
        return None, max(rows, 1)
    return key, rows


def check_rows(key: Any, rows: int, params: Dict[str, Any]) -> None:
    """Raises ValueError when a job that may share a call has more rows than its params said
    (py.r, which the worker's gatherer counts to hold a batch to max_batch_size rows: the one
    place the limit is kept). gpuq's client writes the true count; only a forged job lies."""
    if key is None:
        return  # called alone
    said = params.get(_native.PARAM_ROWS)
    if not isinstance(said, int) or rows > max(said, 1):
        raise ValueError(
            f"its arrays have {rows} rows, but its params say {said!r} "
            f"({_native.PARAM_ROWS}); submit it with gpuq.Client.call"
        )


def group(keys: Sequence[Any]) -> List[List[int]]:
    """The calls of a gathered batch: the positions of the jobs that share each key (in the
    order of each key's first job), and each job with no key alone. The worker gathered at
    most max_batch_size rows, so no call needs cutting."""
    calls: List[List[int]] = []
    by_key: Dict[Any, List[int]] = {}
    for i, key in enumerate(keys):
        if key is None:
            calls.append([i])
            continue
        call = by_key.get(key)
        if call is None:
            call = by_key[key] = []
            calls.append(call)
        call.append(i)
    return calls


def concat_rows(parts: Sequence[Any]) -> Any:
    """One argument of a batched call: the jobs' arrays concatenated along axis 0 (one copy,
    C-contiguous), or the first job's JSON value (the batch key makes them all equal)."""
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts, axis=0)
    return parts[0]


def split_rows(name: str, result: Any, rows: Sequence[int]) -> Tuple[str, List[List[np.ndarray]]]:
    """A batched call's result cut into each job's rows: (kind, [arrays of job j]). Raises
    TypeError when it is not an array or tuple of arrays with one row per input row."""
    total = sum(rows)
    kind, arrays, _ = result_arrays(result)
    if (
        kind not in ("array", "tuple")
        or not arrays
        or any(a.ndim == 0 or a.shape[0] != total for a in arrays)
    ):
        shapes = [tuple(a.shape) for a in arrays] if kind in ("array", "tuple") else kind
        raise TypeError(
            f"{name} is batched: it must return an array, or a tuple of arrays, "
            f"with one row per input row; the call had {total} rows and returned "
            f"{shapes}"
        )
    out = []
    at = 0
    for r in rows:
        out.append([a[at : at + r] for a in arrays])
        at += r
    return kind, out
