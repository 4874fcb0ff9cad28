"""Dask's worker resource "gpuq": held by the workers whose node's gpuqd serves
(docs/scale-out.md, "Dask"). A preload for `dask worker`:

    dask worker SCHEDULER --nthreads 4 --resources gpuq=4 --preload /path/to/gpuq_resource.py

Tasks that call gpuq ask for the resource, with retries, and call gpuq through :func:`call`:

    def task(x):
        import gpuq_resource                      # the preload, on the worker
        return gpuq_resource.call("score", x, w)
    client.map(task, items, resources={"gpuq": 1}, retries=3)

The scheduler sends such a task only to a worker that holds the resource. A task whose node's
gpuqd is gone gets gpuq.Disconnected from :func:`call`, which first has the scheduler count
this worker's "gpuq" as 0: Dask then retries the task on a worker whose node has a gpuqd, and
the gpuq tasks this worker already holds fail at once and are retried there too. Without that,
Dask would give a retried task straight back to the thread it had just freed, on the same
worker, until its retries were spent. Every second the worker asks its node's gpuqd for its
status, and gives the resource back once it answers again (a restarted gpuqd).
"""

from __future__ import annotations

from typing import Any

from distributed import Worker, get_worker
from distributed.utils import sync

import gpuq

RESOURCE = "gpuq"
CHECK_MS = 1000

_withdrawn = False  # this worker's "gpuq" counts as 0 at the scheduler


async def _announce(worker: Worker, quantity: float) -> None:
    # What Worker.set_resources tells the scheduler, without changing the worker's own count:
    # the worker still runs the gpuq tasks it holds (they fail at once, and are retried).
    await worker.scheduler.set_resources(
        resources={**worker.state.total_resources, RESOURCE: quantity},
        worker=worker.contact_address)


def call(op: str, *args: Any, **kwargs: Any) -> Any:
    """``client.call(op, ...)`` on this node's gpuqd, through the module's default client.
    Raises what the call raises; on gpuq.Disconnected it first closes the client (the next
    call connects anew) and withdraws this worker's resource."""
    global _withdrawn
    client = None
    try:
        client = gpuq.default_client()
        return client.call(op, *args, **kwargs)
    except gpuq.Disconnected:
        if client is not None:
            client.close()
        if not _withdrawn:
            _withdrawn = True
            worker = get_worker()
            sync(worker.loop, _announce, worker, 0)
        raise


def _gpuqd_answers() -> bool:
    try:
        gpuq.status()
        return True
    except gpuq.Error:
        return False


def dask_setup(worker: Worker) -> None:
    slots = worker.state.total_resources.get(RESOURCE)
    if not slots:
        raise ValueError(f"gpuq_resource: start the worker with --resources {RESOURCE}=N "
                         "(N: its threads)")

    async def give_back() -> None:
        global _withdrawn
        if _withdrawn and await worker.loop.run_in_executor(None, _gpuqd_answers):
            _withdrawn = False
            await _announce(worker, slots)

    # Started, and stopped at close, with the worker's own periodic callbacks.
    from tornado.ioloop import PeriodicCallback

    worker.periodic_callbacks["gpuq-resource"] = PeriodicCallback(give_back, CHECK_MS)
