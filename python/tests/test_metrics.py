"""Metrics (docs/metrics.md): `gpuqctl metrics`, gpuq.metrics() and the HTTP listener of a real
gpuqd, parsed with prometheus_client's own text parser; counts checked against the jobs run;
the listener's answers to bad requests, a slow client and a taken port."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

import gpuq
import gpuq.testing

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
OPS_DIR = str(HERE / "pyops")
# Metrics that exist only with a GPU: a GPU worker's memory, and NVML's per-GPU figures.
GPU_ONLY = {"gpuq_worker_gpu_memory_used_bytes", "gpuq_worker_gpu_memory_budget_bytes",
            "gpuq_gpu_utilization_ratio", "gpuq_gpu_memory_used_bytes",
            "gpuq_gpu_memory_total_bytes"}
# Metrics that exist only while a worker's starts fail, or it waits to be started again
# (test_failing_starts_and_a_pool_down_are_in_the_metrics).
START_FAILURE_ONLY = {"gpuq_worker_consecutive_start_failures", "gpuq_worker_next_start_seconds"}
# Metrics that exist only while some client has jobs queued or running
# (test_the_clients_with_jobs_are_in_the_metrics).
CLIENT_JOBS_ONLY = {"gpuq_client_jobs"}

CONFIG = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 2},
                    {"name": "py", "kind": "cpu", "workers": 1,
                     "python": {"interpreter": sys.executable,
                                "modules": ["pyops_mod", "pyops_metrics_batch"],
                                "path": [OPS_DIR]}}],
          "metrics_listen": "127.0.0.1:0", "restart_backoff_initial_ms": 10,
          "cancel_grace_ms": 200}


def gpuqctl_path() -> str:
    """gpuqctl beside gpuqd (the wheel's gpuq/bin/), else in the build tree's tools/."""
    gpuqd = pathlib.Path(gpuq.testing.find_gpuqd())
    beside = gpuqd.parent / "gpuqctl"
    return str(beside if beside.exists() else gpuqd.parent.parent / "tools" / "gpuqctl")


def documented_metrics():
    """{name: (type, [labels])} from the table in docs/metrics.md."""
    table = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        m = re.match(r"\| `(gpuq_\w+)` \| (\w+) \|([^|]*)\|", line)
        if m:
            table[m.group(1)] = (m.group(2), re.findall(r"`(\w+)`", m.group(3)))
    assert len(table) >= 20, "the metric table of docs/metrics.md was not found"
    return table


def parse(text):
    """{family name: family} with prometheus_client's parser (which raises on bad text)."""
    parser = pytest.importorskip("prometheus_client.parser")
    return {f.name: f for f in parser.text_string_to_metric_families(text)}


def value(families, family, sample_name=None, **labels):
    fam = families[family]
    sample_name = sample_name or family
    found = [s.value for s in fam.samples
             if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{sample_name}{labels}: {len(found)} samples"
    return found[0]


def family_name(name, kind):
    # prometheus_client names a counter family without its _total suffix.
    return name[:-len("_total")] if kind == "counter" and name.endswith("_total") else name


@pytest.fixture(scope="module")
def mdaemon():
    with gpuq.testing.Daemon(CONFIG) as d:
        yield d


@pytest.fixture(scope="module")
def http_base(mdaemon):
    listen = mdaemon.status()["metrics_listen"]
    assert re.fullmatch(r"127\.0\.0\.1:\d+", listen), listen
    return "http://" + listen


def ctl_metrics(daemon):
    r = subprocess.run([gpuqctl_path(), "--runtime-dir", daemon.runtime_dir, "metrics"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return r.stdout


def http_get(url, method="GET", timeout=10):
    req = urllib.request.Request(url, method=method)
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.status, dict(resp.headers), resp.read().decode()


def test_every_documented_metric_with_its_type_and_labels(mdaemon):
    with gpuq.connect(mdaemon.runtime_dir) as c:
        c.submit("noop").result(30)
    families = parse(ctl_metrics(mdaemon))
    for name, (kind, labels) in documented_metrics().items():
        if name in GPU_ONLY:
            continue  # no GPU here (the gpu-labelled tests see them)
        if name in START_FAILURE_ONLY:
            continue  # every worker starts here (below: a pool whose workers do not)
        if name in CLIENT_JOBS_ONLY:
            continue  # no client has jobs by now (below: one that has)
        fam = families.get(family_name(name, kind))
        assert fam is not None, f"{name} missing"
        assert fam.type == kind, f"{name}: {fam.type}, documented {kind}"
        assert fam.samples, f"{name}: no samples"
        for s in fam.samples:
            assert set(s.labels) - {"le"} == set(labels), f"{name}: labels {s.labels}"
    # Nothing undocumented either.
    documented = {family_name(n, k) for n, (k, _) in documented_metrics().items()}
    assert set(families) <= documented, set(families) - documented


def test_the_clients_with_jobs_are_in_the_metrics(mdaemon):
    with gpuq.connect(mdaemon.runtime_dir, name="metrics-client-jobs") as c:
        held = [c.submit("sleep", us=30_000_000, pool="cpu") for _ in range(5)]
        try:
            deadline = time.monotonic() + 30
            while sum(f.running() for f in held) < 2:
                assert time.monotonic() < deadline, "the workers never took the jobs"
                time.sleep(0.01)
            fam = parse(ctl_metrics(mdaemon))["gpuq_client_jobs"]
            assert fam.type == "gauge"
            mine = {s.labels["state"]: s.value for s in fam.samples
                    if s.labels["program"] == "metrics-client-jobs"}
            assert mine == {"queued": 3, "running": 2}, fam.samples
            assert {s.labels["pid"] for s in fam.samples
                    if s.labels["program"] == "metrics-client-jobs"} == {str(os.getpid())}
        finally:
            for f in held:
                f.stop()
            for f in held:
                try:
                    f.result(timeout=30)
                except gpuq.Cancelled:
                    pass


def test_counts_equal_the_jobs_run(mdaemon):
    before = parse(gpuq.metrics(mdaemon.runtime_dir))

    def ok(fams, op):
        try:
            return value(fams, "gpuq_jobs", "gpuq_jobs_total", pool="cpu", op=op, outcome="ok")
        except (KeyError, AssertionError):
            return 0.0

    def count(fams, hist, op):
        try:
            return value(fams, hist, hist + "_count", pool="cpu", op=op)
        except (KeyError, AssertionError):
            return 0.0

    with gpuq.connect(mdaemon.runtime_dir) as c:
        for f in [c.submit("noop") for _ in range(40)]:
            f.result(30)
        for f in [c.submit("sleep", us=2000) for _ in range(6)]:
            f.result(30)
        with pytest.raises(gpuq.InvalidArgument):
            c.submit("sleep", us=-5).result(30)
        with pytest.raises(gpuq.TimedOut):
            c.submit("sleep", us=5_000_000, time_limit=0.1).result(30)
        f = c.submit("sleep", us=5_000_000)
        time.sleep(0.2)
        f.stop()
        with pytest.raises(gpuq.Cancelled):
            f.result(30)
    # A worker counts a job just after its client sees the result: wait for the last counts.
    deadline = time.monotonic() + 10
    while True:
        after = parse(gpuq.metrics(mdaemon.runtime_dir))
        ended = sum(s.value for s in after["gpuq_jobs"].samples
                    if s.labels["pool"] == "cpu" and s.labels["op"] == "sleep")
        if (ok(after, "noop") - ok(before, "noop") == 40 and ended >= 9) or \
                time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert ok(after, "noop") - ok(before, "noop") == 40
    assert ok(after, "sleep") - ok(before, "sleep") == 6
    for outcome in ("failed", "timed_out", "cancelled"):
        got = value(after, "gpuq_jobs", "gpuq_jobs_total", pool="cpu", op="sleep", outcome=outcome)
        assert got >= 1, outcome
    for hist in ("gpuq_job_queue_wait_seconds", "gpuq_job_run_seconds"):
        assert count(after, hist, "noop") - count(before, hist, "noop") == 40
        # Histogram invariants: cumulative buckets, +Inf equal to _count.
        buckets = [s for s in after[hist].samples
                   if s.name == hist + "_bucket" and s.labels["op"] == "noop"
                   and s.labels["pool"] == "cpu"]
        values = [s.value for s in buckets]
        assert values == sorted(values)
        assert buckets[-1].labels["le"] == "+Inf"
        assert values[-1] == count(after, hist, "noop")
    # Six sleeps of 2 ms: their run time adds up to at least 12 ms, in the 2.5 ms bucket.
    run_sum = value(after, "gpuq_job_run_seconds", "gpuq_job_run_seconds_sum", pool="cpu",
                    op="sleep")
    assert run_sum >= 0.012
    le_1ms = value(after, "gpuq_job_run_seconds", "gpuq_job_run_seconds_bucket", pool="cpu",
                   op="sleep", le="0.001")
    le_25ms = value(after, "gpuq_job_run_seconds", "gpuq_job_run_seconds_bucket", pool="cpu",
                    op="sleep", le="0.0025")
    assert le_25ms - le_1ms >= 6 - 1  # a loaded machine may stretch one past 2.5 ms
    submitted = value(after, "gpuq_jobs_submitted", "gpuq_jobs_submitted_total", pool="cpu")
    assert submitted >= 49


def test_worker_death_and_time_limit_kill_are_counted(mdaemon):
    def doubled(fams):
        try:
            return value(fams, "gpuq_jobs", "gpuq_jobs_total", pool="py", op="double",
                         outcome="ok")
        except (KeyError, AssertionError):
            return 0.0

    with gpuq.connect(mdaemon.runtime_dir) as c:
        for _ in range(5):
            c.call("double", np.arange(4.0), pool="py")
        with pytest.raises(gpuq.WorkerDied):
            c.call("crash", pool="py")
        # sleep_forever ignores cancellation: the supervisor kills its worker at the limit.
        with pytest.raises(gpuq.TimedOut):
            c.call("sleep_forever", pool="py", time_limit=0.2)
    deadline = time.monotonic() + 30
    while True:
        fams = parse(gpuq.metrics(mdaemon.runtime_dir))
        died = value(fams, "gpuq_jobs", "gpuq_jobs_total", pool="py", op="crash",
                     outcome="worker_died")
        timed = value(fams, "gpuq_jobs", "gpuq_jobs_total", pool="py", op="sleep_forever",
                      outcome="timed_out")
        kills = value(fams, "gpuq_job_time_limit_kills", "gpuq_job_time_limit_kills_total",
                      pool="py")
        restarts = value(fams, "gpuq_worker_restarts", "gpuq_worker_restarts_total", pool="py")
        ready = value(fams, "gpuq_workers", pool="py", state="idle")
        if ready == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (died, timed, kills) == (1, 1, 1)
    assert restarts >= 2
    assert ready == 1
    # The worker's own counts outlive its process: the page is kept across restarts.
    assert doubled(fams) >= 5


def test_failing_starts_and_a_pool_down_are_in_the_metrics():
    """A Python pool whose on_start raises: its worker's failed starts in a row, with how the
    last one ended, its next start, and the pool down. (The pool_down outcome of jobs failed
    while queued: tests/fault/worker_kill_test.cpp.)"""
    cfg = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1},
                     {"name": "bad", "kind": "cpu", "workers": 1,
                      "python": {"interpreter": sys.executable, "modules": ["pyops_bad_start"],
                                 "path": [OPS_DIR]}}],
           "restart_backoff_initial_ms": 10, "max_start_failures": 2,
           "start_backoff_initial_ms": 60000, "pool_down_fail_ms": 300}
    documented = documented_metrics()
    with gpuq.testing.Daemon(cfg, wait_ready=False) as d:
        deadline = time.monotonic() + 60
        while True:
            st = next(p for p in d.status()["pools"] if p["name"] == "bad")
            if st["failing_jobs"] and st["workers"][0]["state"] == "failed":
                break
            assert time.monotonic() < deadline, st
            time.sleep(0.05)
        with gpuq.connect(d.runtime_dir) as c:
            with pytest.raises(gpuq.PoolDown):
                c.submit_call("bad_start_op", pool="bad").result(30)
        fams = parse(ctl_metrics(d))
        for name in START_FAILURE_ONLY | {"gpuq_pool_down"}:
            kind, labels = documented[name]
            fam = fams.get(name)
            assert fam is not None and fam.type == kind, name
            for sample in fam.samples:
                assert set(sample.labels) == set(labels), f"{name}: labels {sample.labels}"
        # The pool's worker, by its id in the status (after pool cpu's entries, its surge seat
        # included).
        bad = str(st["workers"][0]["id"])
        assert value(fams, "gpuq_worker_consecutive_start_failures", pool="bad", worker=bad,
                     last_exit="exited with status 1 before it was ready") == 2
        assert 0 < value(fams, "gpuq_worker_next_start_seconds", pool="bad", worker=bad) <= 60
        assert value(fams, "gpuq_pool_down", pool="bad") == 1
        assert value(fams, "gpuq_pool_down", pool="cpu") == 0
        assert value(fams, "gpuq_workers", pool="bad", state="failed") == 1
        assert value(fams, "gpuq_ready") == 0


def test_batch_histograms_count_the_rows_of_a_batched_op(mdaemon):
    """gpuq_batch_rows and gpuq_batch_gather_seconds of scale_rows (max_batch_size 8): every
    row of every job in exactly one call, however the worker gathered them."""
    def samples(fams, family, suffix):
        return {s.labels.get("le"): s.value for s in fams[family].samples
                if s.name == family + suffix and s.labels["pool"] == "py"
                and s.labels["op"] == "scale_rows"}

    before = parse(gpuq.metrics(mdaemon.runtime_dir))
    # Present from the start, for the op batched on its pool only.
    assert samples(before, "gpuq_batch_rows", "_count")
    assert not [s for s in before["gpuq_batch_rows"].samples if s.labels["op"] == "double"]
    rows = [1, 2, 3, 1, 4, 2, 1, 1, 5, 3]
    with gpuq.connect(mdaemon.runtime_dir) as c:
        futures = [c.submit_call("scale_rows", np.ones((n, 3)), pool="py") for n in rows]
        for n, f in zip(rows, futures):
            assert np.array_equal(np.asarray(f.result(30)), np.full((n, 3), 2.0))
    deadline = time.monotonic() + 10
    while True:
        after = parse(gpuq.metrics(mdaemon.runtime_dir))
        rows_sum = (samples(after, "gpuq_batch_rows", "_sum")[None]
                    - samples(before, "gpuq_batch_rows", "_sum")[None])
        if rows_sum >= sum(rows) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert rows_sum == sum(rows)
    calls = (samples(after, "gpuq_batch_rows", "_count")[None]
             - samples(before, "gpuq_batch_rows", "_count")[None])
    assert 1 <= calls <= len(rows)
    gathers = (samples(after, "gpuq_batch_gather_seconds", "_count")[None]
               - samples(before, "gpuq_batch_gather_seconds", "_count")[None])
    assert gathers >= 1
    for family in ("gpuq_batch_rows", "gpuq_batch_gather_seconds"):
        buckets = samples(after, family, "_bucket")
        values = list(buckets.values())
        assert values == sorted(values)  # cumulative
        assert buckets["+Inf"] == samples(after, family, "_count")[None]
    # A call stops taking jobs at max_batch_size (8) rows: the last job may bring it to 12.
    assert samples(after, "gpuq_batch_rows", "_bucket")["16"] == \
        samples(after, "gpuq_batch_rows", "_count")[None]


def test_status_shows_each_batched_op_s_settings(mdaemon):
    pool = next(p for p in mdaemon.status()["pools"] if p["name"] == "py")
    assert pool["python"]["batching"] == {"scale_rows": {"max_batch_size": 8,
                                                         "max_queue_delay_us": 500}}
    assert "scale_rows" in pool["python"]["ops"] and "double" in pool["python"]["ops"]
    cpu = next(p for p in mdaemon.status()["pools"] if p["name"] == "cpu")
    assert "python" not in cpu
    r = subprocess.run([gpuqctl_path(), "--runtime-dir", mdaemon.runtime_dir, "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert "  batching scale_rows: max_batch_size 8, max_queue_delay_us 500\n" in r.stdout
    assert "batching double" not in r.stdout


def test_http_serves_what_the_control_socket_does(mdaemon, http_base):
    status, headers, body = http_get(http_base + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    http = parse(body)
    ctl = parse(ctl_metrics(mdaemon))
    assert set(http) == set(ctl)
    assert value(http, "gpuq_queue_capacity", pool="cpu") == value(ctl, "gpuq_queue_capacity",
                                                                    pool="cpu")
    status, headers, body = http_get(http_base + "/metrics", method="HEAD")
    assert status == 200 and body == ""


@pytest.mark.parametrize("path,method,code", [("/nope", "GET", 404), ("/metrics", "POST", 405),
                                              ("/metrics", "DELETE", 405)])
def test_http_refuses_other_paths_and_methods(http_base, path, method, code):
    with pytest.raises(urllib.error.HTTPError) as e:
        http_get(http_base + path, method=method)
    assert e.value.code == code
    if code == 405:
        assert "GET" in e.value.headers["Allow"]


def raw_request(http_base, data, timeout=10):
    host, port = http_base[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        chunks = []
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")


def test_http_bad_requests_get_an_error(mdaemon, http_base):
    huge = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n"
    assert raw_request(http_base, huge).startswith("HTTP/1.1 431")
    assert raw_request(http_base, b"NOT HTTP AT ALL\r\n\r\n").startswith("HTTP/1.1 400")
    # The daemon serves on.
    assert mdaemon.status()["ready"]


def test_http_slow_client_does_not_stall_the_daemon(mdaemon, http_base):
    host, port = http_base[len("http://"):].split(":")
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(4)]
    try:
        for s in slow:
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # and never the end
        t0 = time.monotonic()
        status, _, body = http_get(http_base + "/metrics", timeout=5)
        assert status == 200 and "gpuq_build_info" in body
        with gpuq.connect(mdaemon.runtime_dir) as c:
            c.submit("noop").result(5)
        assert mdaemon.status()["ready"]
        assert time.monotonic() - t0 < 5
    finally:
        for s in slow:
            s.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_listener_refuses_a_taken_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        d = gpuq.testing.Daemon({"pools": [{"name": "cpu", "kind": "cpu", "workers": 1}],
                                 "metrics_listen": f"127.0.0.1:{port}"}, start_timeout=20)
        try:
            with pytest.raises(RuntimeError, match="exited with status 1"):
                d.start()
            log = d.log()
            assert f"metrics_listen 127.0.0.1:{port}" in log
            assert "Address already in use" in log
        finally:
            d.stop()


@pytest.mark.parametrize("listen,why", [("localhost:9464", "not an IP address"),
                                        ("127.0.0.1:99999", "port"),
                                        ("::1:9464", "bracket"), (9464, "address")])
def test_bad_listen_address_is_a_config_error(tmp_path, listen, why):
    cfg = tmp_path / "gpuqd.json"
    cfg.write_text('{"metrics_listen": %s}' % (
        '"%s"' % listen if isinstance(listen, str) else listen))
    r = subprocess.run([gpuq.testing.find_gpuqd(), "--config", str(cfg), "--check-config"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert "metrics_listen" in r.stderr and why in r.stderr, r.stderr


def test_job_metrics_off_keeps_the_rest():
    cfg = {"pools": [{"name": "cpu", "kind": "cpu", "workers": 1}], "job_metrics": False}
    with gpuq.testing.Daemon(cfg) as d:
        with gpuq.connect(d.runtime_dir) as c:
            for f in [c.submit("noop") for _ in range(10)]:
                f.result(30)
        fams = parse(gpuq.metrics(d.runtime_dir))
    assert not fams["gpuq_jobs"].samples
    assert not fams["gpuq_job_run_seconds"].samples
    assert value(fams, "gpuq_workers", pool="cpu", state="idle") == 1
    assert value(fams, "gpuq_jobs_submitted", "gpuq_jobs_submitted_total", pool="cpu") == 10


def test_metrics_without_a_daemon_is_a_clear_error(tmp_path):
    with pytest.raises(gpuq.Disconnected):
        gpuq.metrics(str(tmp_path / "none"))
    r = subprocess.run([gpuqctl_path(), "--runtime-dir", str(tmp_path / "none"), "metrics"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and "gpuqctl" in r.stderr


def test_top_once_reports_the_pools(mdaemon):
    """`gpuqctl top --once`: two fetches an interval apart, plain text, one line per pool."""
    with gpuq.connect(mdaemon.runtime_dir) as c:
        stop = time.monotonic() + 1.5
        proc = subprocess.Popen([gpuqctl_path(), "--runtime-dir", mdaemon.runtime_dir, "top",
                                 "--once", "--interval", "0.5"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        jobs = 0
        while proc.poll() is None and time.monotonic() < stop:
            for f in [c.submit("noop") for _ in range(20)]:
                f.result(30)
            jobs += 20
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert "\x1b" not in out  # no escape codes when not a terminal
    lines = out.splitlines()
    assert lines[0].startswith("gpuqd ") and "ready" in lines[0]
    header = lines[1].split()
    assert header[:2] == ["POOL", "JOBS/S"]
    rows = {line.split()[0]: line.split() for line in lines[2:] if line.strip()}
    assert set(rows) >= {"cpu", "py"}
    # py has a batched op: a BATCH column, "-" for py (no call of it in the interval).
    assert header[-1] == "BATCH"
    assert rows["py"][-1] == "-", out
    assert float(rows["cpu"][1]) > 0, out  # jobs ran during the interval
    queue = next(tok for tok in rows["cpu"] if re.fullmatch(r"\d+/\d+", tok))
    assert queue.endswith("/20")  # 10 x 2 workers


def test_top_refuses_bad_arguments(mdaemon):
    for args in (["--interval", "0"], ["--count", "x"], ["--once", "--count", "2"], ["extra"]):
        r = subprocess.run([gpuqctl_path(), "--runtime-dir", mdaemon.runtime_dir, "top", *args],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert r.stderr.strip(), args


def test_gpu_sampler_figures_from_a_stand_in_nvml(monkeypatch):
    """The per-GPU metrics through the whole path (the `gpuqd --sample-gpus` child loading
    NVML, its lines on the pipe, the supervisor's rendering), with tests/support/fake_nvml.c in
    place of libnvidia-ml.so.1 (test hook GPUQ_TEST_NVML_LIBRARY): one GPU, 42 % busy, 20 of
    80 GiB used."""
    lib = pathlib.Path(gpuq.testing.find_gpuqd()).parent.parent / "tests" / "libgpuq_fake_nvml.so"
    if not lib.exists():
        pytest.skip(f"{lib} not built (target gpuq_fake_nvml)")
    monkeypatch.setenv("GPUQ_TEST_HOOKS", "1")
    monkeypatch.setenv("GPUQ_TEST_NVML_LIBRARY", str(lib))
    cfg = {"pools": [{"name": "gpu", "kind": "gpu", "gpus": [0], "workers_per_gpu": 1}]}
    uuid = "GPU-fa4e0000-0000-0000-0000-000000000001"
    with gpuq.testing.Daemon(cfg) as d:
        deadline = time.monotonic() + 15
        while True:
            fams = parse(gpuq.metrics(d.runtime_dir))
            if "gpuq_gpu_utilization_ratio" in fams or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert "gpuq_gpu_utilization_ratio" in fams, d.log()
        assert value(fams, "gpuq_gpu_utilization_ratio", gpu="0", uuid=uuid) == 0.42
        assert value(fams, "gpuq_gpu_memory_used_bytes", gpu="0", uuid=uuid) == 20 << 30
        assert value(fams, "gpuq_gpu_memory_total_bytes", gpu="0", uuid=uuid) == 80 << 30
        documented = documented_metrics()
        for name in ("gpuq_gpu_utilization_ratio", "gpuq_gpu_memory_used_bytes",
                     "gpuq_gpu_memory_total_bytes"):
            kind, labels = documented[name]
            assert fams[name].type == kind
            assert all(set(s.labels) == set(labels) for s in fams[name].samples)
        with gpuq.connect(d.runtime_dir) as c:
            c.submit("noop", pool="gpu").result(30)
        assert d.status()["ready"]
