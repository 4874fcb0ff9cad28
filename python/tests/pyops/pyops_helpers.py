"""Plain functions for gpuq.Executor tests: pickled by reference (as loky and
ProcessPoolExecutor pickle a module's functions), so the workers import this module from the
pool's python.path."""


def scale(a, k):
    return a * k


def ends(a):
    """The first and last element, as Python numbers (a small answer)."""
    return (int(a[0]), int(a[-1]))
