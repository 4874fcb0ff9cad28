"""``gpuq serve``: a daemon with one Python pool, from the command line (docs/python.md, "gpuq serve").

    python -m gpuq serve app.ops                 # app/ops.py's @gpuq.op functions, every GPU
    gpuq serve app.ops --gpus 0,1 --workers 2    # two workers on each of GPUs 0 and 1
    gpuq serve app.ops --gpus none               # on the CPUs: one worker per CPU
    gpuq serve app.ops --print-config            # the equivalent gpuqd config, as JSON

The pool runs this interpreter (``sys.executable``) with its modules, so what ``pip install``
put in this environment is what the workers import. The command starts ``gpuqd`` (this
install's, else ``$GPUQ_GPUQD``, else the one on ``PATH``: :func:`gpuq.daemon.find_gpuqd`)
with that config, waits until every worker is ready, prints where it listens and the pool's
ops, and stays in the foreground. Ctrl-C (or SIGTERM) drains: queued and running jobs finish,
then gpuqd exits and so does this command, with gpuqd's exit status. The daemon never
outlives the command (it is sent SIGTERM if this process dies).

Everything here is the command line's: the configuration itself is gpuqd's (docs/config.md),
and ``--print-config`` shows it, to start from when a service needs more (a second pool, a
systemd unit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from . import _errors, _native, daemon

__all__ = ["ServeOptions", "parse_args", "pool_config", "main"]

_POOL_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")
_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What ``gpuq serve`` was asked for, checked (:func:`parse_args`)."""

    modules: List[str]
    gpus: Any = "auto"  # "auto", "all", "none" or a list of indexes and UUIDs
    workers: Optional[int] = None  # per GPU on a gpu pool, in all on a cpu pool
    spares: int = 0
    path: List[str] = dataclasses.field(default_factory=list)  # absolute, in order
    runtime_dir: Optional[str] = None
    allow_callables: bool = False
    pool: str = "default"
    print_config: bool = False
    start_timeout: float = 600.0


def _machine_has_nvidia_gpu() -> bool:
    """Whether the NVIDIA driver lists a GPU (what ``--gpus auto`` decides by; gpuqd itself
    finds the GPUs with NVML when it starts, docs/design/gpu_discovery.md)."""
    try:
        return bool(os.listdir(_NVIDIA_GPUS))
    except OSError:
        return False


def _parse_gpus(text: str) -> Any:
    t = text.strip()
    if t in ("auto", "all", "none"):
        return t
    items = [s.strip() for s in t.split(",")]
    if not t or any(not s for s in items):
        raise ValueError(
            f"--gpus {text!r}: give all, none, auto, or a comma-separated list of "
            "GPU indexes and UUIDs (0,1 or GPU-0b7e...)"
        )
    out: List[Any] = []
    for s in items:
        if s.isdigit():
            out.append(int(s))
        elif s.startswith(("GPU-", "MIG-")):
            out.append(s)
        else:
            raise ValueError(
                f"--gpus {text!r}: {s!r} is neither a GPU index (0, 1, ...) nor a "
                "UUID as nvidia-smi -L prints it (GPU-...)"
            )
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpuq serve",
        description="Start gpuqd with one Python pool running MODULE's @gpuq.op functions in "
        "this Python, and stay in the foreground (Ctrl-C drains and stops it).",
    )
    p.add_argument(
        "modules",
        nargs="*",
        metavar="MODULE",
        help="modules to import in each worker, in order (app.ops); the current "
        "directory is on their path",
    )
    p.add_argument(
        "--gpus",
        default="auto",
        help="auto (every GPU if the machine has an NVIDIA GPU, else the CPUs; the "
        "default), all, none (the CPUs), or a list: 0,1 or GPU UUIDs",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers on each GPU (default 1), or on the CPUs in all (default: one "
        "per CPU this process may run on)",
    )
    p.add_argument(
        "--spares",
        type=int,
        default=0,
        help="ready spare workers that take a dead worker's place at once (0-64)",
    )
    p.add_argument(
        "--path",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory put in front of the modules' path (repeatable); the "
        "current directory always is",
    )
    p.add_argument(
        "--runtime-dir",
        default=None,
        metavar="DIR",
        help="where gpuqd listens; default: where gpuq.connect() looks first "
        "($XDG_RUNTIME_DIR/gpuq, else /tmp/gpuq-$UID)",
    )
    p.add_argument(
        "--allow-callables",
        action="store_true",
        help="also run clients' pickled callables (gpuq.Executor, joblib's gpuq "
        "backend): code a client sends runs as this user",
    )
    p.add_argument("--pool", default="default", help="the pool's name (default: default)")
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the equivalent gpuqd config (JSON) and exit",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="longest wait for the workers to be ready (default 600)",
    )
    return p


