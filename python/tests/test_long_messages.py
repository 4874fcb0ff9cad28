"""A job's failure message reaches the Python client whole up to 2 KiB (issue 38): the test
plug-in's op plugin_fail (tests/support/test_plugin.cpp) fails with a message of exactly
`bytes` bytes, "<bytes>:" and then the digits 0-9 over and over; a Python op's exception
message the same (python/tests/pyops/pyops_mod.py's op fail)."""

from __future__ import annotations

import pathlib
import sys

import pytest

import gpuq
import gpuq.testing

PLUGIN = pathlib.Path(gpuq.testing.find_gpuqd()).parent.parent / "tests" / "libgpuq_test_plugin.so"


def _text(n: int) -> str:
    head = f"{n}:"
    return head + "".join(str(i % 10) for i in range(len(head), n))


@pytest.fixture(scope="module")
def client():
    if not PLUGIN.exists():
        pytest.skip(f"{PLUGIN} not built (target gpuq_test_plugin)")
    config = {"pools": [{"name": "cpu", "workers": 1}], "plugins": [str(PLUGIN)]}
    with gpuq.testing.Daemon(config) as d, gpuq.connect(d.runtime_dir) as c:
        yield c


@pytest.mark.parametrize("n", [160, 2000])
def test_an_op_error_message_arrives_whole(client, n):
    with pytest.raises(gpuq.OpFailed) as e:
        client.submit("plugin_fail", bytes=n).result(30)
    assert str(e.value) == "plugin_fail: " + _text(n)


def test_a_longer_one_keeps_its_beginning_and_its_end(client):
    with pytest.raises(gpuq.OpFailed) as e:
        client.submit("plugin_fail", bytes=5000).result(30)
    text = str(e.value)
    assert len(text) == 2047
    assert text.startswith("plugin_fail: 5000:5678") and " ... " in text
    assert text.endswith(_text(2047)[-100:])


@pytest.fixture(scope="module")
def py_client():
    ops_dir = str(pathlib.Path(__file__).resolve().parent / "pyops")
    config = {"pools": [{"name": "py", "workers": 1,
                         "python": {"interpreter": sys.executable, "modules": ["pyops_mod"],
                                    "path": [ops_dir]}}]}
    with gpuq.testing.Daemon(config) as d, gpuq.connect(d.runtime_dir) as c:
        yield c


def test_a_python_ops_error_message_arrives_whole(py_client):
    text = _text(1900)
    with pytest.raises(gpuq.OpFailed) as e:
        py_client.call("fail", msg=text, timeout=60)
    assert str(e.value) == "fail: ValueError: " + text
