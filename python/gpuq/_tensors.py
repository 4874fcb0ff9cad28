"""The built-in tensor ops' submits (Client.conv2d, gemm, activation, softmax, pool2d,
batchnorm; docs/ops.md): operands placed in the client's segment, the result's array made, one
job submitted. The shapes and options are checked by gpuq._native (the C++ client library's
own rules)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _errors
from ._future import Future
from ._options import JobOptions

_TENSOR_DTYPES = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}


def submit_tensor(
    client: Any,
    op: str,
    named: Sequence[Tuple[str, Any]],
    y_shape_of: Callable[[List[Any]], Any],
    opts: Dict[str, Any],
    out: Optional[np.ndarray],
    options: JobOptions,
) -> Future:
    """Submits tensor op ``op``: ``named`` its operands as (name, array or None), in order;
    ``y_shape_of`` the result's shape from theirs; ``opts`` the op's own options; ``out`` the
    result's array in the segment, else one is made. The future's result is that array."""
    conn = client._c()
    keep: list = []
    operands: List[Optional[Tuple[int, Tuple[int, ...]]]] = []
    dtype: Optional[np.dtype] = None
    for what, a in named:
        if a is None:
            operands.append(None)
            continue
        if dtype is None:
            a = a if isinstance(a, np.ndarray) else np.asarray(a, dtype=np.float32)
            dtype = a.dtype
            if dtype not in _TENSOR_DTYPES:
                raise _errors.InvalidArgument(
                    f"{op}: {what}: dtype is {dtype}; the tensor ops take float32 or float16"
                )
        off, arr = client._operand(conn, a, f"{op}: {what}", keep, dtype)
        operands.append((off, arr.shape))
    assert dtype is not None
    if dtype == np.float16 and _runs_on_kind(conn, options.pool or None) == "cpu":
        raise _errors.InvalidArgument(
            f"{op}: dtype: f16 is not supported on cpu pools (f32 only); submit it to a gpu pool"
        )
    shapes = [o[1] if o is not None else None for o in operands]
    y_shape = tuple(y_shape_of(shapes))
    if out is None:
        out = client.empty(y_shape, dtype)
    else:
        if out.dtype != dtype:
            raise _errors.InvalidArgument(f"{op}: out: dtype is {out.dtype}, must be {dtype}")
        if tuple(out.shape) != y_shape:
            raise _errors.InvalidArgument(
                f"{op}: out: shape is {tuple(out.shape)}, the result's is {y_shape}"
            )
    y_off = client._out(conn, out, f"{op}: out")
    keep.append(out)
    job = conn.native.tensor(op, operands, (y_off, y_shape), _TENSOR_DTYPES[dtype], opts, options)
    result: np.ndarray = out
    return Future(job, keep, lambda info: result, conn.watcher)


def _runs_on_kind(conn: Any, pool: Optional[str]) -> Optional[str]:
    """The kind of the pool that would run a job for ``pool`` (its fallback while it is
    unavailable), or None when that is unknown (the submit reports the error)."""
    if pool and pool not in conn.pools:  # added since connect (a reload): the catalog again
        conn.pools = {p[0]: p for p in conn.native.pools()}
    p = conn.pools.get(pool) if pool else next(iter(conn.pools.values()), None)
    if p is not None and not p[4]:  # (name, kind, capacity, share, available, reason, runs_on)
        p = conn.pools.get(p[6])
    return p[1] if p is not None else None