def parse_args(argv: Sequence[str]) -> ServeOptions:
    """The options of ``argv`` (the words after ``serve``); exits with status 2 and a message
    naming what is wrong, as argparse does."""
    parser = _parser()
    a = parser.parse_args(list(argv))
    try:
        gpus = _parse_gpus(a.gpus)
    except ValueError as e:
        parser.error(str(e))
    if not a.modules and not a.allow_callables:
        parser.error(
            "name at least one module with @gpuq.op functions (gpuq serve app.ops), or "
            "pass --allow-callables for a pool that runs clients' callables only"
        )
    for m in a.modules:
        if not all(part.isidentifier() for part in m.split(".")):
            parser.error(
                f"{m!r} is not a module name (a dotted name, like app.ops; not a file path)"
            )
    if a.workers is not None and not 1 <= a.workers <= (64 if gpus != "none" else 1024):
        parser.error(f"--workers {a.workers}: give 1 to 64 per GPU, or 1 to 1024 on the CPUs")
    if not 0 <= a.spares <= 64:
        parser.error(f"--spares {a.spares}: give 0 to 64")
    if not a.pool or len(a.pool) > 31 or not set(a.pool) <= _POOL_NAME_CHARS:
        parser.error(f"--pool {a.pool!r}: 1 to 31 characters of a-z, 0-9, _ and -")
    if a.start_timeout <= 0:
        parser.error("--start-timeout: give a number of seconds above 0")
    path = [os.path.abspath(d) for d in a.path]
    for d in path:
        if not os.path.isdir(d):
            parser.error(f"--path {d}: not a directory")
    cwd = os.getcwd()
    if cwd not in path:
        path.append(cwd)
    runtime_dir = os.path.abspath(a.runtime_dir) if a.runtime_dir else None
    return ServeOptions(
        modules=list(a.modules),
        gpus=gpus,
        workers=a.workers,
        spares=a.spares,
        path=path,
        runtime_dir=runtime_dir,
        allow_callables=a.allow_callables,
        pool=a.pool,
        print_config=a.print_config,
        start_timeout=a.start_timeout,
    )


def pool_config(o: ServeOptions) -> Dict[str, Any]:
    """The gpuqd config (docs/config.md) of ``o``: one pool, this interpreter."""
    gpus = o.gpus
    if gpus == "auto":
        gpus = "all" if _machine_has_nvidia_gpu() else "none"
    python: Dict[str, Any] = {
        "interpreter": sys.executable,
        "modules": list(o.modules),
        "path": list(o.path),
    }
    if o.allow_callables:
        python["allow_callables"] = True
    pool: Dict[str, Any] = {"name": o.pool}
    if gpus == "none":
        pool["kind"] = "cpu"
        if o.workers is not None:
            pool["workers"] = o.workers
    else:
        pool.update({"kind": "gpu", "gpus": gpus, "workers_per_gpu": o.workers or 1})
    if o.spares:
        pool["spare_workers"] = o.spares
    pool["python"] = python
    return {"pools": [pool]}


