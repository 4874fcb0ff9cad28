"""Fixtures of the scale-out tests (docs/scale-out.md, "Testing"): two gpuqd daemons, each
standing in for one node with a runtime directory of its own, serving op ``score``
(examples/scale-out/node_ops.py) in a one-worker Python pool; the Ray and Dask clusters whose
node N's workers see daemon N are made by test_ray.py and test_dask.py.

Run through ``tests/scaleout/netns.sh`` (``GPUQ_TEST_STAGES=scaleout bash scripts/test.sh``
does): the tests refuse to start where the network has more than the loopback interface.
"""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
OPS_DIR = REPO / "examples" / "scale-out"
BIN = pathlib.Path(sys.executable).parent  # the venv's ray and dask commands

# Ray: no usage reports, and no token authentication, which would otherwise be turned on by a
# token some earlier local ray.init() left in ~/.ray: nothing outside this network namespace
# can reach the cluster anyway. Ray's processes and the examples inherit these.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_AUTH_MODE"] = "disabled"


def node_config(cpu: int) -> Dict:
    """A node's gpuqd: one Python worker pinned to ``cpu``, importing node_ops."""
    return {"pools": [{"name": "py", "kind": "cpu", "workers": 1, "cpus": [cpu],
                       "python": {"interpreter": sys.executable, "modules": ["node_ops"],
                                  "path": [str(OPS_DIR)]}}]}


class Node:
    """One stand-in node's gpuqd. ``kill()`` is a crash (SIGKILL); ``start()`` starts a new
    gpuqd on the same runtime directory, as systemd's ``Restart=on-failure`` would."""

    def __init__(self, name: str, cpu: int) -> None:
        self.name = name
        self.daemon = gpuq.testing.Daemon(node_config(cpu))
        self.runtime_dir = self.daemon.runtime_dir

    def start(self) -> None:
        self.daemon.start()

    def kill(self) -> None:
        proc = self.daemon.proc
        assert proc is not None and proc.poll() is None, f"node {self.name}'s gpuqd is not running"
        proc.kill()
        proc.wait()

    def score_jobs(self) -> int:
        """Jobs of op score that ended ok, from the daemon's metrics (gpuq_jobs_total)."""
        n = 0
        for line in gpuq.metrics(self.runtime_dir).splitlines():
            if (line.startswith("gpuq_jobs_total{") and 'op="score"' in line
                    and 'outcome="ok"' in line):
                n += int(float(line.rsplit(" ", 1)[1]))
        return n


@pytest.fixture(scope="session", autouse=True)
def loopback_only() -> None:
    names = [n for _, n in socket.if_nameindex()]
    if names != ["lo"]:
        pytest.fail(f"network interfaces {names}: run these tests in a network namespace of "
                    "their own, `bash tests/scaleout/netns.sh PYTHON pytest tests/scaleout` "
                    "(Ray would bind and dial this machine's non-loopback address)",
                    pytrace=False)


@pytest.fixture(scope="session")
def nodes() -> Dict[str, Node]:
    cpus = sorted(os.sched_getaffinity(0))
    a, b = Node("a", cpus[0]), Node("b", cpus[-1])
    with a.daemon, b.daemon:
        yield {"a": a, "b": b}


@pytest.fixture(scope="session", autouse=True)
def failures_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``$GPUQ_SCALEOUT_FAILURES``, where tasks record their failed attempts, for every engine
    process the tests start."""
    os.environ["GPUQ_SCALEOUT_FAILURES"] = str(tmp_path_factory.mktemp("scaleout") / "failures")


@pytest.fixture
def failures() -> pathlib.Path:
    """The failures file, emptied for this test."""
    path = pathlib.Path(os.environ["GPUQ_SCALEOUT_FAILURES"])
    path.write_text("")
    return path


def read_failures(path: pathlib.Path) -> List[List[str]]:
    """The recorded failures: [runtime_dir, exception class, task index] each."""
    return [line.split() for line in path.read_text().splitlines()]


def engine_env(node: Optional[Node]) -> Dict[str, str]:
    """The environment of an engine's processes: a node's (``ray start``, ``dask worker``)
    leads its workers to that node's gpuqd; each can import scaleout_tasks (a Dask scheduler
    unpickles the tasks too)."""
    env = node.daemon.env() if node else dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


class Processes:
    """Long-running commands (a Ray node, a Dask scheduler or worker), each in a session of its
    own with its output in a log."""

    def __init__(self, log_dir: pathlib.Path) -> None:
        self.log_dir = log_dir
        self.procs: List[subprocess.Popen] = []

    def start(self, name: str, args: List[str], env: Dict[str, str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p

    def logs(self) -> str:
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}"
                         for f in sorted(self.log_dir.glob("*.log")))

    def stop(self) -> None:
        """SIGTERM to each command (a Ray node drains and stops its processes); SIGKILL to
        what its session still holds 15 s later."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 15
        for p in reversed(self.procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def wait_for(what: str, ready: Callable[[], bool], timeout: float,
             logs: Optional[Callable[[], str]] = None, poll: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s" +
                                 (f"\n{logs()}" if logs else ""))
        time.sleep(poll)
