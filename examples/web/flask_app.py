"""A Flask app that classifies rows through gpuq: run under gunicorn with --preload and 8 sync
workers (gunicorn.conf.py):

    gunicorn -c examples/web/gunicorn.conf.py --chdir examples/web flask_app:app

POST /classify {"rows": [[64 numbers], ...]} -> {"labels": [...], "probs": [[...], ...]}.

The gpuq client is made at import, so with --preload in gunicorn's master, before the fork: each
worker connects anew on its first call, by itself (a Client is fork-safe: docs/python.md,
"Processes"), and gunicorn.conf.py's post_fork makes that connection as the worker starts. The
model is never imported here: the op "classify" runs it in the gpuq pool (model_ops.py).
"""

from __future__ import annotations

import os
import time

from flask import Flask, jsonify, request

import gpuq
from gpuq_http import debug_enabled, http_error, imports_report, rows_of

TIMEOUT = float(os.environ.get("WEB_TIMEOUT", "10"))  # seconds a request may take
# Seconds a call may wait to start (for room in the queue, then for a worker): past it the
# request is turned away (503) and the call never runs; the rest of TIMEOUT is the model's.
QUEUE_TIMEOUT = float(os.environ.get("WEB_QUEUE_TIMEOUT", str(TIMEOUT / 2)))

client = gpuq.connect(name="web-flask", wait=30)  # GPUQ_RUNTIME_DIR, else the default daemon
# The model's input width, asked of the pool (the model is not here): once, in the master.
WIDTH = client.call("model_info", timeout=60)["dims"][0]
app = Flask(__name__)


@app.post("/classify")
def classify():
    try:
        x = rows_of(request.get_json(silent=True), WIDTH)
    except ValueError as e:
        return jsonify(error=str(e)), 400
    started = time.monotonic()
    f = None
    try:
        # No room within QUEUE_TIMEOUT: gpuq.Timeout; still queued then: gpuq.Expired (503,
        # the call never runs). Running past TIMEOUT: TimeoutError (504).
        f = client.submit_call("classify", x, timeout=QUEUE_TIMEOUT, expire_after=QUEUE_TIMEOUT)
        labels, probs = f.result(timeout=max(0.0, TIMEOUT - (time.monotonic() - started)))
    except Exception as e:  # noqa: BLE001 - gpuq's and TimeoutError, as HTTP
        if f is not None:
            f.stop()  # nobody will read it (a batched call still serves the others' rows)
        status, headers, message = http_error(e)
        app.logger.warning("classify: %s", message)
        return jsonify(error=message), status, headers
    return jsonify(labels=labels.tolist(), probs=probs.tolist())


@app.get("/healthz")
def healthz():
    return jsonify(ok=True)


@app.get("/debug/imports")
def debug_imports():
    if not debug_enabled():
        return jsonify(error="not found"), 404
    return jsonify(imports_report())
