"""The Python op wire format (python/src/call_codec.hpp) on its own, in this process: calls laid
out as a client lays them out and read back as a worker reads them, answers written and read,
and headers cut short or corrupted, which must fail with ValueError and never read outside
their buffer. The daemon-level tests (a job with a crafted header fails alone) are in
test_python_ops.py."""

from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest

from gpuq import _answers, _native


def round_trip(args, kwargs=None, flags=0):
    """encode_call, then decode_call over the span, as the worker sees it (read-only)."""
    block, start, length, h, n, _, rows = _native.encode_call(args, kwargs, flags, 64)
    span = memoryview(bytes(block[start:start + length]))
    got_flags, got_args, got_kwargs = _native.decode_call(span, h, n, False)
    assert got_flags == flags
    return got_args, got_kwargs, rows


def same(a, b):
    if isinstance(a, np.generic):
        a = np.asarray(a)  # a numpy scalar travels as a 0-d array
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == np.ascontiguousarray(b).tobytes()
        assert not b.flags.writeable  # a view of the job's read-only input
        return
    if isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
        return
    if isinstance(a, tuple):  # JSON has no tuples: they come back as lists
        a = list(a)
    if isinstance(a, (list, dict)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in (zip(a, b) if isinstance(a, list) else
                     ((a[k], b[k]) for k in a)):
            same(x, y)
        return
    assert type(a) is type(b) and a == b, (a, b)


PLAIN = [None, True, False, 0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 63, 10 ** 30, 1.5, -0.0,
         float("inf"), float("nan"), "", "hé ✓", "\ud800", [1, [2, "x"]], {"a": {"b": None}},
         (1, 2)]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_plain_values_round_trip(value):
    args, kwargs, _ = round_trip((value,), {"k": value})
    same(value, args[0])
    same(value, kwargs["k"])


ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(12, dtype=np.float64).reshape(3, 4).T,  # not contiguous: copied as C order
    np.array(3.5, dtype=np.float16),                   # 0-d
    np.zeros((0, 5), dtype=np.int8),                   # empty
    np.array([1 + 2j], dtype=">c16"),                  # big-endian
    np.array([b"ab", b"c"]),
    np.zeros(3, dtype=[("a", "<i4"), ("b", [("x", "<f4"), ("y", "u1", (2,))])]),
    np.float32(2.5),                                   # a numpy scalar travels as a 0-d array
]


@pytest.mark.parametrize("a", ARRAYS, ids=lambda a: f"{a.dtype}{a.shape}")
def test_arrays_round_trip(a):
    args, kwargs, _ = round_trip((a, 1), {"named": a})
    same(np.asarray(a), args[0])
    same(np.asarray(a), kwargs["named"])
    assert args[1] == 1


def test_rows_of_a_call():
    assert round_trip((np.zeros((4, 2)), np.zeros(4)))[2] == 4
    assert round_trip((np.zeros((4, 2)), np.zeros(3)))[2] == 0   # first axes differ
    assert round_trip((np.zeros((4, 2)), np.float32(1)))[2] == 0  # a 0-d one
    assert round_trip((1, "x"))[2] == 0                           # no array


def test_bytes_are_bytes_or_views():
    block, start, length, h, n, _, _ = _native.encode_call((b"xyz", bytearray(b"q")), None, 0, 64)
    span = memoryview(bytes(block[start:start + length]))
    _, args, _ = _native.decode_call(span, h, n, False)
    assert args == [b"xyz", b"q"]
    _, views, _ = _native.decode_call(span, h, n, True)
    assert [type(v) for v in views] == [memoryview, memoryview]
    assert [bytes(v) for v in views] == [b"xyz", b"q"]


def test_values_that_cannot_travel():
    # (gpuq.Client turns these into InvalidArgument before anything is submitted.)
    with pytest.raises(ValueError, match="argument 0: object is neither an array nor JSON-able"):
        _native.encode_call((object(),), None, 0, 64)
    with pytest.raises(ValueError, match="keyword bad: .*Python objects"):
        _native.encode_call((), {"bad": np.array([None, 1], dtype=object)}, 0, 64)


def test_randomised_round_trips():
    rng = random.Random(28)
    dtypes = ["<f4", "<f8", "<i8", "|u1", "|b1", "<f2", "<u4"]
    for _ in range(300):
        args = []
        for _ in range(rng.randrange(0, 6)):
            kind = rng.randrange(3)
            if kind == 0:
                args.append(rng.choice(PLAIN))
            else:
                shape = tuple(rng.randrange(0, 4) for _ in range(rng.randrange(0, 4)))
                args.append((np.random.default_rng(rng.randrange(1 << 30)).random(shape) * 100)
                            .astype(rng.choice(dtypes)))
        kwargs = {f"k{i}": rng.choice(PLAIN) for i in range(rng.randrange(0, 3))}
        got_args, got_kwargs, _ = round_trip(tuple(args), kwargs, flags=rng.randrange(2))
        for a, b in zip(args, got_args):
            same(a, b)
        for k in kwargs:
            same(kwargs[k], got_kwargs[k])


# ---- hostile headers: ValueError, never a read outside the buffer ---------------------------


def header(entries: bytes, positional: int, keywords: int = 0) -> bytes:
    return b"GQC2" + struct.pack("<III", 0, positional, keywords) + entries


