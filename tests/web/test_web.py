"""The web examples (examples/web, docs/web.md) against a real gpuqd: the Flask app under
gunicorn (--preload, 8 sync workers) and the FastAPI app under uvicorn (8 workers, acall), each
serving 32 concurrent HTTP clients. Every answer is checked against the model computed here,
and every web worker reports, from inside, that it never imported the model or a framework.

Needs GPUQ_GPUQD (or a gpuq wheel with its daemon) and tests/web/requirements.txt; run by
scripts/test.sh's web stage."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

import gpuq
import gpuq.testing

REPO = pathlib.Path(__file__).resolve().parents[2]
WEB = REPO / "examples" / "web"
sys.path.insert(0, str(WEB))
import gpuqd_config  # noqa: E402
import model  # noqa: E402 - the test's own reference; the web workers never import it

WEB_WORKERS = 8
CLIENTS = 32
REQUESTS_PER_CLIENT = int(os.environ.get("GPUQ_WEB_REQUESTS", "25"))
LAYERS = model.make_weights("small")
WIDTH = model.SIZES["small"][0]


@pytest.fixture(scope="module")
def daemon():
    with gpuq.testing.Daemon(gpuqd_config.config("small", workers=2)) as d:
        yield d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(app: str, port: int, workers: int):
    if app == "flask-gunicorn":
        return [sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py",
                "--bind", f"127.0.0.1:{port}", "--workers", str(workers),
                "--log-level", "warning", "flask_app:app"]
    return [sys.executable, "-m", "uvicorn", "--workers", str(workers), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", "--no-access-log", "fastapi_app:app"]


def children(pid: int):
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


class Server:
    def __init__(self, app: str, daemon, tmp_path, workers: int = WEB_WORKERS, **env_vars):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = daemon.env()
        env["WEB_DEBUG"] = "1"
        env.update(env_vars)
        self.log = open(tmp_path / f"{app}.log", "w+")
        self.proc = subprocess.Popen(command(app, self.port, workers), cwd=WEB, env=env,
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            deadline = time.monotonic() + 90
            while True:
                assert self.proc.poll() is None, \
                    f"{app} exited {self.proc.returncode}:\n{self.output()}"
                assert time.monotonic() < deadline, f"{app} never answered:\n{self.output()}"
                try:
                    if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-20000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:  # what is left of its process group (workers of a master that died first)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


APPS = ["flask-gunicorn", "fastapi-uvicorn"]


@pytest.fixture(params=APPS)
def server(request, daemon, tmp_path):
    s = Server(request.param, daemon, tmp_path)
    yield s
    s.stop()


def client_run(url: str, seed: int, errors: list, statuses: dict, lock: threading.Lock):
    rng = np.random.default_rng(seed)
    with httpx.Client(base_url=url, timeout=60) as http:
        for _ in range(REQUESTS_PER_CLIENT):
            x = rng.standard_normal((int(rng.integers(1, 5)), WIDTH), dtype=np.float32)
            r = http.post("/classify", json={"rows": x.tolist()})
            with lock:
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if r.status_code != 200:
                errors.append(f"{r.status_code}: {r.text[:300]}")
                continue
            body = r.json()
            labels, probs = model.forward(LAYERS, x)
            got = np.asarray(body["probs"], np.float32)
            if body["labels"] != labels.tolist() or got.shape != probs.shape or \
                    not np.allclose(got, probs, rtol=1e-4, atol=1e-6):
                errors.append(f"wrong answer for {x.shape[0]} rows: {body['labels']} != "
                              f"{labels.tolist()}")


def reports_of_every_worker(url: str, want: int, timeout: float = 60.0):
    """/debug/imports from each web worker: asked on new connections (each taken by whichever
    worker accepts it) by 32 threads, until `want` distinct workers have answered."""
    reports = {}
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def ask():
        while time.monotonic() < deadline:
            with lock:
                if len(reports) >= want:
                    return
            r = httpx.get(url + "/debug/imports", headers={"Connection": "close"}, timeout=10)
            r.raise_for_status()
            rep = r.json()
            with lock:
                reports[rep["pid"]] = rep

    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
        list(ex.map(lambda _: ask(), range(CLIENTS)))
    return reports


def batch_rows(daemon):
    """(rows, calls) of the batched op so far, from the daemon's metrics."""
    rows = calls = 0.0
    for line in gpuq.metrics(daemon.runtime_dir).splitlines():
        if line.startswith("gpuq_batch_rows_sum{") and 'op="classify"' in line:
            rows += float(line.rsplit(" ", 1)[1])
        elif line.startswith("gpuq_batch_rows_count{") and 'op="classify"' in line:
            calls += float(line.rsplit(" ", 1)[1])
    return rows, calls


