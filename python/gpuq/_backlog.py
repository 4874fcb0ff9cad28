"""Tasks that wait in the client for room in the daemon: an Executor's ``submit`` and a client's
``asubmit_call`` / ``acall`` never block the caller's thread (nor an event loop).

The daemon's queue is bounded (a pool's ring holds 10 x its workers, and each client gets a
share of it), and an Executor may be given ``max_workers`` (at most that many of its tasks in
the daemon at once). A task that finds no room waits here instead, in submission order, bounded
only by memory, as ``concurrent.futures`` executors queue their work items: its
:class:`gpuq.Future` exists at once, with no job yet (``Future._queue``), and one feeder thread
per backlog hands the tasks to the daemon as room appears, giving each future its job
(``Future._attach``). ``cancel()`` of a task still here removes it; its future ends cancelled.

Room appears when a job of this client ends (its share of the ring, its segment) or when other
clients' jobs leave the ring; the feeder sleeps on the executor's own jobs (``Job.wait_any``)
for at most a few milliseconds between tries.

A client's async calls (``Client.asubmit_call``) use one Backlog per connection and pool (so a
full pool never holds up calls to another), with ``late``: a call whose room-wait ``timeout``
passes while it waits here fails with :class:`gpuq.Timeout`, and one whose ``expire_after``
passes with :class:`gpuq.Expired`, without being sent.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Deque, List, Optional, Tuple

from . import _errors, _native

_RETRY_NS = 2_000_000  # the longest sleep between tries when nothing of ours ends
_SWEEP_S = 0.005  # how often the tasks behind the first are checked against ``late``


class Backlog:
    """The tasks of one Executor that wait for room (see the module's docstring).

    ``send(future, task)`` hands one task to the daemon without waiting (it raises QueueFull
    or OutOfMemory when there is no room now); ``at_cap()`` says whether the executor has as
    many tasks in the daemon as it may; ``in_flight()`` lists their jobs; ``late(task, now)``
    (optional) is the exception of a task that must not wait any longer (its deadline passed,
    ``now`` being ``time.monotonic()``), or None; ``name`` names the feeder thread.
    Thread-safe."""

    def __init__(
        self,
        send: Callable[[Any, Any], object],  # its return value is not used
        at_cap: Callable[[], bool],
        in_flight: Callable[[], List[Any]],
        late: Optional[Callable[[Any, float], Optional[BaseException]]] = None,
        name: str = "gpuq-executor-feeder",
    ) -> None:
        self._send = send
        self._name = name
        self._at_cap = at_cap
        self._in_flight = in_flight
        self._late = late
        self._swept = 0.0  # when the tasks were last checked against late()
        # Reentrant: a send may finish other futures (making room), whose done-callbacks may
        # submit again from this thread.
        self._lock = threading.RLock()
        self._more = threading.Condition(self._lock)
        self._tasks: Deque[Tuple[Any, Any]] = collections.deque()
        self._feeder: Optional[threading.Thread] = None
        self._idle = threading.Condition(self._lock)  # told when the backlog empties

    def __len__(self) -> int:
        return len(self._tasks)

    def add(self, future: Any, task: Any) -> None:
        """Queues ``task`` with its ``future`` (made with no job; it gets ``_queue``)."""
        future._queue = self
        with self._lock:
            self._tasks.append((future, task))
            if self._feeder is None:
                self._feeder = threading.Thread(target=self._feed, name=self._name, daemon=True)
                self._feeder.start()
            self._more.notify()

    def cancel(self, future: Any) -> bool:
        """Removes ``future``'s task if it is still here and ends the future cancelled."""
        with self._lock:
            for i, (f, _) in enumerate(self._tasks):
                if f is future:
                    del self._tasks[i]
                    if not self._tasks:
                        self._idle.notify_all()
                    break
            else:
                return False
        future._end(
            "CANCELLED_AND_NOTIFIED",
            None,
            _errors.Cancelled("cancelled before it reached the daemon"),
            None,
        )
        return True

    def cancel_all(self) -> int:
        """Cancels every task still here (shutdown(cancel_futures=True)); how many."""
        with self._lock:
            tasks = list(self._tasks)
            self._tasks.clear()
            self._idle.notify_all()
        for f, _ in tasks:
            f._end(
                "CANCELLED_AND_NOTIFIED",
                None,
                _errors.Cancelled("cancelled at the executor's shutdown"),
                None,
            )
        return len(tasks)

    def wait_empty(self) -> None:
        """Returns once every task has been handed to the daemon (or cancelled or failed)."""
        with self._lock:
            while self._tasks:
                self._idle.wait(0.1)

    def _sweep_locked(self, failed: List[Tuple[Any, BaseException]]) -> None:
        """Takes the tasks that may not wait any longer (late()) out, into ``failed``; at most
        every _SWEEP_S, so a long backlog costs little."""
        now = time.monotonic()
        if now - self._swept < _SWEEP_S:
            return
        self._swept = now
        assert self._late is not None
        kept: Deque[Tuple[Any, Any]] = collections.deque()
        for future, task in self._tasks:
            e = self._late(task, now)
            if e is None:
                kept.append((future, task))
            else:
                failed.append((future, e))
        if len(kept) != len(self._tasks):
            self._tasks = kept

    def _feed(self) -> None:
        while True:
            failed: List[Tuple[Any, BaseException]] = []
            with self._lock:
                while not self._tasks:
                    if not self._more.wait(5.0) and not self._tasks:
                        self._feeder = None  # idle: the next add() starts a new thread
                        return
                while self._tasks and not self._at_cap():
                    future, task = self._tasks.popleft()
                    try:
                        # Under the lock, so that cancel() finds each task either here or with
                        # its job; the send never waits (try_submit, no wait for room).
                        self._send(future, task)
                    except (_errors.QueueFull, _errors.OutOfMemory) as e:
                        if isinstance(e, _errors.OutOfMemory) and not self._in_flight():
                            # Nothing of ours can make room: the task cannot fit at all.
                            failed.append((future, e))
                            continue
                        self._tasks.appendleft((future, task))
                        break
                    except BaseException as e:  # noqa: BLE001 - the task's failure
                        failed.append((future, e))
                    # Not kept by this frame: a caller that dropped its future frees it and
                    # its result (concurrent.futures' map relies on it).
                    future = task = None
                if self._late is not None and self._tasks:
                    self._sweep_locked(failed)
                empty = not self._tasks
                if empty:
                    self._idle.notify_all()
                jobs = [] if empty else self._in_flight()
            for future, error in failed:  # outside the lock: a failure runs done-callbacks
                future._fail(error)
            failed = future = task = error = None  # type: ignore[assignment]
            if empty:
                continue
            # No room (or at max_workers): sleep until one of ours ends, or a little while.
            try:
                if jobs:
                    _native.Job.wait_any(jobs[:64], _RETRY_NS, False)
                else:
                    time.sleep(_RETRY_NS / 1e9)
            except _errors.Error:
                time.sleep(_RETRY_NS / 1e9)
