"""TensorFlow in Python pools (docs/python.md; the `tf` stage of scripts/test.sh runs it in a venv
with tensorflow-cpu, tests/tf/requirements.txt): skipped where TensorFlow does not import, as in
the `python` stage.

One gpuqd with the pools of examples/python/patterns/gpuqd-tf-patterns.json (paths: this
checkout; interpreter: this test's), whose workers import the examples' tf_ops and
python/tests/pyops/pyops_tf.py: TensorFlow tensors in an op's answer arrive as numpy,
TensorFlow's ResourceExhaustedError (raised, and a real allocation that fails) ends the job
OutOfMemory with TensorFlow's message, and the TensorFlow examples run on their default pool
and on the cpu pool. On a GPU whose TensorFlow sees it (marker `gpu`), the gpu pool's worker
must have configured TensorFlow: memory growth on, one logical GPU of the pool's
memory_limit, an allocation past it OutOfMemory."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow", reason="no TensorFlow: the `tf` stage's venv has it")

import gpuq  # noqa: E402
import gpuq.testing  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
PATTERNS_DIR = REPO / "examples" / "python" / "patterns"
OPS_DIR = pathlib.Path(__file__).resolve().parent / "pyops"
TF_PATTERNS = sorted(PATTERNS_DIR.glob("tf_*.py"))
TF_EXAMPLES = [p for p in TF_PATTERNS if p.stem != "tf_ops"]  # tf_ops: the pools' module
BUDGET = 256 << 20  # the gpu pool's memory_limit here, in bytes
TF_GPUS = tf.config.list_physical_devices("GPU")  # lists; initialises nothing


def tf_config():
    """gpuqd-tf-patterns.json with its Python pools pointed at this checkout and interpreter,
    importing the test ops too; the gpu pool's budget in bytes, to check exactly."""
    cfg = json.loads((PATTERNS_DIR / "gpuqd-tf-patterns.json").read_text())
    pools = {p["name"]: p for p in cfg["pools"]}
    assert set(pools) == {"cpu", "tf", "tf-gpu"}
    for name in ("tf", "tf-gpu"):
        py = pools[name]["python"]
        py.pop("venv")
        py.update(interpreter=sys.executable, path=[str(PATTERNS_DIR), str(OPS_DIR)],
                  modules=["tf_ops", "pyops_tf"])
    pools["tf-gpu"]["memory_limit"] = BUDGET
    return cfg


@pytest.fixture(scope="module")
def td():
    with gpuq.testing.Daemon(tf_config(), start_timeout=180) as d:
        yield d


@pytest.fixture
def tc(td):
    with gpuq.connect(td.runtime_dir, name="pytest-tf") as c:
        yield c


def test_the_workers_run_tensorflow(td):
    tf_pool = next(p for p in td.status()["pools"] if p["name"] == "tf")
    assert tf_pool["status"] == "ready", tf_pool
    assert {"tf_embed", "tf_square", "tf_gpu_config"} <= set(tf_pool["python"]["ops"])
    assert all(w["backend"]["tensorflow"] == tf.__version__ for w in tf_pool["workers"])


def test_tensors_in_an_answer_arrive_as_numpy(tc):
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    sq = tc.call("tf_square", x, pool="tf")
    assert type(sq) is np.ndarray and sq.dtype == np.float32 and sq.shape == (3, 4)
    np.testing.assert_array_equal(sq, x * x)
    v = tc.call("tf_variable", pool="tf")  # a tf.Variable
    assert type(v) is np.ndarray and v.dtype == np.float32
    np.testing.assert_array_equal(v, [[1, 2], [3, 4]])
    sums, argmax = tc.call("tf_pair", x[:, ::-1].copy(), pool="tf")  # a tuple of tensors
    assert sums.dtype == np.float32 and argmax.dtype == np.int32
    np.testing.assert_array_equal(sums, x.sum(axis=1))
    np.testing.assert_array_equal(argmax, [0, 0, 0])
    np.testing.assert_array_equal(tc.call("tf_numpy_ok", x, pool="tf"), x + 1)


