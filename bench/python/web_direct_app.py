"""The baseline of bench_web_memory.py: examples/web's Flask app without gpuq, each web worker
running the model itself (model.py imported, its weights made at import: in each worker under
gunicorn without --preload, once in the master with --preload). Same routes and answers as
examples/web/flask_app.py. gpuq is not imported (examples/web/gpuq_http.py is), so the
baseline's workers carry nothing of gpuq."""

from __future__ import annotations

import os

import numpy as np
from flask import Flask, jsonify, request

import model

LAYERS = model.make_weights(os.environ.get("WEB_MODEL", "large"))
app = Flask(__name__)


def rows_of(body, width):
    """As examples/web/gpuq_http.py's."""
    if not isinstance(body, dict) or "rows" not in body:
        raise ValueError('the body must be JSON {"rows": [[...], ...]}')
    x = np.asarray(body["rows"], dtype=np.float32)
    if x.ndim != 2 or not 1 <= x.shape[0] <= 64 or x.shape[1] != width:
        raise ValueError(f"rows: must be 1 to 64 rows of {width} numbers")
    return x


@app.post("/classify")
def classify():
    try:
        x = rows_of(request.get_json(silent=True), LAYERS[0][0].shape[0])
    except ValueError as e:
        return jsonify(error=str(e)), 400
    labels, probs = model.forward(LAYERS, x)
    return jsonify(labels=labels.tolist(), probs=probs.tolist())


@app.get("/healthz")
def healthz():
    return jsonify(ok=True)
