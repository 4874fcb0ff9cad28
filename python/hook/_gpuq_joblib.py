"""joblib's "gpuq" backend, known in every process of an environment where gpuq is installed.

``gpuq_joblib.pth`` (installed beside this module, at the top of site-packages) calls
:func:`install` as the interpreter starts. Once joblib is imported, "gpuq" is among its backends
as "loky" is, also in a process that never imports gpuq itself: a loky worker whose task names
``backend="gpuq"``, a script that only says ``Parallel(backend="gpuq")``. gpuq itself is
imported only when the backend is first used (the factory below), so an interpreter that never
uses it pays for a meta path finder and this small module, nothing more. ``import gpuq``
registers the backend class itself (gpuq._joblib), which then replaces the factory.
"""

import sys

_NAME = "gpuq"


def _backend(*args, **kwargs):
    """joblib's factory for "gpuq": imports gpuq (which registers its backend class), then
    makes the backend with it."""
    import gpuq  # noqa: F401 - registers gpuq._joblib's GpuqBackend
    from joblib.parallel import BACKENDS
    cls = BACKENDS.get(_NAME)
    if cls is None or cls is _backend:
        gpuq.register_joblib()
        cls = BACKENDS[_NAME]
    return cls(*args, **kwargs)


def _register(joblib):
    gpuq = sys.modules.get("gpuq")
    if gpuq is not None and hasattr(gpuq, "register_joblib"):
        gpuq.register_joblib()  # imported already: its class itself
        return
    from joblib.parallel import BACKENDS
    if _NAME not in BACKENDS:
        joblib.register_parallel_backend(_NAME, _backend)


class _Finder:
    """Runs _register right after joblib's own import, then leaves sys.meta_path."""

    def find_spec(self, name, path, target=None):
        if name != "joblib":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _register(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install():
    """Makes "gpuq" a joblib backend as soon as joblib is imported (now, if it is already)."""
    if "joblib" in sys.modules:
        _register(sys.modules["joblib"])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
