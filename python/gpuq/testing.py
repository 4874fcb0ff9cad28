"""A private gpuq daemon for tests and benchmarks: ``with gpuq.testing.Daemon() as d:``.

Starts ``gpuqd`` (from ``gpuqd=``, else ``$GPUQ_GPUQD``, else the one in this gpuq's wheel,
``gpuq/bin/gpuqd``, else ``gpuqd`` on ``PATH``) in the foreground with a temporary runtime
directory and, when ``config`` is given, that config (a dict, written as JSON), waits until it
answers ``status`` with every worker ready (or refuses this user: PermissionDenied), and stops
it (drain, then SIGKILL after ``stop_timeout``) at the end. ``d.runtime_dir`` is what clients connect to:
``gpuq.connect(d.runtime_dir)``, or ``d.env()`` for child processes (``GPUQ_RUNTIME_DIR``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Dict, List, Optional

from . import _errors, _native, daemon
from .daemon import find_gpuqd

__all__ = ["Daemon", "find_gpuqd"]


class Daemon:
    """A gpuqd process of this test's own (see the module's docstring)."""

    def __init__(
        self,
        config: Optional[Dict[str, Any]] = None,
        gpuqd: Optional[str] = None,
        start_timeout: float = 60.0,
        stop_timeout: float = 30.0,
        wait_ready: bool = True,
    ) -> None:
        self.gpuqd = find_gpuqd(gpuqd)
        # False: start() returns once the daemon answers status, ready or not (a pool whose
        # workers fail to start never is).
        self.wait_ready = wait_ready
        self.config = config
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        # A short path: the socket's must fit in sockaddr_un (108 bytes).
        self.tmp = tempfile.mkdtemp(prefix="gpuq-py.", dir="/tmp")
        self.runtime_dir = os.path.join(self.tmp, "run")
        self.log_path = os.path.join(self.tmp, "gpuqd.log")
        self.proc: Optional[subprocess.Popen] = None

    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment whose clients reach this daemon (``GPUQ_RUNTIME_DIR``)."""
        e = dict(os.environ if base is None else base)
        e["GPUQ_RUNTIME_DIR"] = self.runtime_dir
        return e

    def start(self) -> "Daemon":
        args = [self.gpuqd, "--runtime-dir", self.runtime_dir]
        if self.config is not None:
            path = os.path.join(self.tmp, "gpuqd.json")
            with open(path, "w") as f:
                json.dump(self.config, f)
            args += ["--config", path]
        log = open(self.log_path, "wb")
        # As the gpuqd command starts it: this interpreter first on PATH, the default of a
        # Python pool's "interpreter" (gpuq.daemon).
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=daemon.daemon_environ()
        )
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gpuqd exited with status {self.proc.returncode} before it "
                    f"answered; its log:\n{self.log()}"
                )
            try:
                doc = json.loads(_native.status_json(self.runtime_dir))
                # Every worker up (a gpu pool without a GPU stays "unavailable").
                if not self.wait_ready or (
                    doc.get("ready")
                    and all(
                        p.get("status") in ("ready", "unavailable") for p in doc.get("pools", [])
                    )
                ):
                    return self
            except _errors.PermissionDenied:
                return self  # it answers, but not to this user (its config says so)
            except _errors.Error:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"gpuqd did not become ready within {self.start_timeout} s; "
                    f"its log:\n{self.log()}"
                )
            time.sleep(0.02)

    def status(self) -> Dict[str, Any]:
        return json.loads(_native.status_json(self.runtime_dir))

    def reload(self, config: Dict[str, Any], timeout: Optional[float] = 300.0) -> List[str]:
        """Writes ``config`` over this daemon's config file and has it read again
        (:func:`gpuq.reload_config`, docs/service.md "Config reload"); its lines."""
        if self.config is None:
            raise RuntimeError("this Daemon was started without a config: there is no file")
        path = os.path.join(self.tmp, "gpuqd.json")
        with open(path + ".tmp", "w") as f:
            json.dump(config, f)
        os.replace(path + ".tmp", path)
        self.config = config
        return list(
            _native.reload(self.runtime_dir, 0 if timeout is None else max(1, int(timeout)))
        )

    def log(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stop(self) -> Optional[int]:
        """Stops the daemon (SIGTERM: drain; SIGKILL after stop_timeout); its exit status."""
        p, self.proc = self.proc, None
        rc = None
        if p is not None:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(self.stop_timeout)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            rc = p.returncode
        return rc

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)
