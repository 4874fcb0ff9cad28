"""Every built-in op through the Python client, results checked against numpy."""

from __future__ import annotations

import numpy as np
import pytest

import gpuq


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def test_noop_returns_value_zero(client):
    f = client.submit("noop")
    assert f.result(10) == 0
    assert f.info.status == "done" and f.info.code == 0


def test_echo_in_segment(client):
    x = client.array(np.arange(1000, dtype=np.float64))
    out = client.empty_like(x)
    f = client.submit("echo", x, out=out)
    assert f.result(10) is out
    np.testing.assert_array_equal(out, np.arange(1000, dtype=np.float64))
    assert f.info.output_size == x.nbytes and f.info.value == x.nbytes


def test_echo_bytes_input(client):
    out = client.empty(5, np.uint8)
    client.submit("echo", b"hello", out=out).result(10)
    assert out.tobytes() == b"hello"


def test_sleep_param(client):
    f = client.submit("sleep", us=2000)
    assert f.result(10) == 2000
    assert f.info.run_ns >= 2_000_000


def test_checksum(client):
    data = bytes(range(256)) * 9
    assert client.submit("checksum", data).result(10) == crc32c(data)
    assert client.submit("checksum", client.array(np.frombuffer(data, np.uint8))).result(
        10) == crc32c(data)


def conv2d_ref(x, w, b, stride, pad):
    n, c, h, wd = x.shape
    k, _, r, s = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh = (h + 2 * pad - r) // stride + 1
    ow = (wd + 2 * pad - s) // stride + 1
    y = np.zeros((n, k, oh, ow), np.float64)
    for i in range(oh):
        for j in range(ow):
            patch = xp[:, :, i * stride:i * stride + r, j * stride:j * stride + s]
            y[:, :, i, j] = np.einsum("ncrs,kcrs->nk", patch, w)
    if b is not None:
        y += b[None, :, None, None]
    return y


rng = np.random.default_rng(7)


@pytest.mark.parametrize("stride,pad,bias", [(1, 0, False), (1, 1, True), (2, 1, True)])
def test_conv2d(client, stride, pad, bias):
    x = rng.standard_normal((2, 3, 9, 9)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32) if bias else None
    y = client.conv2d(x, w, b, stride=stride, padding=pad).result(30)
    ref = conv2d_ref(x.astype(np.float64), w.astype(np.float64), b, stride, pad)
    assert y.shape == ref.shape and y.dtype == np.float32
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    assert client.in_segment(y)


@pytest.mark.parametrize("mode,fn", [("relu", lambda v: np.maximum(v, 0)),
                                     ("sigmoid", lambda v: 1 / (1 + np.exp(-v))),
                                     ("tanh", np.tanh)])
def test_activation(client, mode, fn):
    x = rng.standard_normal((3, 50)).astype(np.float32)
    y = client.activation(x, mode).result(30)
    np.testing.assert_allclose(y, fn(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("log", [False, True])
def test_softmax(client, log):
    x = rng.standard_normal((4, 10)).astype(np.float32)
    y = client.softmax(x, log=log).result(30)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    ref = e / e.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, np.log(ref) if log else ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_pool2d(client, mode):
    x = rng.standard_normal((1, 2, 6, 6)).astype(np.float32)
    y = client.pool2d(x, 2, mode=mode).result(30)
    blocks = x.reshape(1, 2, 3, 2, 3, 2)
    ref = blocks.max(axis=(3, 5)) if mode == "max" else blocks.mean(axis=(3, 5))
    assert y.shape == (1, 2, 3, 3)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)


def test_batchnorm(client):
    x = rng.standard_normal((2, 3, 4, 4)).astype(np.float32)
    scale, bias, mean = (rng.standard_normal(3).astype(np.float32) for _ in range(3))
    var = rng.random(3).astype(np.float32) + 0.5
    y = client.batchnorm(x, scale, bias, mean, var, eps=1e-3).result(30)
    sh = (1, 3, 1, 1)
    ref = scale.reshape(sh) * (x - mean.reshape(sh)) / np.sqrt(var.reshape(sh) + 1e-3) + \
        bias.reshape(sh)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_gemm(client):
    a = rng.standard_normal((5, 3)).astype(np.float32)
    b = rng.standard_normal((4, 3)).astype(np.float32)
    c = rng.standard_normal((5, 4)).astype(np.float32)
    y = client.gemm(a, b, c, trans_b=True, alpha=2.0, beta=0.5).result(30)
    np.testing.assert_allclose(y, 2 * a @ b.T + 0.5 * c, rtol=1e-4, atol=1e-5)


def test_tensor_out_array_reused(client):
    a = client.array(rng.standard_normal((8, 8)).astype(np.float32))
    out = client.empty((8, 8), np.float32)
    for _ in range(3):
        assert client.gemm(a, a, out=out).result(30) is out
    np.testing.assert_allclose(out, a @ a, rtol=1e-4, atol=1e-5)


def test_module_level_default_client(default_env):
    assert gpuq.submit("noop").result(10) == 0
    x = gpuq.array(np.ones(4, np.float32))
    out = gpuq.zeros(4)
    gpuq.submit("echo", x, out=out).result(10)
    assert out.tolist() == [1, 1, 1, 1]
    assert gpuq.default_client() is gpuq.default_client()


def test_status_is_a_dict(client, daemon):
    s = client.status()
    assert s["pools"][0]["name"] == "cpu" and len(s["pools"][0]["workers"]) == 2
    assert gpuq.status(daemon.runtime_dir)["pid"] == s["pid"]
    assert client.pools[0]["name"] == "cpu" and "echo" in client.ops
