"""gpuq under Ray (docs/scale-out.md): a two-node Ray cluster on this machine, `ray start
--head` plus `ray start --address`, each started with GPUQ_RUNTIME_DIR of its own gpuqd
(conftest's nodes a and b), so node N's workers inherit it and reach daemon N."""

from __future__ import annotations

import collections
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from typing import Dict

import numpy as np
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import gpuq
import scaleout_tasks as tasks
from conftest import BIN, REPO, Node, Processes, engine_env, read_failures, wait_for

RAY_PORT = 6390  # in the tests' own network namespace: no other Ray can hold it
ADDRESS = f"127.0.0.1:{RAY_PORT}"
N_TASKS = 400

ray_task = ray.remote(tasks.ray_task)
Scorer = ray.remote(tasks.Scorer)


def gcs_listening() -> bool:
    try:
        socket.create_connection(("127.0.0.1", RAY_PORT), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(nodes: Dict[str, Node], tmp_path_factory: pytest.TempPathFactory):
    """{Ray node id: the Node whose GPUQ_RUNTIME_DIR its `ray start` got}."""
    temp = tempfile.mkdtemp(prefix="gpuq-ray.", dir="/tmp")  # short: Ray's socket paths
    procs = Processes(tmp_path_factory.mktemp("ray-logs"))
    common = ["--block", "--num-cpus", "2", "--object-store-memory", str(80 << 20),
              "--temp-dir", temp, "--disable-usage-stats"]
    try:
        procs.start("head", [str(BIN / "ray"), "start", "--head", "--port", str(RAY_PORT),
                             "--include-dashboard=false", *common],
                    engine_env(nodes["a"]))
        wait_for("the Ray head's GCS", gcs_listening, 60, procs.logs)
        procs.start("node-b", [str(BIN / "ray"), "start", "--address", ADDRESS, *common],
                    engine_env(nodes["b"]))
        ray.init(address=ADDRESS, logging_level="warning", log_to_driver=False)
        wait_for("two live Ray nodes", lambda: len([n for n in ray.nodes() if n["Alive"]]) == 2,
                 60, procs.logs)
        head = [n["NodeID"] for n in ray.nodes() if "node:__internal_head__" in n["Resources"]]
        other = [n["NodeID"] for n in ray.nodes() if n["NodeID"] not in head]
        ids = {head[0]: nodes["a"], other[0]: nodes["b"]}
        # Warm each node up: its Ray workers started and connected to its daemon, so that the
        # tests' tasks are not all done on the head before the other node has a worker ready.
        for nid, node in ids.items():
            on_node = ray_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                nid, soft=False))
            for _, runtime_dir, _ in ray.get([on_node.remote(i) for i in range(4)], timeout=120):
                assert runtime_dir == node.runtime_dir
        yield ids
    finally:
        ray.shutdown()
        procs.stop()
        shutil.rmtree(temp, ignore_errors=True)


def node_id(cluster: Dict[str, Node], name: str) -> str:
    return next(k for k, n in cluster.items() if n.name == name)


def check_results(cluster: Dict[str, Node], results: list) -> collections.Counter:
    """Each result right and from its Ray node's own daemon; the count per node name."""
    served = collections.Counter()
    for i, (nid, runtime_dir, y) in enumerate(results):
        assert runtime_dir == cluster[nid].runtime_dir, f"task {i} on node {nid}"
        np.testing.assert_allclose(y, tasks.expected(i), rtol=1e-5, atol=1e-6)
        served[cluster[nid].name] += 1
    return served


def test_tasks_run_on_their_own_nodes_daemon(cluster, nodes):
    before = {k: n.score_jobs() for k, n in nodes.items()}
    refs = [ray_task.options(scheduling_strategy="SPREAD").remote(i) for i in range(N_TASKS)]
    served = check_results(cluster, ray.get(refs, timeout=180))
    print(f"\nserved {dict(served)}")

    # Both nodes served, and each daemon's metrics count exactly its node's tasks.
    assert served["a"] > 0 and served["b"] > 0, served
    for k, n in nodes.items():
        assert n.score_jobs() - before[k] == served[k], (k, served)


