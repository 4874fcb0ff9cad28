"""gunicorn's settings for flask_app (gunicorn -c examples/web/gunicorn.conf.py ...)."""

import os

bind = os.environ.get("WEB_BIND", "127.0.0.1:8000")
workers = int(os.environ.get("WEB_WORKERS", "8"))
worker_class = "sync"  # one request at a time per worker; a gpuq call waits in it
timeout = 60
# The app, and with it its gpuq client, made once in the master; the workers are forked from it.
preload_app = True


def post_fork(server, worker):
    """A forked worker's client connects anew on its first call by itself; connect now, so
    that no request pays for it (a socket round trip and mapping the segment)."""
    import sys

    app_module = sys.modules.get("flask_app")
    if app_module is None:
        return
    try:
        app_module.client.pools  # the first use after the fork: connects this worker
    except Exception as e:  # noqa: BLE001 - the daemon is not there yet: the first call retries
        server.log.warning("worker %s: gpuq not reachable yet: %s", worker.pid, e)
