"""A job's options (pool, timeout, expire_after, retryable, time_limit, try_only, priority): checked and
converted once, into the one value every submit of gpuq._native takes (``_native.JobOptions``,
python/src/job_options.hpp). A new option is a field there and a keyword of job_options here."""

from __future__ import annotations

import copy
import math
from typing import Any, Optional, TypedDict

from . import _errors, _native

JobOptions = _native.JobOptions


class Options(TypedDict, total=False):
    """job_options' keywords, for the calls that take them as ``**options`` (the tensor
    helpers): a new option is a field here and a keyword of job_options."""

    pool: Optional[str]
    timeout: Optional[float]
    expire_after: Optional[float]
    retryable: bool
    time_limit: Optional[float]
    try_only: bool
    priority: Optional[str]


# The options of a job given none: made once.
DEFAULT = JobOptions()


def job_options(
    pool: Optional[str] = None,
    timeout: Optional[float] = None,
    expire_after: Optional[float] = None,
    retryable: bool = False,
    time_limit: Optional[float] = None,
    try_only: bool = False,
    priority: Optional[str] = None,
) -> JobOptions:
    """The options of a submit, checked: InvalidArgument naming the first one that is wrong.
    ``timeout``: seconds a submit waits for room (None: as long as it takes). ``expire_after``:
    seconds a job may stay queued. ``time_limit``: seconds it may run (None or 0: none of its
    own). ``try_only``: no room is QueueFull at once. ``priority``: "high", "normal" (None)
    or "low"."""
    if pool is not None and not isinstance(pool, str):
        raise _errors.InvalidArgument(f"pool: must be a pool's name (str), not {pool!r}")
    return JobOptions(
        pool or "",
        seconds_to_ns(timeout, "timeout"),
        seconds_to_ns(expire_after, "expire_after"),
        bool(retryable),
        time_limit_ms(time_limit),
        bool(try_only),
        priority_level(priority),
    )


# gpuq::Priority's levels by name, from the highest (priority.hpp, exported by the binding).
PRIORITIES: dict = _native.PRIORITIES


def priority_level(value: Optional[str]) -> int:
    """``priority`` as gpuq::Priority's number (None: normal)."""
    if value is None:
        return int(PRIORITIES["normal"])
    level = PRIORITIES.get(value) if isinstance(value, str) else None
    if level is None:
        raise _errors.InvalidArgument(
            f"priority: must be one of {', '.join(repr(p) for p in PRIORITIES)} "
            f"(higher levels are taken first), not {value!r}"
        )
    return int(level)


def replace(options: JobOptions, **changes: Any) -> JobOptions:
    """A copy of ``options`` with some fields changed (in the native units: ``timeout_ns``...);
    ``options`` itself is never changed (DEFAULT is shared)."""
    changed = copy.copy(options)
    for name, value in changes.items():
        setattr(changed, name, value)
    return changed


def seconds(ns: int) -> Optional[float]:
    """A nanosecond option back in seconds (None: no limit)."""
    return None if ns < 0 else ns / 1e9


def seconds_to_ns(value: Optional[float], what: str) -> int:
    if value is None:
        return -1
    if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise _errors.InvalidArgument(f"{what}: must be a number of seconds >= 0, not {value!r}")
    return int(value * 1e9) if math.isfinite(value) else -1


# JobSpec::time_limit's bound: 2^32 - 1 ms (about 49.7 days).
MAX_TIME_LIMIT_MS = 0xFFFFFFFF


def time_limit_ms(value: Optional[float]) -> int:
    """``time_limit`` in seconds as whole milliseconds, rounded up (0: none)."""
    if value is None:
        return 0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value < 0
    ):
        raise _errors.InvalidArgument(
            f"time_limit: must be a number of seconds >= 0 (0 or None: no limit), not {value!r}"
        )
    if value == 0 or math.isinf(value):
        return 0
    # Rounded to the nanosecond first, so that 1.1 s is 1100 ms and not 1101.
    ms = max(1, math.ceil(round(value * 1000, 6)))
    if ms > MAX_TIME_LIMIT_MS:
        raise _errors.InvalidArgument(
            f"time_limit: {value!r} s is more than the most a job may be given, "
            f"{MAX_TIME_LIMIT_MS} ms (about 49.7 days); None: no limit"
        )
    return ms
