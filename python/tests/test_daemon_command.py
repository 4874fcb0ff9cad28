"""gpuq.daemon: the package's commands gpuqd, gpuq-worker and gpuqctl (docs/python.md, "The
wheel"). In the python stage's client-only install (`pip install ./python`) there is no
gpuq/bin/, so they run the binary found on PATH (here the build tree's); the wheel's own
binaries are tested where the wheel is installed, by tests/package/wheel_test.sh (the fresh
stage)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

import gpuq.daemon
import gpuq.testing

SCRIPTS = pathlib.Path(sys.executable).parent  # the venv's bin/, with the console scripts
WHEEL = gpuq.daemon.executable("gpuqd") is not None
client_only = pytest.mark.skipif(WHEEL, reason="this install has gpuq/bin/ (the wheel)")


def run(argv, path, **kw):
    env = dict(os.environ, PATH=os.pathsep.join(str(p) for p in path))
    return subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True,
                          timeout=60, **kw)


def test_daemon_environ_puts_this_interpreter_first():
    env = gpuq.daemon.daemon_environ({"PATH": "/usr/bin:/bin", "X": "1"})
    assert env["PATH"] == os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    assert env["X"] == "1"
    assert gpuq.daemon.daemon_environ(env)["PATH"] == env["PATH"]  # once only


@client_only
def test_find_binary_passes_over_scripts_on_path(tmp_path, monkeypatch):
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    (scripts / "gpuqd").write_text("#!/bin/sh\nexit 3\n")
    (scripts / "gpuqd").chmod(0o755)
    binaries = tmp_path / "binaries"
    binaries.mkdir()
    (binaries / "gpuqd").symlink_to(gpuq.testing.find_gpuqd())

    monkeypatch.setenv("PATH", f"{scripts}{os.pathsep}{binaries}")
    assert gpuq.daemon.find_binary("gpuqd") == str(binaries / "gpuqd")
    monkeypatch.setenv("PATH", str(scripts))
    assert gpuq.daemon.find_binary("gpuqd") is None


def test_gpuqd_command_and_module_run_the_daemon():
    gpuqd_dir = pathlib.Path(gpuq.testing.find_gpuqd()).parent
    command = SCRIPTS / "gpuqd"
    if not command.exists():
        pytest.skip(f"no console script {command} (gpuq not installed by pip)")
    for argv in ([command, "--version"], [sys.executable, "-m", "gpuq.daemon", "--version"]):
        r = run(argv, [SCRIPTS, gpuqd_dir])
        assert r.returncode == 0 and r.stdout.startswith(f"gpuqd {gpuq.__version__}"), r


@client_only
def test_command_without_a_binary_says_so():
    r = run([sys.executable, "-m", "gpuq.daemon", "--version"], [SCRIPTS])
    assert r.returncode == 127, r
    assert "gpuqd: not in this gpuq install" in r.stderr and "none on PATH" in r.stderr, r.stderr