def _die_with_parent() -> None:
    """In the gpuqd child before exec: SIGTERM (drain) when this command's process dies."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pool(doc: Dict[str, Any], name: str) -> Dict[str, Any]:
    return next((p for p in doc.get("pools", []) if p.get("name") == name), {})


def _summary(doc: Dict[str, Any], o: ServeOptions, runtime_dir: str) -> str:
    """What the command prints once the pool serves: where, which ops, how to stop."""
    pool = _pool(doc, o.pool)
    ops = [op for op in pool.get("python", {}).get("ops", []) if op != _native.CALL_OP]
    if pool.get("kind") == "gpu":
        gpus = [g.get("index", "?") for g in pool.get("gpus", [])]
        where = f"on GPU{'s' if len(gpus) != 1 else ''} {', '.join(str(g) for g in gpus)}"
    else:
        where = "on the CPUs"
    spares = f" and {pool.get('spares_ready')} spares" if pool.get("spares_total") else ""
    connect = (
        "gpuq.connect()"
        if o.runtime_dir is None
        else f"gpuq.connect({runtime_dir!r}) or GPUQ_RUNTIME_DIR={runtime_dir}"
    )
    return "\n".join(
        [
            f"gpuq serve: pool {o.pool}: {pool.get('workers_ready')} of {pool.get('workers_total')} "
            f"workers ready{spares} {where}",
            f"gpuq serve: ops: {', '.join(ops) if ops else '(none)'}"
            + (", and clients' callables (gpuq.Executor, joblib)" if o.allow_callables else ""),
            f"gpuq serve: listening in {runtime_dir}; clients connect with {connect}",
            "gpuq serve: Ctrl-C drains (queued and running jobs finish) and stops",
        ]
    )


def _unserved(doc: Dict[str, Any], name: str) -> Optional[str]:
    """Why the pool cannot serve (unavailable, or failing its jobs: no worker could start for
    pool_down_fail_ms), with the workers' start errors; None while it serves or starts."""
    pool = _pool(doc, name)
    if pool.get("status") == "unavailable":
        why = f"pool {name} is unavailable: {pool.get('reason', '')}"
    elif pool.get("failing_jobs"):
        why = f"pool {name} cannot start a worker: {pool.get('failing_jobs_error', '')}"
    else:
        return None
    errors = [w["start_error"] for w in pool.get("workers", []) if w.get("start_error")]
    detail = pool.get("start_error") or (errors[0] if errors else "")
    return why + (f"\n{detail.rstrip()}" if detail else "")


def serve(o: ServeOptions) -> int:
    """Runs gpuqd for ``o`` until it exits; its exit status (1 when the pool cannot serve)."""
    config = pool_config(o)
    gpuqd = daemon.find_gpuqd()
    runtime_dir = _native.daemon_runtime_dir(o.runtime_dir or "")
    tmp = tempfile.mkdtemp(prefix="gpuq-serve.")
    config_path = os.path.join(tmp, "gpuqd.json")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2)
    proc = subprocess.Popen(
        [gpuqd, "--config", config_path, "--runtime-dir", runtime_dir],
        env=daemon.daemon_environ(),
        preexec_fn=_die_with_parent,
    )
    stopping: List[int] = []

    def forward(signo: int, _frame: Any) -> None:
        if not stopping:
            print(
                "gpuq serve: draining (queued and running jobs finish; drain_timeout_ms bounds it)",
                file=sys.stderr,
                flush=True,
            )
        stopping.append(signo)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = time.monotonic() + o.start_timeout
        while not stopping and proc.poll() is None:
            try:
                doc = json.loads(_native.status_json(runtime_dir))
            except _errors.Error:
                doc = None
            if doc is not None:
                why = _unserved(doc, o.pool)
                if why is not None:
                    print(f"gpuq serve: {why}", file=sys.stderr, flush=True)
                    forward(signal.SIGTERM, None)
                    proc.wait()
                    return 1
                if doc.get("ready"):
                    print(_summary(doc, o, runtime_dir), flush=True)
                    break
            if time.monotonic() > deadline:
                print(
                    f"gpuq serve: the workers were not ready within {o.start_timeout:g} s "
                    "(--start-timeout); stopping",
                    file=sys.stderr,
                    flush=True,
                )
                forward(signal.SIGTERM, None)
                proc.wait()
                return 1
            time.sleep(0.05)
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        try:
            os.unlink(config_path)
            os.rmdir(tmp)
        except OSError:
            pass


def main(argv: Sequence[str]) -> int:
    o = parse_args(argv)
    if o.print_config:
        json.dump(pool_config(o), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    try:
        return serve(o)
    except FileNotFoundError as e:
        print(f"gpuq serve: {e}", file=sys.stderr)
        return 127