def test_32_clients_through_8_web_workers(server, daemon):
    rows0, calls0 = batch_rows(daemon)
    errors: list = []
    statuses: dict = {}
    lock = threading.Lock()
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(CLIENTS) as ex:
        list(ex.map(lambda i: client_run(server.url, i, errors, statuses, lock), range(CLIENTS)))
    took = time.monotonic() - t0
    total = CLIENTS * REQUESTS_PER_CLIENT
    print(f"{total} requests in {took:.2f} s ({total / took:.0f}/s): {statuses}")
    assert not errors, f"{len(errors)} bad answers, e.g. {errors[:3]}\n{server.output()}"
    assert statuses == {200: total}
    rows, calls = batch_rows(daemon)
    print(f"model calls: {calls - calls0:.0f} for {rows - rows0:.0f} rows "
          f"({(rows - rows0) / max(1, calls - calls0):.1f} rows per call)")

    # Each web worker, asked from inside, has imported neither the model nor a framework.
    reports = reports_of_every_worker(server.url, WEB_WORKERS)
    assert len(reports) == WEB_WORKERS, (reports, server.output())
    kids = set(children(server.proc.pid))
    for pid, rep in reports.items():
        assert pid in kids and rep["ppid"] == server.proc.pid, (rep, kids)
        assert rep["model_modules"] == [], rep
    # One gpuq client per web worker (gunicorn's master holds the one made before the fork).
    expected = WEB_WORKERS + (1 if "gunicorn" in server.proc.args else 0)
    assert daemon.status()["clients"] == expected


def test_errors_are_http_answers(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.post("/classify", json={"rows": [[1.0, 2.0]]}).status_code == 400
        assert http.post("/classify", content=b"not json",
                         headers={"Content-Type": "application/json"}).status_code == 400
        assert http.post("/classify", json={"rows": [[0.0] * WIDTH] * 65}).status_code == 400


@pytest.mark.parametrize("app", APPS)
def test_overload_is_503_with_retry_after(app, daemon, tmp_path):
    """With the pool's workers held, a call that does not start within the request's
    WEB_QUEUE_TIMEOUT is turned away with 503 and Retry-After, whether it found room in the
    queue (it expires there, never run) or not (the ring full too)."""
    srv = Server(app, daemon, tmp_path, workers=2, WEB_TIMEOUT="2", WEB_QUEUE_TIMEOUT="0.3")
    try:
        overload(srv, daemon)
        # Free again: served.
        rows = {"rows": [[0.5] * WIDTH]}
        assert httpx.post(srv.url + "/classify", json=rows, timeout=30).status_code == 200
    finally:
        srv.stop()


def overload(srv, daemon):
    fillers = [gpuq.connect(daemon.runtime_dir, name=f"filler-{i}") for i in range(4)]
    held = []
    rows = {"rows": [[0.5] * WIDTH]}
    try:
        for c in fillers[:2]:
            held.append(c.submit("sleep", us=60_000_000, pool="model"))
        deadline = time.monotonic() + 30
        while sum(f.running() for f in held) < 2:
            assert time.monotonic() < deadline, "the pool's workers never took the holding jobs"
            time.sleep(0.01)
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for ring in ("room", "full"):
                if ring == "full":
                    for c in fillers:  # each client up to its share of the ring
                        try:
                            while True:
                                held.append(c.try_submit("sleep", us=60_000_000, pool="model"))
                        except gpuq.QueueFull:
                            pass
                    with pytest.raises(gpuq.QueueFull, match="pool 'model'"):
                        fillers[-1].try_submit("noop", pool="model")
                t0 = time.monotonic()
                r = http.post("/classify", json=rows)
                assert r.status_code == 503, (ring, r.text)
                assert r.headers["Retry-After"] == "1"
                assert time.monotonic() - t0 < 1.5, ring  # turned away at the queue timeout
    finally:
        for f in held:
            f.stop()
        for f in held:
            try:
                f.result(timeout=30)
            except gpuq.Cancelled:
                pass
        for c in fillers:
            c.close()


def test_gpuq_errors_as_http_status():
    import gpuq_http

    cases = [(gpuq.Timeout("t"), 503), (gpuq.QueueFull("q"), 503), (gpuq.Expired("e"), 503),
             (gpuq.PoolDown("p"), 503), (gpuq.Disconnected("d"), 503),
             (gpuq.ShuttingDown("s"), 503), (gpuq.OutOfMemory("m"), 503),
             (gpuq.TimedOut("t"), 504), (TimeoutError(), 504),
             (concurrent.futures.TimeoutError(), 504), (gpuq.OpFailed("f"), 500),
             (gpuq.WorkerDied("w"), 500), (RuntimeError("r"), 500)]
    for exc, status in cases:
        assert gpuq_http.http_error(exc)[0] == status, exc
    assert gpuq_http.http_error(gpuq.Timeout("t"))[1] == {"Retry-After": "1"}
