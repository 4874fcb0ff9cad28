"""The daemon that comes with the gpuq wheel: ``python -m gpuq.daemon`` (or ``gpuqd``).

The wheel built by ``scripts/build_wheel.sh`` holds ``gpuqd``, its CPU worker ``gpuq-worker``
and ``gpuqctl`` in ``gpuq/bin/`` (gpuqd runs the worker next to its own executable, and the
``gpuq-gpu`` wheel, ``pip install gpuq[gpu]``, adds ``gpuq-gpu-worker`` there). The console
entry points ``gpuqd``, ``gpuq-worker`` and ``gpuqctl`` of the wheel are the ``*_main``
functions below: each replaces the Python process with its binary (``os.execv``), passing its
arguments on, so signals (``SIGTERM``: drain) and the exit status are the binary's own.

    gpuqd                          # a per-user daemon with the built-in defaults
    python -m gpuq.daemon --config gpuqd.json
    gpuqctl status

gpuqd is started with this interpreter's ``bin`` folder first on ``PATH``, so that a Python
pool's default interpreter (``python3``, looked up in gpuqd's ``PATH``) is the one of this venv,
where ``gpuq`` is installed. A client-only install (``pip install ./python``) has no
``gpuq/bin/``: the entry points then run the first such binary on ``PATH`` (an installed gpuq
package's, say), skipping scripts like themselves, or say that there is none and exit with
status 127. docs/python.md, "The wheel".
"""

from __future__ import annotations

import os
import sys
from typing import Dict, List, Mapping, NoReturn, Optional

__all__ = [
    "bin_dir",
    "executable",
    "find_binary",
    "find_gpuqd",
    "daemon_environ",
    "gpuqd_main",
    "worker_main",
    "gpuqctl_main",
    "gpu_probe_main",
]


def bin_dir() -> str:
    """The folder of this package's binaries (``gpuq/bin``), present or not."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin")


def executable(name: str) -> Optional[str]:
    """``gpuq/bin/<name>`` when this install has it (the wheel), else None."""
    path = os.path.join(bin_dir(), name)
    return path if os.access(path, os.X_OK) else None


def _is_elf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def find_binary(name: str) -> Optional[str]:
    """``gpuq/bin/<name>`` (the wheel), else the first executable ``<name>`` on ``PATH`` that is
    a binary (the console scripts of this package, Python scripts, are passed over); None when
    there is neither."""
    path = executable(name)
    if path is not None:
        return path
    for d in os.environ.get("PATH", "").split(os.pathsep):
        c = os.path.join(d or ".", name)
        if os.path.isfile(c) and os.access(c, os.X_OK) and _is_elf(c):
            return c
    return None


def find_gpuqd(gpuqd: Optional[str] = None) -> str:
    """The gpuqd binary: ``gpuqd``, else ``$GPUQ_GPUQD``, else this install's own
    (``gpuq/bin/gpuqd``, in the wheel of scripts/build_wheel.sh: the daemon of the same build as
    this client), else ``gpuqd`` on ``PATH``. FileNotFoundError says where it looked."""
    path = gpuqd or os.environ.get("GPUQ_GPUQD") or find_binary("gpuqd")
    if not path or not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"gpuqd not found (given {gpuqd!r}, $GPUQ_GPUQD={os.environ.get('GPUQ_GPUQD')!r}, "
            f"none in {bin_dir()} (a client-only install) and none on PATH); install "
            "the wheel of scripts/build_wheel.sh, or build it (cmake --build build --target "
            "gpuqd gpuq-worker) and set GPUQ_GPUQD=build/daemon/gpuqd"
        )
    return path


def daemon_environ(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """The environment gpuqd is started with: ``base`` (default ``os.environ``) with this
    interpreter's folder first on ``PATH`` (a Python pool's default interpreter)."""
    env = dict(os.environ if base is None else base)
    here = os.path.dirname(sys.executable) if sys.executable else ""
    path = [p for p in env.get("PATH", "").split(os.pathsep) if p]
    if here and (not path or path[0] != here):
        env["PATH"] = os.pathsep.join([here, *path])
    return env


def _exec(name: str, argv: List[str], env: Optional[Dict[str, str]] = None) -> NoReturn:
    path = find_binary(name)
    if path is None:
        sys.stderr.write(
            f"{name}: not in this gpuq install ({bin_dir()} has no {name}: it was built "
            "without the daemon, as `pip install ./python` is) and none on PATH; install the "
            "wheel of scripts/build_wheel.sh, or build gpuq with CMake (README.md)\n"
        )
        sys.stderr.flush()
        os._exit(127)
    sys.stdout.flush()
    sys.stderr.flush()
    if env is None:
        os.execv(path, [path, *argv])
    os.execve(path, [path, *argv], env)


def gpuqd_main(argv: Optional[List[str]] = None) -> NoReturn:
    """``gpuqd``: the supervisor (``gpuqd --help``)."""
    _exec("gpuqd", sys.argv[1:] if argv is None else argv, daemon_environ())


def worker_main(argv: Optional[List[str]] = None) -> NoReturn:
    """``gpuq-worker``: the CPU worker, which gpuqd starts (not meant to be run by hand)."""
    _exec("gpuq-worker", sys.argv[1:] if argv is None else argv)


def gpuqctl_main(argv: Optional[List[str]] = None) -> NoReturn:
    """``gpuqctl``: status, metrics, top, submit, stop (``gpuqctl --help``)."""
    _exec("gpuqctl", sys.argv[1:] if argv is None else argv)


def gpu_probe_main(argv: Optional[List[str]] = None) -> NoReturn:
    """``gpuq-gpu-probe`` (the gpuq-gpu wheel): the GPUs the CUDA runtime sees from here."""
    _exec("gpuq-gpu-probe", sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    gpuqd_main()
