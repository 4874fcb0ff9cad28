"""gpuq.Executor's cache of its callables' pickles (gpuq/_pickles.py): a pickle is reused only
while pickling the function anew would give the same bytes. In this process, no daemon."""

from __future__ import annotations

import functools
import os.path

import cloudpickle
import numpy as np

from gpuq._pickles import FunctionPickles

SCALE = 2
TABLE = [1, 2, 3]


def by_scale(x):
    return x * SCALE


def by_table(x):
    return TABLE[x]


def helper_then_scale(x):
    return by_scale(x) + 1


def countdown(n):
    return 0 if n == 0 else countdown(n - 1)


def made(pickles, fn, times=3):
    before = pickles.made
    blobs = {pickles.get(fn) for _ in range(times)}
    return pickles.made - before, blobs


def test_by_reference_functions_are_pickled_once():
    p = FunctionPickles(cloudpickle.dumps)
    assert made(p, os.path.join)[0] == 1
    assert made(p, abs)[0] == 1
    assert made(p, np.add.reduce)[0] == 3  # a bound method of a ufunc: pickled each time


def test_a_function_its_module_no_longer_names_is_pickled_by_value():
    p = FunctionPickles(cloudpickle.dumps)
    original = by_scale
    assert made(p, original)[0] == 1
    globals()["by_scale"] = lambda x: x  # monkeypatched: the old object is pickled by value now
    try:
        n, blobs = made(p, original)
        assert n >= 1 and cloudpickle.loads(blobs.pop())(3) == 6
    finally:
        globals()["by_scale"] = original


def test_a_rebound_global_makes_a_new_pickle():
    global SCALE
    p = FunctionPickles(cloudpickle.dumps)
    fn = by_scale
    fn.__module__  # noqa: B018 - this module is importable: pickled by reference
    # Pickled by value, as a function of __main__ is (what this test is about).
    fn_by_value = _by_value(by_scale)
    n, blobs = made(p, fn_by_value)
    assert n == 1 and len(blobs) == 1
    assert cloudpickle.loads(blobs.pop())(3) == 6
    SCALE = 5
    try:
        n, blobs = made(p, fn_by_value)
        assert n == 1
        assert cloudpickle.loads(blobs.pop())(3) == 15
    finally:
        SCALE = 2


def test_a_function_naming_a_mutable_global_is_pickled_every_time():
    p = FunctionPickles(cloudpickle.dumps)
    fn = _by_value(by_table)
    assert made(p, fn)[0] == 3
    TABLE.append(4)
    try:
        assert cloudpickle.loads(p.get(fn))(3) == 4
    finally:
        TABLE.pop()


def test_helpers_it_calls_are_checked_too():
    global SCALE
    p = FunctionPickles(cloudpickle.dumps)
    g = _by_value(helper_then_scale)
    assert made(p, g)[0] == 1
    SCALE = 10
    try:
        assert cloudpickle.loads(p.get(g))(1) == 11
    finally:
        SCALE = 2


def test_recursive_and_closure_functions():
    p = FunctionPickles(cloudpickle.dumps)
    assert made(p, _by_value(countdown))[0] == 1

    k = 3

    def add_k(x):
        return x + k

    assert made(p, add_k)[0] == 1
    k = 4  # the closure's cell now holds another object
    assert cloudpickle.loads(p.get(add_k))(1) == 5

    box = []

    def uses_box():
        return len(box)

    assert made(p, uses_box)[0] == 3  # a list: may change in place


def test_defaults_attributes_and_lambdas():
    p = FunctionPickles(cloudpickle.dumps)

    def f(x, y=(1, 2)):
        return x

    assert made(p, f)[0] == 1
    f.__defaults__ = ((3, 4),)
    assert made(p, f)[0] == 1
    f.tag = "set later"
    assert made(p, f)[0] == 3  # an attribute: pickled with the function, may change
    assert made(p, lambda: 1)[0] == 1
    assert made(p, functools.partial(f, 1))[0] == 3


def _by_value(fn):
    """A copy of a module-level function that cloudpickle pickles by value, as it does the
    functions of a script (__main__)."""
    import types
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__module__ = "__main__"
    copy.__qualname__ = fn.__qualname__
    return copy
