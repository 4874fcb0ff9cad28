"""CPython's own concurrent.futures tests (``test/test_concurrent_futures.py`` of this
interpreter, Debian's libpython3.11-testsuite) on :class:`gpuq.Executor` (run.py).

The file builds each test class from an executor mixin and a test base
(``create_executor_tests``); here the mixin is gpuq's and the bases are the ones that test an
executor through its public API: the executor-neutral ones (shutdown, wait, as_completed,
initializers) and the process pool's (``ProcessPoolExecutorTest``, ``ExecutorDeadlockTest``:
tasks in other processes, crashes, pickling). ``ProcessPoolShutdownTest``'s own tests make a
``ProcessPoolExecutor`` themselves, so its executor-neutral base ``ExecutorShutdownTest`` stands
in for it. Tests that cannot apply to gpuq are listed in differences.txt with their reasons.
"""

from __future__ import annotations

import multiprocessing

import pytest

import gpuq

try:
    import test.test_concurrent_futures as cf
except ImportError as e:  # pragma: no cover - a set-up fault, said plainly
    raise ImportError(
        f"CPython's test suite is not installed for this interpreter ({e}): on Debian "
        "apt-get install libpython3.11-testsuite (scripts/setup.sh does)") from None

if not hasattr(cf, "create_executor_tests"):  # pragma: no cover
    pytest.exit("test.test_concurrent_futures of this CPython is not 3.11's single file; "
                "tests/compat/test_cpython_futures.py needs porting", returncode=2)


class GpuqMixin(cf.ExecutorMixin):
    """Executors of ``worker_count`` workers (``max_workers``) on the compat pool of
    gpuq_compat.py. No ``ctx``: the tests that would pass multiprocessing objects to a child
    take their thread-pool path; ``get_context`` serves the tests that ask for one anyway."""

    executor_type = gpuq.Executor

    def get_context(self):  # type: ignore[no-untyped-def]
        return multiprocessing.get_context("spawn")


def _strip(name: str) -> str:
    if name.endswith(("Mixin", "Tests")):
        return name[:-5]
    return name[:-4] if name.endswith("Test") else name


for _base in (cf.InitializerMixin, cf.FailingInitializerMixin, cf.ExecutorShutdownTest,
              cf.WaitTests, cf.AsCompletedTests, cf.ProcessPoolExecutorTest,
              cf.ExecutorDeadlockTest):
    _name = f"Gpuq{_strip(_base.__name__)}Test"
    globals()[_name] = type(_name, (_base, GpuqMixin, cf.BaseTestCase), {})
del _base, _name
