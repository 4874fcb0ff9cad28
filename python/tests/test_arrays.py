"""Arrays in the client's segment against copied ones, their lifetime, and bad arrays."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import gpuq


def test_segment_arrays_are_zero_copy(client):
    x = client.zeros((4, 4), np.float32)
    assert client.in_segment(x) and x.dtype == np.float32 and x.shape == (4, 4)
    assert client.in_segment(x[1:])  # a view of it is in the segment too
    assert not client.in_segment(np.zeros(4))
    out = client.empty_like(x)
    x[:] = 3
    client.submit("echo", x, out=out).result(10)
    assert (out == 3).all()
    # The worker wrote the caller's array in place: the same memory, no copy back.
    x[:] = 5
    client.submit("echo", x, out=out).result(10)
    assert (out == 5).all()


def test_plain_numpy_input_is_copied_in(client):
    x = np.arange(16, dtype=np.int32)
    out = client.empty_like(x)
    f = client.submit("echo", x, out=out)
    x[:] = -1  # the job got a copy made at submit time
    f.result(10)
    np.testing.assert_array_equal(out, np.arange(16, dtype=np.int32))


def test_memory_returns_when_last_reference_goes(client):
    seg = client.segment_bytes
    chunk = seg // 4
    for _ in range(20):  # 5 segments' worth, one quarter at a time
        a = client.empty(chunk, np.uint8)
        view = a[10:20]
        del a
        view[:] = 1  # the view keeps the block alive
        del view
    arrays = [client.empty(chunk, np.uint8) for _ in range(3)]
    with pytest.raises(gpuq.OutOfMemory):
        client.empty(seg, np.uint8)
    del arrays


def test_job_keeps_its_arrays_alive(client):
    n = client.segment_bytes // 4
    x = client.array(np.full(n, 7, np.uint8))
    x_address = x.__array_interface__["data"][0]
    out = client.empty(n, np.uint8)
    f = client.submit("echo", x, out=out)
    del x  # the future holds the input until the job has ended
    gc.collect()
    # Were its memory free, the allocator would hand it out again here (first fit).
    filler = client.empty(n, np.uint8)
    assert filler.__array_interface__["data"][0] != x_address
    assert f.result(30) is out
    assert (out == 7).all()
    del f, filler
    # Once the job has ended and every reference is gone, the memory is free again.
    again = client.empty(n, np.uint8)
    assert again.__array_interface__["data"][0] == x_address


def test_out_must_be_in_segment(client):
    with pytest.raises(gpuq.InvalidArgument, match="out: the array is not in this client's"):
        client.submit("echo", b"abc", out=np.zeros(3, np.uint8))
    with pytest.raises(ValueError, match="out"):  # InvalidArgument is a ValueError
        client.gemm(np.ones((2, 2), np.float32), np.ones((2, 2), np.float32),
                    out=np.zeros((2, 2), np.float32))


def test_foreign_array(client, daemon):
    with gpuq.connect(daemon.runtime_dir, name="other") as other:
        foreign = other.array(np.arange(8, dtype=np.float32))
        assert not client.in_segment(foreign)
        # As an input it is copied in like any numpy array ...
        out = client.empty(8, np.float32)
        client.submit("echo", foreign, out=out).result(10)
        np.testing.assert_array_equal(out, foreign)
        # ... but it cannot be written by this client's jobs.
        with pytest.raises(gpuq.InvalidArgument, match="not in this client's segment"):
            client.submit("echo", b"x" * 32, out=foreign)


def test_non_contiguous_input(client):
    x = client.zeros((8, 8), np.float32)
    with pytest.raises(ValueError, match="input: the array is not C-contiguous"):
        client.submit("echo", x[:, ::2], out=client.empty(32, np.float32))
    with pytest.raises(ValueError, match="gemm: a: the array is not C-contiguous"):
        client.gemm(x.T[:, ::2], x)


def test_wrong_dtype(client):
    with pytest.raises(ValueError, match="conv2d: x: dtype is float64"):
        client.conv2d(np.zeros((1, 1, 3, 3)), np.zeros((1, 1, 1, 1)))
    with pytest.raises(ValueError, match="gemm: b: dtype is float64, must be float32"):
        client.gemm(np.zeros((2, 2), np.float32), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="out: dtype"):
        client.activation(np.zeros(4, np.float32), out=client.empty(4, np.float16))


def test_wrong_shape(client):
    x = np.zeros((1, 3, 8, 8), np.float32)
    w = np.zeros((4, 2, 3, 3), np.float32)
    with pytest.raises(gpuq.InvalidArgument, match="conv2d: w"):
        client.conv2d(x, w)
    with pytest.raises(gpuq.InvalidArgument, match="gemm"):
        client.gemm(np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32))
    with pytest.raises(gpuq.InvalidArgument, match="out: shape"):
        client.softmax(np.zeros((2, 3), np.float32), out=client.empty((3, 2)))


def test_bad_shape_and_dtype_for_empty(client):
    with pytest.raises(ValueError, match="shape"):
        client.empty((-1, 2))
    with pytest.raises(ValueError, match="dtype"):
        client.empty(3, object)


def test_closed_client(daemon):
    c = gpuq.connect(daemon.runtime_dir)
    x = c.array(np.arange(4, dtype=np.float32))
    c.close()
    assert c.closed
    with pytest.raises(gpuq.ClientClosed):
        c.submit("noop")
    with pytest.raises(gpuq.ClientClosed):
        c.empty(4)
    # Arrays made before the close stay readable.
    assert x.tolist() == [0, 1, 2, 3]
    c.close()  # twice is fine


def wait_idle(daemon, timeout=30.0):
    import time

    deadline = time.monotonic() + timeout
    while any(w["busy"] for p in daemon.status()["pools"] for w in p["workers"]):
        assert time.monotonic() < deadline, "the workers stayed busy"
        time.sleep(0.01)


def test_dropped_future_keeps_arrays_until_its_job_ends(client, daemon):
    rng = np.random.default_rng(0)
    x = client.array(rng.standard_normal((1, 32, 128, 128), dtype=np.float32))
    w = client.array(rng.standard_normal((32, 32, 3, 3), dtype=np.float32))
    fut = client.conv2d(x, w, padding=1)  # its result y is held by the future alone
    y_address = fut._keep[-1].__array_interface__["data"][0]
    del fut  # the job runs on; y must not be handed out again before it ends
    z = client.zeros((1, 32, 128, 128))
    assert z.__array_interface__["data"][0] != y_address
    wait_idle(daemon)
    assert np.count_nonzero(z) == 0


def test_f16_on_a_cpu_pool_is_refused_before_submit(client):
    x = np.zeros((2, 2), np.float16)
    with pytest.raises(gpuq.InvalidArgument, match="f16 is not supported on cpu pools"):
        client.gemm(x, x)
