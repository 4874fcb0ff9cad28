"""A step op's sequences in its worker (docs/python.md "Step-level batching",
docs/design/streams.md): the state each live sequence's ``start`` made, kept by the key the
worker's step runner gave it, each step's one call of the op's ``step`` for the sequences that
take it, and where each part goes: a stream's into its next part cell at once, a ``call()``'s
into a list written as its answer when the sequence ends.

The C++ step runner (daemon/worker/step_runner.cpp) decides which sequences take a step, and
when one leaves early (cancelled, its time limit, its reader gone); this module only runs the
functions and writes what they make."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from . import _answers, _errors
from ._answers import ResultTooLarge
from ._ops import StepFunctions

Started = Tuple[int, str, int]  # (code, message, bytes of its failure record)
Stepped = Tuple[int, str, int, bool]  # (code, message, bytes written, done)
Failed = Callable[[str, BaseException, memoryview], Tuple[int, str, int, int]]


class _Sequence:
    __slots__ = ("state", "parts", "sent")

    def __init__(self, state: Any) -> None:
        self.state = state
        self.parts: List[Any] = []  # a call()'s parts so far (a stream's are sent at once)
        self.sent = 0  # a stream's parts sent


class Sequences:
    """The live sequences of this worker's step ops. ``failed`` makes the failure record of an
    exception (Runtime._failed)."""

    def __init__(self, failed: Failed) -> None:
        self.live: Dict[int, _Sequence] = {}
        self._failed = failed

    def start(
        self, name: str, fns: StepFunctions, key: int, args: list, kwargs: dict, out: memoryview
    ) -> Started:
        """A job joins: its state from ``start(*args, **kwargs)``; a failure's record in ``out``."""
        try:
            state = fns.start(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the job's failure, reported
            code, msg, n, _ = self._failed(name, e, out)
            return (code, msg, n)
        self.live[key] = _Sequence(state)
        return (0, "", 0)

    def step(
        self,
        name: str,
        fns: StepFunctions,
        keys: List[int],
        cells: List[memoryview],
        streams: List[bool],
    ) -> List[Stepped]:
        """One step for the sequences ``keys``: one call of ``step`` with their states, then each
        one's part written into its cell (a stream's part cell; a call()'s output, once it ends).
        A failure of the call is each sequence's, its record in its cell."""
        seqs = [self.live[k] for k in keys]
        try:
            made = fns.step([s.state for s in seqs])
            results = _checked(name, made, len(seqs))
        except BaseException as e:  # noqa: BLE001 - the step's failure is each sequence's
            return [self._failure(name, e, cell) for cell in cells]
        finally:
            made = None
        out: List[Stepped] = []
        for seq, cell, streams_, (part, done) in zip(seqs, cells, streams, results):
            try:
                if streams_:
                    out.append((0, "", _answers.write_result(cell, part), done))
                    seq.sent += 1
                    continue
                seq.parts.append(part)
                n = _answers.write_result(cell, seq.parts) if done else 0
                out.append((0, "", n, done))
            except ResultTooLarge as e:
                if streams_:
                    e.part = seq.sent  # its cell was too small: the message names part_bytes
                n = _answers.write_error(cell, "gpuq.ResultTooLarge", str(e), "", needed=e.needed)
                out.append((_errors.InvalidArgument.code, f"{name}: {e}", n, True))
            except BaseException as e:  # noqa: BLE001 - a part that cannot be written
                out.append(self._failure(name, e, cell))
        return out

    def end(self, key: int) -> None:
        """The sequence left (its last step, or it stopped early): its state is dropped."""
        self.live.pop(key, None)

    def _failure(self, name: str, e: BaseException, cell: memoryview) -> Stepped:
        code, msg, n, _ = self._failed(name, e, cell)
        return (code, msg, n, True)


def _checked(name: str, made: Any, count: int) -> List[Tuple[Any, bool]]:
    """``step``'s result as ``count`` pairs (part, done), or a TypeError that says what it must
    return."""
    try:
        items = list(made)
    except TypeError:
        items = None
    if items is None or len(items) != count:
        got = f"{len(items)} results" if items is not None else type(made).__name__
        raise TypeError(
            f"{name}: step returned {got} for {count} states: it returns one (part, done) "
            "per state, in order"
        )
    pairs: List[Tuple[Any, bool]] = []
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise TypeError(
                f"{name}: step returned {type(item).__name__} {_short(item)} for a state: "
                "each result is a (part, done) pair"
            )
        pairs.append((item[0], bool(item[1])))
    return pairs


def _short(x: Any) -> str:
    r = repr(x)
    return r if len(r) <= 60 else r[:57] + "..."


def find(ops: Dict[str, Any], name: str) -> Optional[StepFunctions]:
    """The step op ``name``'s functions, if this pool has such a step op."""
    entry = ops.get(name)
    return entry[0] if entry is not None and isinstance(entry[0], StepFunctions) else None
