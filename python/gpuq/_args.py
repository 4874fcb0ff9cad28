"""Checks and conversions of the arguments the calls share (seconds to nanoseconds, a time
limit to whole milliseconds): used by _client and _calls."""

from __future__ import annotations

import math
from typing import Optional

from . import _errors


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