def array_entry(dtype: str, shape, offset: int) -> bytes:
    return (b"\x07" + struct.pack("<H", len(dtype)) + dtype.encode() + bytes([len(shape)]) +
            b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<Q", offset))


BAD = {
    "json header": b'{"args": [], "kwargs": {}}',
    "cut magic": b"GQC",
    "counts past the end": header(b"", 5),
    "unknown tag": header(b"\x63", 1),
    "cut int": header(b"\x03\x01\x02", 1),
    "str past the end": header(b"\x05" + struct.pack("<I", 1000) + b"ab", 1),
    "str not UTF-8": header(b"\x05" + struct.pack("<I", 2) + b"\xff\xfe", 1),
    "bad JSON": header(b"\x06" + struct.pack("<I", 5) + b"[1, 2", 1),
    "huge dimensions": header(array_entry("<f8", [1 << 62] * 3, 0), 1),
    "65 dimensions": header(array_entry("<f8", [1] * 65, 0), 1),
    "offset past the buffer": header(array_entry("<f8", [4], 1 << 40), 1),
    "array past the buffer": header(array_entry("<f8", [10 ** 6], 0), 1),
    "object dtype": header(array_entry("|O", [1], 0), 1),
    "not a dtype": header(array_entry("zz", [1], 0), 1),
    "bytes past the buffer": header(b"\x08" + struct.pack("<QQ", 8, 1 << 50), 1),
    "keyword not UTF-8": header(struct.pack("<H", 1) + b"\xff\x00", 0, 1),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_headers_are_value_errors(name):
    hb = BAD[name]
    buf = memoryview(hb + bytes(256))
    with pytest.raises(ValueError):
        _native.decode_call(buf, 0, len(hb), False)


def test_every_cut_and_flip_of_a_header_is_refused_or_read_within_bounds():
    block, start, length, h, n, _, _ = _native.encode_call(
        (np.arange(6, dtype=np.float32).reshape(2, 3), "text", 7, [1, 2]),
        {"flag": True, "x": np.ones(4)}, 0, 64)
    span = bytes(block[start:start + length])
    for cut in range(n):
        with pytest.raises(ValueError):
            _native.decode_call(memoryview(span), h, cut, False)
    rng = random.Random(7)
    for _ in range(2000):
        corrupt = bytearray(span)
        for _ in range(rng.randrange(1, 4)):
            corrupt[h + rng.randrange(n)] = rng.randrange(256)
        try:
            _native.decode_call(memoryview(bytes(corrupt)), h, n, False)
        except (ValueError, TypeError, OverflowError):
            pass


def test_header_outside_the_input():
    with pytest.raises(ValueError, match="lies outside"):
        _native.decode_call(memoryview(bytes(64)), 60, 16, False)


# ---- answers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("result", [
    None, np.arange(10, dtype=np.int16), np.float64(2.5), 7, True, 1.25,
    (np.ones(3), np.float32(1), 4), [np.zeros((2, 2))],
], ids=repr)
def test_results_round_trip(result):
    out = np.zeros(4096, np.uint8)
    n = _native.write_result(memoryview(out), result)
    assert n is not None and 0 < n <= out.nbytes
    got = _native.answer_value(out, n)
    if result is None:
        assert got is None
    elif isinstance(result, np.ndarray):
        np.testing.assert_array_equal(got, result)
        assert got.base is not None  # a view of out, no copy
    elif isinstance(result, (tuple, list)):
        assert isinstance(got, tuple) and len(got) == len(result)
        for a, b in zip(result, got):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    else:
        assert got == result and isinstance(got, np.generic)


def test_results_left_to_python():
    out = memoryview(np.zeros(256, np.uint8))
    for result in ("text", {"a": 1}, [1, "x"], object()):
        assert _native.write_result(out, result) is None


def test_answer_too_large_says_what_it_needs():
    out = np.zeros(128, np.uint8)
    n = _native.write_result(memoryview(out), np.zeros(100, np.float64))
    assert n < 0 and -n >= 800
    with pytest.raises(_answers.ResultTooLarge) as e:
        _answers.write_result(memoryview(out), np.zeros(100, np.float64))
    assert e.value.needed == -n and e.value.capacity == 128


def test_answers_with_extra_json():
    out = np.zeros(4096, np.uint8)
    n = _answers.write_answer(memoryview(out), {"kind": "json", "value": {"x": [1, 2]}}, [])
    assert _native.answer_value(out, n) == {"x": [1, 2]}
    n = _answers.write_error(memoryview(out), "ValueError", "bad", "Traceback...")
    h = _answers.read_answer(out, n)
    assert h["kind"] == "error" and h["error"]["type"] == "ValueError"
    with pytest.raises(ValueError, match="kind error"):
        _native.answer_value(out, n)


def test_malformed_answers():
    out = np.zeros(256, np.uint8)
    n = _native.write_result(memoryview(out), np.arange(4, dtype=np.float32))
    good = out.copy()
    with pytest.raises(ValueError, match="GQR2"):
        _native.answer_value(np.zeros(256, np.uint8), 64)
    for cut in range(n):
        with pytest.raises(ValueError):
            _native.answer_value(good, cut)
    rng = random.Random(3)
    for _ in range(2000):
        bad = good.copy()
        bad[rng.randrange(64)] = rng.randrange(256)
        try:
            _native.answer_value(bad, n)
        except (ValueError, TypeError):
            pass
