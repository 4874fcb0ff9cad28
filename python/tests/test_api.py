"""The package's public surface: docstrings, stubs, names."""

from __future__ import annotations

import inspect
import pathlib

import gpuq
import gpuq.testing


def public_members(obj):
    for name, member in inspect.getmembers(obj):
        if name.startswith("_"):
            continue
        if inspect.isclass(obj) and name not in vars(obj):
            continue  # inherited (e.g. from concurrent.futures.Future, documented there)
        yield name, member


def test_every_public_name_has_a_docstring():
    missing = []
    for name in gpuq.__all__:
        obj = getattr(gpuq, name)
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if inspect.isclass(obj) and obj.__module__.startswith("gpuq"):
            for m, member in public_members(obj):
                doc = getattr(member, "__doc__", None) or (
                    member.fget.__doc__ if isinstance(member, property) else None)
                if callable(member) or isinstance(member, property):
                    if not (doc or "").strip():
                        missing.append(f"{name}.{m}")
    for name in gpuq.testing.__all__:
        if not (getattr(gpuq.testing, name).__doc__ or "").strip():
            missing.append(f"testing.{name}")
    assert not missing, f"no docstring: {missing}"


def test_typing_files_are_installed():
    here = pathlib.Path(gpuq.__file__).parent
    assert (here / "py.typed").exists()
    stub = (here / "_native.pyi").read_text()
    assert "class Connection" in stub and "def submit" in stub


def test_version():
    assert gpuq.__version__.count(".") == 2
