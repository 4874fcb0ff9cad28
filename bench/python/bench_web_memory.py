"""Memory of 8 web workers that call a model through gpuq, against 8 web workers that each load
the model themselves (docs/web.md, "Memory"; BENCHMARKS.md, "Web workers' memory").

The model is examples/web/model.py's "large" MLP (2048 -> 8192 -> 8192 -> 1000, 368 MB of
float32 weights), made from a seed as a checkpoint load would fill it (private memory). Each
setup serves examples/web's /classify with WEB_WORKERS (8) web workers, gets REQUESTS requests
of 1 to 4 rows from 8 concurrent clients (so that every worker has run the request path, and
the model's buffers have been used), waits for the processes to settle, then reads
/proc/PID/smaps_rollup of every process of the setup (the web server's master and workers,
gpuqd and its pool workers) and sums Rss and Pss. Pss counts a page shared by n processes as
1/n in each, so the Pss sum is the memory the setup really takes; the Rss sum counts shared
pages once per process.

Setups:

- ``gpuq-flask``: examples/web/flask_app.py under gunicorn --preload (its gpuq client made in
  the master before the fork), 8 sync workers, calling the batched op "classify" of a gpuqd
  whose Python pool of POOL_WORKERS workers each holds the model (model_ops.py).
- ``gpuq-fastapi``: examples/web/fastapi_app.py under uvicorn --workers 8 (acall), the same
  gpuqd.
- ``direct``: bench/python/web_direct_app.py under gunicorn without --preload: each of the 8
  workers imports the model and loads its weights (as a process per worker that owns a model
  does; uvicorn --workers, which spawns, is the same).
- ``direct-preload``: the same app with --preload: the master loads the weights once and the
  workers share them copy-on-write, for as long as nothing writes those pages. Possible with
  numpy on a CPU; not with a GPU (a CUDA context does not survive fork, so each worker would
  make its own context and copy of the weights), nor with frameworks that must load after the
  fork (their thread pools do not survive it).

Run from the repository root, with a venv holding gpuq, flask, gunicorn, fastapi, uvicorn and
httpx (tests/web/requirements.txt) and gpuqd built:

    GPUQ_GPUQD=build/daemon/gpuqd python bench/python/bench_web_memory.py

It prints a table and writes bench/results/web-memory-<UTC date>.{json,txt}. 3 to 4 minutes
on a 2-CPU VM (it needs about 4 GB of memory: 8 copies of the model at once).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import pathlib
import platform
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Dict, List

import httpx
import numpy as np

import gpuq
import gpuq.testing

REPO = pathlib.Path(__file__).resolve().parents[2]
WEB = REPO / "examples" / "web"
HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(WEB))
import gpuqd_config  # noqa: E402
import model  # noqa: E402 - for the input width only; the weights are never made here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> List[int]:
    parent: Dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


def rollup(pid: int) -> Dict[str, int]:
    """Rss and Pss (bytes) of a process, from /proc/PID/smaps_rollup."""
    got = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Pss_Anon", "Pss_Shmem"):
                got[key.lower()] = int(rest.split()[0]) * 1024
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    got["cmd"] = cmd[:120]
    return got


def group(pids: List[int]) -> Dict[str, Any]:
    procs = {p: rollup(p) for p in pids}
    return {"processes": len(procs), "rss": sum(r["rss"] for r in procs.values()),
            "pss": sum(r["pss"] for r in procs.values()),
            "each": {str(p): r for p, r in procs.items()}}


class Server:
    def __init__(self, args: List[str], env: Dict[str, str], cwd: pathlib.Path, port: int,
                 log: pathlib.Path, start_timeout: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w")
        self.proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{args[:4]} exited {self.proc.returncode}; see {log}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{args[:4]} did not answer; see {log}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


def load(url: str, requests: int, width: int) -> Dict[str, Any]:
    def one(i: int) -> int:
        rng = np.random.default_rng(i)
        x = rng.standard_normal((int(rng.integers(1, 5)), width), dtype=np.float32)
        r = httpx.post(url + "/classify", json={"rows": x.tolist()}, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.text[:300]}")
        return len(r.json()["labels"])

    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        rows = sum(ex.map(one, range(requests)))
    return {"requests": requests, "rows": rows, "seconds": round(time.monotonic() - t0, 2)}


def gunicorn(app: str, port: int, workers: int, preload: bool) -> List[str]:
    args = [sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}", "--workers",
            str(workers), "--timeout", "600", "--log-level", "warning",
            "--pythonpath", f"{WEB},{HERE}"]
    if app == "flask_app:app":
        args += ["-c", str(WEB / "gunicorn.conf.py")]  # --preload and its post_fork
    elif preload:
        args.append("--preload")
    return args + [app]


def measure(name: str, server_args: List[str], env: Dict[str, str], a: argparse.Namespace,
            daemon: Any, logs: pathlib.Path, cwd: pathlib.Path) -> Dict[str, Any]:
    port = free_port()
    server_args = [s.replace("@PORT@", str(port)) for s in server_args]
    print(f"{name}: starting {' '.join(server_args[2:4])} ...", flush=True)
    srv = Server(server_args, env, cwd, port, logs / f"{name}.log")
    try:
        ran = load(srv.url, a.requests, model.SIZES[a.model][0])
        time.sleep(a.settle)
        web = [srv.proc.pid] + descendants(srv.proc.pid)
        result: Dict[str, Any] = {"command": " ".join(server_args[2:]), "load": ran,
                                  "web": group(web)}
        if daemon is not None:
            assert daemon.proc is not None
            result["gpuq"] = group([daemon.proc.pid] + descendants(daemon.proc.pid))
        result["total_rss"] = sum(result[k]["rss"] for k in ("web", "gpuq") if k in result)
        result["total_pss"] = sum(result[k]["pss"] for k in ("web", "gpuq") if k in result)
        return result
    finally:
        srv.stop()


def mib(n: int) -> str:
    return f"{n / (1 << 20):,.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="large", choices=sorted(model.SIZES))
    p.add_argument("--web-workers", type=int, default=8)
    p.add_argument("--pool-workers", type=int, default=2)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--settle", type=float, default=2.0, help="seconds idle before measuring")
    p.add_argument("--setups", default="gpuq-flask,gpuq-fastapi,direct,direct-preload")
    p.add_argument("--out", default=None, help="output prefix (default bench/results/web-memory-"
                   "<UTC date>)")
    a = p.parse_args()
    setups = a.setups.split(",")
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = pathlib.Path(a.out or REPO / "bench" / "results" / f"web-memory-{date}")
    logs = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-web-memory-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    weights = model.weight_bytes([(np.empty((i, o), np.float32), np.empty(o, np.float32))
                                  for i, o in zip(model.SIZES[a.model], model.SIZES[a.model][1:])])
    results: Dict[str, Any] = {}
    base_env = dict(os.environ, WEB_MODEL=a.model, WEB_WORKERS=str(a.web_workers),
                    WEB_TIMEOUT="120")
    if any(s.startswith("gpuq") for s in setups):
        cfg = gpuqd_config.config(a.model, workers=a.pool_workers)
        with gpuq.testing.Daemon(cfg, start_timeout=600) as d:
            env = d.env(base_env)
            for s in setups:
                if s == "gpuq-flask":
                    args = gunicorn("flask_app:app", 0, a.web_workers, True)
                    args[args.index("--bind") + 1] = "127.0.0.1:@PORT@"
                elif s == "gpuq-fastapi":
                    args = [sys.executable, "-m", "uvicorn", "--workers", str(a.web_workers),
                            "--host", "127.0.0.1", "--port", "@PORT@", "--log-level", "warning",
                            "--no-access-log", "fastapi_app:app"]
                else:
                    continue
                results[s] = measure(s, args, env, a, d, logs, WEB)
    for s in setups:
        if s in ("direct", "direct-preload"):
            args = gunicorn("web_direct_app:app", 0, a.web_workers, s == "direct-preload")
            args[args.index("--bind") + 1] = "127.0.0.1:@PORT@"
            # Not in examples/web, whose gunicorn.conf.py gunicorn would read by itself (it
            # sets preload_app).
            results[s] = measure(s, args, base_env, a, None, logs, HERE)

    lines = [f"Web workers' memory, {date}: {a.web_workers} web workers, model '{a.model}' "
             f"({weights / 1e6:,.0f} MB of float32 weights), gpuq pool of {a.pool_workers} "
             f"workers; {a.requests} requests of 1-4 rows from 8 clients, then "
             f"{a.settle:g} s idle; sums of /proc/PID/smaps_rollup (MiB)", "",
             "| setup | web Rss | web Pss | gpuq Rss | gpuq Pss | total Pss | load |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for s, r in results.items():
        g = r.get("gpuq")
        lines.append(f"| {s} | {mib(r['web']['rss'])} ({r['web']['processes']} proc) | "
                     f"{mib(r['web']['pss'])} | {mib(g['rss']) if g else '-'}"
                     f"{' (' + str(g['processes']) + ' proc)' if g else ''} | "
                     f"{mib(g['pss']) if g else '-'} | {mib(r['total_pss'])} | "
                     f"{r['load']['requests']} req in {r['load']['seconds']} s |")
    text = "\n".join(lines)
    print(text)
    doc = {"date": date, "command": " ".join(sys.argv), "model": a.model,
           "weight_bytes": weights, "web_workers": a.web_workers,
           "pool_workers": a.pool_workers, "requests": a.requests, "settle_s": a.settle,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "python": sys.version.split()[0], "numpy": np.__version__},
           "results": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".txt").write_text(text + "\n")
    print(f"wrote {out}.json and .txt")


if __name__ == "__main__":
    main()
