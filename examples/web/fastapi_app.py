"""A FastAPI app that classifies rows through gpuq, awaiting each call (Client.acall), so that
nothing blocks the event loop: run under uvicorn with 8 workers,

    uvicorn --app-dir examples/web --workers 8 fastapi_app:app

POST /classify {"rows": [[64 numbers], ...]} -> {"labels": [...], "probs": [[...], ...]}.

uvicorn starts its workers with multiprocessing's spawn: each imports this module anew and
connects its own client in the lifespan (off the event loop: connecting is a socket round
trip). The model is never imported here: the op "classify" runs it in the gpuq pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any, Dict, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

import gpuq
from gpuq_http import debug_enabled, http_error, imports_report, rows_of

TIMEOUT = float(os.environ.get("WEB_TIMEOUT", "10"))  # seconds a request may take
# Seconds a call may wait to start (for room in the queue, then for a worker): past it the
# request is turned away (503) and the call never runs; the rest of TIMEOUT is the model's.
QUEUE_TIMEOUT = float(os.environ.get("WEB_QUEUE_TIMEOUT", str(TIMEOUT / 2)))
client: Optional[gpuq.Client] = None
width: Optional[int] = None


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    global client, width
    client = await asyncio.to_thread(gpuq.connect, name="web-fastapi", wait=30)
    width = (await client.acall("model_info", timeout=TIMEOUT))["dims"][0]
    yield
    client.close()


app = FastAPI(lifespan=lifespan)


def error(e: BaseException) -> JSONResponse:
    status, headers, message = http_error(e)
    return JSONResponse({"error": message}, status_code=status, headers=headers)


@app.post("/classify")
async def classify(request: Request) -> Any:
    try:
        x = rows_of(await request.json(), width)
    except ValueError as e:  # also a body that is not JSON
        return JSONResponse({"error": str(e)}, status_code=400)
    try:
        # Waits for room in the client (not in the loop), then for the answer. Not started
        # within QUEUE_TIMEOUT: gpuq.Expired (503; the call never runs). Past TIMEOUT:
        # TimeoutError (504), and the job is stopped.
        labels, probs = await client.acall("classify", x, timeout=TIMEOUT,
                                           expire_after=QUEUE_TIMEOUT)
    except Exception as e:  # noqa: BLE001 - gpuq's and TimeoutError, as HTTP
        return error(e)
    return {"labels": labels.tolist(), "probs": probs.tolist()}


@app.get("/healthz")
async def healthz() -> Dict[str, bool]:
    return {"ok": True}


@app.get("/debug/imports")
async def debug_imports() -> Any:
    if not debug_enabled():
        return JSONResponse({"error": "not found"}, status_code=404)
    return imports_report()
