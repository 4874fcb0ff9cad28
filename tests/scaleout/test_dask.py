"""gpuq under dask.distributed (docs/scale-out.md): a scheduler and two `dask worker`
processes on this machine, each worker started with GPUQ_RUNTIME_DIR of its own gpuqd
(conftest's nodes a and b), which its worker process inherits."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
from typing import Dict

import numpy as np
import pytest
from distributed import Client, wait

import gpuq
import scaleout_tasks as tasks
from conftest import BIN, REPO, Node, Processes, engine_env, read_failures, wait_for

SCHEDULER = "tcp://127.0.0.1:8786"  # in the tests' own network namespace
N_TASKS = 400
PRELOAD = REPO / "examples" / "dask" / "gpuq_resource.py"
GPUQ = {"gpuq": 1}  # the resource of workers whose node's gpuqd serves


@pytest.fixture(scope="module")
def cluster(nodes: Dict[str, Node], tmp_path_factory: pytest.TempPathFactory):
    """(a Client, {worker name: the Node whose GPUQ_RUNTIME_DIR that worker got})."""
    procs = Processes(tmp_path_factory.mktemp("dask-logs"))
    scratch = str(tmp_path_factory.mktemp("dask-scratch"))
    try:
        procs.start("scheduler", [str(BIN / "dask"), "scheduler", "--host", "127.0.0.1",
                                  "--port", "8786", "--no-dashboard"], engine_env(None))
        for name in ("a", "b"):
            procs.start(f"worker-{name}", [str(BIN / "dask"), "worker", SCHEDULER, "--name", name,
                                           "--nworkers", "1", "--nthreads", "2",
                                           "--resources", "gpuq=2", "--preload", str(PRELOAD),
                                           "--host", "127.0.0.1", "--no-dashboard",
                                           "--local-directory", scratch],
                        engine_env(nodes[name]))
        client = Client(SCHEDULER, timeout=60)
        wait_for("two Dask workers", lambda: len(client.scheduler_info()["workers"]) == 2, 60,
                 procs.logs)
        yield client, {name: nodes[name] for name in ("a", "b")}
        client.close()
    finally:
        procs.stop()


def worker_address(client: Client, name: str) -> str:
    return next(addr for addr, w in client.scheduler_info()["workers"].items()
                if w["name"] == name)


def gpuq_resource_of(client: Client, name: str) -> float:
    return client.scheduler_info()["workers"][worker_address(client, name)]["resources"]["gpuq"]


def check_results(workers: Dict[str, Node], results: list) -> collections.Counter:
    """Each result right and from its worker's own daemon; the count per worker name."""
    served = collections.Counter()
    for i, (name, runtime_dir, y) in enumerate(results):
        assert runtime_dir == workers[name].runtime_dir, f"task {i} on worker {name}"
        np.testing.assert_allclose(y, tasks.expected(i), rtol=1e-5, atol=1e-6)
        served[name] += 1
    return served


def test_map_runs_on_each_workers_own_daemon(cluster, nodes):
    client, workers = cluster
    before = {k: n.score_jobs() for k, n in nodes.items()}
    futures = client.map(tasks.dask_task, range(N_TASKS), resources=GPUQ, pure=False)
    wait(futures, timeout=180)
    served = check_results(workers, client.gather(futures))

    assert served["a"] > 0 and served["b"] > 0, served
    for k, n in nodes.items():
        assert n.score_jobs() - before[k] == served[k], (k, served)


@pytest.mark.parametrize("script", ["dask_map.py", "dask_joblib.py"])
def test_example(cluster, nodes, script):
    before = sum(n.score_jobs() for n in nodes.values())
    env = dict(os.environ, DASK_SCHEDULER_ADDRESS=SCHEDULER)
    env.pop("GPUQ_RUNTIME_DIR", None)  # the driver does not call gpuq; the workers do
    p = subprocess.run([sys.executable, str(REPO / "examples" / "dask" / script), "--tasks",
                        "100"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("ok"), p.stdout + p.stderr
    assert sum(n.score_jobs() for n in nodes.values()) - before == 100, p.stdout


def test_killed_daemon_fails_its_workers_tasks_and_dask_retries_them(cluster, nodes, failures):
    client, workers = cluster
    a, b = nodes["a"], nodes["b"]
    a_before, b_before = a.score_jobs(), b.score_jobs()
    n = 2 * N_TASKS
    futures = client.map(tasks.dask_task, range(n), resources=GPUQ, retries=10, pure=False)
    try:
        wait_for("node b serving", lambda: b.score_jobs() - b_before >= 5, 120, poll=0.005)
        b_served_before_kill = b.score_jobs() - b_before
        b.kill()
        assert sum(f.done() for f in futures) < n // 2
        wait(futures, timeout=240)
        served = check_results(workers, client.gather(futures))

        assert a.score_jobs() - a_before == served["a"], served
        seen = read_failures(failures)
        print(f"served {dict(served)}, {len(seen)} failed attempts on b after the kill, "
              f"b served {b_served_before_kill} before it")
        assert seen, "no task failed: the kill came too late to test anything"
        assert {(d, t) for d, t, _ in seen} == {(b.runtime_dir, "Disconnected")}, seen

        # b's worker gave up its "gpuq" resource (gpuq_resource.call), so no retry went there.
        assert gpuq_resource_of(client, "b") == 0
        # A task held to b, without retries, raises gpuq.Disconnected from result().
        pinned = client.submit(tasks.dask_task, 0, workers=[worker_address(client, "b")],
                               allow_other_workers=False, pure=False)
        with pytest.raises(gpuq.Disconnected):
            pinned.result(timeout=60)
    finally:
        if b.daemon.proc is None or b.daemon.proc.poll() is not None:
            b.start()

    # b's worker sees its restarted gpuqd, takes the resource back, and serves again.
    wait_for("b's gpuq resource back", lambda: gpuq_resource_of(client, "b") == 2, 30)
    name, runtime_dir, y = client.submit(
        tasks.dask_task, 7, workers=[worker_address(client, "b")], allow_other_workers=False,
        resources=GPUQ, retries=3, pure=False).result(timeout=60)
    assert (name, runtime_dir) == ("b", b.runtime_dir)
    np.testing.assert_allclose(y, tasks.expected(7), rtol=1e-5, atol=1e-6)
