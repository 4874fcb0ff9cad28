"""Functions that pool children run (a module of its own, so spawn children can import it)."""

from __future__ import annotations

import os

import numpy as np

import gpuq


def echo_task(i: int) -> tuple:
    """In any child: jobs through the module's default client; returns what the worker wrote."""
    x = np.full(1000, i, dtype=np.int64)
    out = gpuq.empty(1000, np.int64)
    gpuq.submit("echo", x, out=out).result(30)
    assert gpuq.submit("sleep", us=100).result(30) == 100
    return os.getpid(), int(out.sum())


def wait_for_all(barrier) -> None:
    """A pool's initializer: every child has started (and imported gpuq) before any takes a
    task, so that one quick child cannot run them all while the others still start."""
    barrier.wait(120)


def checksum_of(a: np.ndarray) -> int:
    return gpuq.submit("checksum", a).result(30)


def raises_in_forked_child(future, exc_type, timeout: float = 10.0) -> bool:
    """Forks; the child waits on `future` (its parent's) and exits 0 only if that raised
    `exc_type`. True when it did."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            future.result(timeout)
        except exc_type:
            code = 0
        except BaseException:  # noqa: BLE001
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0
