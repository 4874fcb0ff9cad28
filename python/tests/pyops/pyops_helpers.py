"""Plain functions for gpuq.Executor tests: pickled by reference (as loky and
ProcessPoolExecutor pickle a module's functions), so the workers import this module from the
pool's python.path."""


def scale(a, k):
    return a * k


def ends(a):
    """The first and last element, as Python numbers (a small answer)."""
    return (int(a[0]), int(a[-1]))


def nap(seconds):
    import time
    time.sleep(seconds)
    return seconds


_flag = None


def set_flag(value):
    global _flag
    _flag = value


def get_flag():
    return _flag


def fail():
    raise ValueError("error in initializer")


class Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle Unpicklable")


def put(d, key, value):
    d[key] = value


def touch_after(path, seconds):
    import time
    time.sleep(seconds)
    open(path, "w").close()


def divide(a, b):
    return a // b


def nested_sum(n):
    """Runs Parallel(backend="gpuq") inside a gpuq worker: it runs in this worker."""
    import joblib
    return sum(joblib.Parallel(n_jobs=2, backend="gpuq")(joblib.delayed(int)(i)
                                                          for i in range(n)))


def ones(n):
    import numpy as np
    return np.ones(n)


def nested_executor(n):
    """gpuq.Executor inside a gpuq worker, on its own pool: the tasks run in this worker."""
    import os
    import gpuq
    with gpuq.Executor() as ex:
        pids = {ex.submit(os.getpid).result() for _ in range(n)}
        return pids == {os.getpid()}, sum(ex.map(abs, range(-n, 0)))


class Tracked:
    """Counts its live instances in this process (the worker's, once unpickled there)."""

    live = 0

    def __init__(self):
        self.payload = bytes(1 << 20)
        Tracked.live += 1

    def __setstate__(self, state):
        self.__dict__.update(state)
        Tracked.live += 1

    def __del__(self):
        Tracked.live -= 1


def with_tracked(tracked, x):
    return x


def tracked_live():
    import gc
    gc.collect()
    return Tracked.live


def span(seconds):
    """(start, end) on the machine's monotonic clock (CLOCK_MONOTONIC: the same in every
    process) of a sleep of ``seconds``."""
    import time
    start = time.monotonic()
    time.sleep(seconds)
    return start, time.monotonic()
