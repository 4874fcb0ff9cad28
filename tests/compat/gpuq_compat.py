"""pytest plugin of the peer suites (run.py): one gpuqd for the session, whose Python pool runs
callables; only the tests that run on gpuq are kept; differences.txt is applied.

* The daemon starts before the suites are imported, and ``GPUQ_RUNTIME_DIR`` points at it, so
  ``gpuq.Executor()`` and ``Parallel(backend="gpuq")`` find it as a user's would.
* Of joblib's test_parallel.py, the tests one of whose parameters is the "gpuq" backend (its
  name or an instance of it) are kept; the others test joblib's own backends.
* A test listed under ``[not applicable]`` is skipped with its reason; one listed under
  ``[open]`` is expected to fail (strictly: once it passes, the list must lose it).
"""

from __future__ import annotations

import os
import pathlib
import re
import sys
from typing import Any, Dict, List, Tuple

import pytest

HERE = pathlib.Path(__file__).resolve().parent

# Four workers: CPython's suite makes executors of five and joblib's runs n_jobs=2 to -1; the
# workers of a Python pool sleep while idle, so they may outnumber the machine's cores.
WORKERS = 4


def _config() -> Dict[str, Any]:
    path = [p for p in os.environ.get("GPUQ_COMPAT_PATH", "").split(os.pathsep) if p]
    return {"pools": [{"name": "compat", "kind": "cpu", "workers": WORKERS,
                       "python": {"interpreter": sys.executable, "path": path,
                                  "allow_callables": True}}],
            "restart_backoff_initial_ms": 10}


_daemon: Any = None


def pytest_configure(config: Any) -> None:
    global _daemon
    # Marks of joblib's suite that its own plugins (pytest-run-parallel, pytest-cov) define.
    config.addinivalue_line("markers", "thread_unsafe: joblib's, for pytest-run-parallel")
    config.addinivalue_line("markers", "no_cover: joblib's, for pytest-cov")
    import gpuq.testing
    _daemon = gpuq.testing.Daemon(_config()).start()
    os.environ["GPUQ_RUNTIME_DIR"] = _daemon.runtime_dir
    config.stash[_LIST] = read_differences(HERE / "differences.txt")


def pytest_unconfigure(config: Any) -> None:
    global _daemon
    d, _daemon = _daemon, None
    if d is not None:
        d.__exit__(None, None, None)


_LIST = pytest.StashKey[Dict[str, List[Tuple[str, str]]]]()


def read_differences(path: pathlib.Path) -> Dict[str, List[Tuple[str, str]]]:
    """{section: [(pattern, reason)]}: each entry a test id pattern (the file's name and the
    test's, e.g. ``test_parallel.py::test_x[gpuq-*]``, where only ``*`` is a wildcard: any
    characters), then two spaces or more,
    then its reason; ``#`` starts a comment line; a reason may go on over indented lines."""
    sections: Dict[str, List[Tuple[str, str]]] = {"not applicable": [], "open": []}
    current = None
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.rstrip()
        if not line or line.lstrip().startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            if current not in sections:
                raise pytest.UsageError(f"{path}:{n}: unknown section [{current}]")
            continue
        if current is None:
            raise pytest.UsageError(f"{path}:{n}: an entry before any section")
        if raw[0].isspace():  # a reason going on
            pattern, reason = sections[current][-1]
            sections[current][-1] = (pattern, f"{reason} {line.strip()}")
            continue
        parts = line.split("  ", 1)
        if len(parts) != 2 or not parts[1].strip():
            raise pytest.UsageError(f"{path}:{n}: '{line}' gives no reason (two spaces, then "
                                    "the reason)")
        sections[current].append((parts[0].strip(), parts[1].strip()))
    return sections


def _matches(pattern: str, test_id: str) -> bool:
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), test_id, re.S) is not None


def _on_gpuq(item: Any) -> bool:
    spec = getattr(item, "callspec", None)
    if spec is None:
        return False
    for v in spec.params.values():
        if v == "gpuq" or type(v).__name__ == "GpuqBackend":
            return True
    return False


def pytest_collection_modifyitems(config: Any, items: List[Any]) -> None:
    keep, drop = [], []
    for item in items:
        if item.path.name == "test_parallel.py" and not _on_gpuq(item):
            drop.append(item)
        else:
            keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    lists = config.stash[_LIST]
    used = set()
    for item in items:
        tid = f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"
        for section, entries in lists.items():
            for pattern, reason in entries:
                if _matches(pattern, tid):
                    used.add(pattern)
                    if section == "not applicable":
                        item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))
                    else:
                        item.add_marker(pytest.mark.xfail(reason=f"open: {reason}",
                                                          strict=True))
                    break
            else:
                continue
            break
    unused = [p for entries in lists.values() for p, _ in entries if p not in used]
    if unused and not config.getoption("keyword") and not config.getoption("markexpr"):
        raise pytest.UsageError("differences.txt lists tests that no longer exist: " +
                                ", ".join(unused))