def test_a_batched_op_answering_a_tensor_splits_it_per_job(tc):
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (1, 3, 2, 4, 1, 5)]
    futures = [tc.submit_call("tf_relu_batched", x, pool="tf") for x in xs]
    for x, f in zip(xs, futures):
        np.testing.assert_array_equal(f.result(timeout=60), np.maximum(x, 0))


def test_resource_exhausted_is_out_of_memory(tc):
    msg = "OOM when allocating tensor with shape[1048576,1048576] and type float"
    with pytest.raises(gpuq.OutOfMemory) as e:
        tc.call("tf_raise_oom", msg, pool="tf")
    err = e.value
    assert isinstance(err, MemoryError) and err.code == gpuq.OutOfMemory.code
    assert str(err).startswith(f"tf_raise_oom: ResourceExhaustedError: {msg}"[:147]), str(err)
    assert err.remote_type == "tensorflow.python.framework.errors_impl.ResourceExhaustedError"
    # A real one: TensorFlow's CPU allocator refusing 1 PiB, TensorFlow's message kept.
    f = tc.submit_call("tf_alloc", 1 << 30, 1 << 20, pool="tf")
    with pytest.raises(gpuq.OutOfMemory,
                       match=r"^tf_alloc: ResourceExhaustedError: OOM when allocating tensor "
                             r"with shape\[1073741824,1048576\] and type uint8"):
        f.result(timeout=60)
    assert f.info.code == gpuq.OutOfMemory.code
    assert "OOM when allocating" in f.exception().remote_traceback
    assert tc.call("tf_alloc", 4, 4, pool="tf") == 16  # the worker serves on


@pytest.mark.parametrize("pool", [None, "tf"], ids=["default-pool", "env-tf"])
@pytest.mark.parametrize("script", TF_EXAMPLES, ids=[p.name for p in TF_EXAMPLES])
def test_tf_pattern_runs(td, script, pool):
    env = td.env()
    env.pop("GPUQ_TF_POOL", None)
    if pool is not None:
        env["GPUQ_TF_POOL"] = pool
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=300, cwd=script.parent)
    assert r.returncode == 0, f"{script.name} exited {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert r.stdout.rstrip().endswith("ok"), r.stdout
    assert f"pool {pool or 'tf-gpu'!r}" in r.stdout, r.stdout
    if pool is None and os.environ.get("GPUQ_TEST_REQUIRE_GPU") == "1":
        assert "GPU:0" in r.stdout, f"{script.name}: the model is not on the GPU\n{r.stdout}"
    print(r.stdout)


def test_there_are_tf_patterns_each_named_in_its_page():
    assert [p.stem for p in TF_PATTERNS] == ["tf_fork_pool", "tf_ops", "tf_shared_gpu"]
    page = REPO / "docs" / "python" / "patterns" / "tensorflow.md"
    for p in TF_EXAMPLES:
        assert "docs/python/patterns/tensorflow.md" in p.read_text(), p.name
        assert p.name in page.read_text(), p.name


# ---- on a GPU that TensorFlow sees ----------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not TF_GPUS, reason="TensorFlow sees no GPU (tensorflow-cpu, or no device)")
def test_gpu_pool_configures_tensorflow(tc, td):
    pool = next(p for p in tc.pools if p["name"] == "tf-gpu")
    assert pool["runs_on"] == "tf-gpu", pool
    cfg = tc.call("tf_gpu_config", pool="tf-gpu")
    assert cfg["gpus"] == 1, cfg  # the worker sees its one GPU
    assert cfg["memory_growth"] is True, cfg
    assert cfg["memory_limit_mib"] == [BUDGET >> 20], cfg
    assert cfg["logical_gpus"] == 1, cfg
    assert tc.call("tf_alloc", 1 << 20, 64, pool="tf-gpu") == 64 << 20  # within the budget
    with pytest.raises(gpuq.OutOfMemory, match="^tf_alloc: ResourceExhaustedError"):
        tc.call("tf_alloc", 1 << 20, 2 * (BUDGET >> 20), pool="tf-gpu")
    assert tc.call("tf_alloc", 1 << 20, 64, pool="tf-gpu") == 64 << 20  # serves on
    info = tc.call("tf_model_info", pool="tf-gpu")
    assert info["device"].endswith("GPU:0"), info
