"""Which Python pool runs an op: the daemon's Python pools and their ops, from its status
(``gpuqctl status``'s document), cached for 5 s in the client."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from . import _errors

T = TypeVar("T")


def python_pools(client: Any, refresh: bool = False) -> List[Dict[str, Any]]:
    """The daemon's Python pools (name, ops, allow_callables), from its status; cached."""
    cached = getattr(client, "_py_pools", None)
    if cached is not None and not refresh and time.monotonic() - cached[0] < 5.0:
        return cached[1]
    # Available ones first: an unavailable pool (no GPU, an import error) is only a last resort
    # (its jobs fail at once, naming why).
    # Only the pools the daemon's catalog offers: the status also lists a pool a config reload
    # removed, and one it adds before it takes jobs.
    offered = {p["name"] for p in client.pools}
    listed = [p for p in client.status().get("pools", []) if "python" in p and p["name"] in offered]
    listed.sort(key=lambda p: p.get("status") == "unavailable")
    pools = [
        {
            "name": p["name"],
            "ops": p["python"].get("ops", []),
            "allow_callables": bool(p["python"].get("allow_callables")),
        }
        for p in listed
    ]
    client._py_pools = (time.monotonic(), pools)
    return pools


def pool_for(client: Any, op: str, pool: Optional[str]) -> str:
    if pool:
        return pool
    for attempt in (False, True):
        for p in python_pools(client, refresh=attempt):
            if op in p["ops"]:
                return p["name"]
    raise no_pool(op)


def submit_to(client: Any, op: str, pool: Optional[str], submit: Callable[[str], T]) -> T:
    """``submit(name)`` to ``pool``, or when none is named to the first Python pool that has
    ``op``; if that pool was removed by a config reload since the cache was filled
    (UnknownPool), once more to the first that has it now."""
    if pool:
        return submit(pool)
    try:
        return submit(pool_for(client, op, None))
    except _errors.UnknownPool:
        python_pools(client, refresh=True)
        return submit(pool_for(client, op, None))


def cached_pool(client: Any, op: str) -> Tuple[Optional[str], bool]:
    """(the first Python pool that has ``op`` in the cache of python_pools, or None; whether
    that cache is fresh), without asking the daemon."""
    cached = getattr(client, "_py_pools", None)
    if cached is None:
        return None, False
    fresh = time.monotonic() - cached[0] < 5.0
    for p in cached[1]:
        if op in p["ops"]:
            return p["name"], fresh
    return None, fresh


def no_pool(op: str) -> BaseException:
    return _errors.UnknownOp(
        f"no Python pool of this daemon has op {op!r} (a @gpuq.op function "
        "in one of its python.modules); gpuqctl status lists each pool's ops"
    )