def test_actors_use_their_nodes_daemon(cluster, nodes):
    actors = {name: Scorer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id(cluster, name), soft=False)).remote() for name in ("a", "b")}
    calls = {name: [a.score.remote(i) for i in range(50)] for name, a in actors.items()}
    for name, refs in calls.items():
        for i, (runtime_dir, y) in enumerate(ray.get(refs, timeout=120)):
            assert runtime_dir == nodes[name].runtime_dir
            np.testing.assert_allclose(y, tasks.expected(i), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("script", ["ray_tasks.py", "ray_joblib.py"])
def test_example(cluster, nodes, script):
    before = sum(n.score_jobs() for n in nodes.values())
    env = dict(os.environ, RAY_ADDRESS=ADDRESS)
    env.pop("GPUQ_RUNTIME_DIR", None)  # the driver does not call gpuq; the workers do
    p = subprocess.run([sys.executable, str(REPO / "examples" / "ray" / script), "--tasks", "100"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.rstrip().endswith("ok"), p.stdout + p.stderr
    jobs = 200 if script == "ray_tasks.py" else 100  # ray_tasks: 100 tasks, 100 actor calls
    assert sum(n.score_jobs() for n in nodes.values()) - before == jobs, p.stdout


def test_killed_daemon_fails_its_nodes_tasks_and_ray_retries_them(cluster, nodes, failures):
    a, b = nodes["a"], nodes["b"]
    a_before, b_before = a.score_jobs(), b.score_jobs()
    retried = ray_task.options(max_retries=10, retry_exceptions=[gpuq.Disconnected],
                               scheduling_strategy="SPREAD")
    n = 2 * N_TASKS  # long enough a run that the kill lands in its first half
    refs = [retried.remote(i) for i in range(n)]
    try:
        # Mid-run: once b has served a few, while most tasks are still to run.
        wait_for("node b serving", lambda: b.score_jobs() - b_before >= 5, 120, poll=0.005)
        b_served_before_kill = b.score_jobs() - b_before
        b.kill()
        assert len(ray.wait(refs, num_returns=n, timeout=0)[0]) < n // 2
        served = check_results(cluster, ray.get(refs, timeout=240))

        # Every task finished right; a's daemon ran exactly the tasks that came back from a
        # (b's results are those its gpuqd finished before the kill).
        assert a.score_jobs() - a_before == served["a"], served
        # b's tasks after the kill failed with Disconnected, on b only, and were retried.
        seen = read_failures(failures)
        print(f"\nserved {dict(served)}, {len(seen)} failed attempts on b after the kill, "
              f"b served {b_served_before_kill} before it")
        assert seen, "no task failed: the kill came too late to test anything"
        assert {(d, t) for d, t, _ in seen} == {(b.runtime_dir, "Disconnected")}, seen

        # A task pinned to b, without retries, gets gpuq.Disconnected from ray.get.
        pinned = ray_task.options(max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(
            node_id(cluster, "b"), soft=False))
        with pytest.raises(gpuq.Disconnected):
            ray.get(pinned.remote(0), timeout=60)
    finally:
        if b.daemon.proc is None or b.daemon.proc.poll() is not None:
            b.start()  # as systemd's Restart=on-failure would

    # The restarted gpuqd serves node b again. A worker of b whose client still belongs to the
    # killed daemon (one that ran no task during the outage) fails once and closes it: retried.
    on_b = ray_task.options(max_retries=3, retry_exceptions=[gpuq.Disconnected],
                            scheduling_strategy=NodeAffinitySchedulingStrategy(
                                node_id(cluster, "b"), soft=False))
    nid, runtime_dir, y = ray.get(on_b.remote(7), timeout=60)
    assert (cluster[nid].name, runtime_dir) == ("b", b.runtime_dir)
    np.testing.assert_allclose(y, tasks.expected(7), rtol=1e-5, atol=1e-6)
