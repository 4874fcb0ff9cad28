"""Fixtures: a real gpuqd (GPUQ_GPUQD, default <repo>/build/daemon/gpuqd) per test module, with
two CPU workers, and a client connected to it."""

from __future__ import annotations

import os
import pathlib

import pytest

import gpuq
import gpuq.testing

REPO = pathlib.Path(__file__).resolve().parents[2]
if "GPUQ_GPUQD" not in os.environ:
    os.environ["GPUQ_GPUQD"] = str(REPO / "build" / "daemon" / "gpuqd")

# Two CPU workers (the machine may have only two CPUs: both share them), small rings so that
# backpressure is easy to reach.
CONFIG = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 2}], "queue_factor": 4,
          "max_jobs_per_client": 64, "client_queue_share": 1.0}


@pytest.fixture(scope="module")
def daemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture
def client(daemon):
    with gpuq.connect(daemon.runtime_dir, name="pytest") as c:
        yield c


@pytest.fixture
def default_env(daemon, monkeypatch):
    """The module-level default client points at this test's daemon."""
    monkeypatch.setenv("GPUQ_RUNTIME_DIR", daemon.runtime_dir)
    if gpuq._default is not None:
        gpuq._default.close()
    gpuq._default = None
    yield daemon
    if gpuq._default is not None:
        gpuq._default.close()
    gpuq._default = None
