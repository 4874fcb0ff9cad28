"""Results larger than their task's answer room: spilled by the worker, fetched in pieces.

An Executor task's answer room is sized before the task runs (its arguments' array bytes plus
64 KiB by default), and its result's size is known only once it has run. When the pickled
result does not fit, the worker does not fail the task: it writes the result's bytes to a
file of its own (``store``), in a folder only the daemon's user can enter (``/dev/shm`` when
there is one), and answers with the file's name (a random token) and the parts' sizes. The
caller then fetches the bytes in pieces of at most ``PIECE_BYTES``, each a small job of the same
pool (``kFlagFetchSpilled``, ``read_piece``) whose answer lands in the caller's segment as any
answer does; the piece that ends the file deletes it. The caller's future stays pending through
the pieces (``gpuq._future.Continue``), and ends with the result unpickled from them.

A file whose caller never fetched it (a caller that died, a future cancelled mid-fetch) is
deleted by the next ``store`` of any worker once it is ``STALE_S`` old.
"""

from __future__ import annotations

import os
import re
import secrets
import stat
import tempfile
import time
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

PIECE_BYTES = 8 << 20  # at most this much of a spilled result per fetch job
STALE_S = 3600.0  # a spilled result nobody fetched within this is deleted
_TOKEN = re.compile(r"[0-9a-f]{32}")
_stores = 0


def folder() -> str:
    """The spill folder of this user (made mode 0700 on first use; refused if someone else
    owns it or may enter it)."""
    base = (
        "/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir()
    )
    path = os.path.join(base, f"gpuq-spill-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise OSError(
            f"{path}: not a folder of this user's alone (mode {st.st_mode:o}); "
            "remove it and run again"
        )
    return path


def _path(token: str) -> str:
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise ValueError(f"not a spilled result's token: {token!r}")
    return os.path.join(folder(), token)


def store(arrays: Sequence[np.ndarray]) -> Tuple[str, List[int]]:
    """Writes ``arrays``' bytes, one after another, to a new file; (its token, their sizes)."""
    global _stores
    _stores += 1
    if _stores % 64 == 1:
        sweep()
    token = secrets.token_hex(16)
    fd = os.open(os.path.join(folder(), token), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            for a in arrays:
                f.write(np.ascontiguousarray(a).data.cast("B"))
    except BaseException:
        try:
            os.unlink(os.path.join(folder(), token))
        except OSError:
            pass
        raise
    return token, [int(a.nbytes) for a in arrays]


def read_piece(token: str, offset: int, length: int, last: bool) -> np.ndarray:
    """Bytes [offset, offset + length) of a spilled result (a uint8 array); ``last``: the file
    is deleted after."""
    path = _path(token)
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(length)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the spilled result {token} is gone (fetched already, or "
            f"deleted after {STALE_S:.0f} s unfetched)"
        ) from None
    if len(data) != length:
        raise ValueError(
            f"the spilled result {token} holds fewer bytes than asked ({offset} + {length})"
        )
    if last:
        os.unlink(path)
    return np.frombuffer(data, dtype=np.uint8)


def discard(token: str) -> None:
    """Deletes a spilled result nobody will fetch."""
    try:
        os.unlink(_path(token))
    except FileNotFoundError:
        pass


def sweep(now: float = 0.0) -> int:
    """Deletes this user's spilled results older than STALE_S; how many."""
    gone = 0
    now = now or time.time()
    try:
        d = folder()
        for name in os.listdir(d):
            p = os.path.join(d, name)
            try:
                if _TOKEN.fullmatch(name) and now - os.stat(p).st_mtime > STALE_S:
                    os.unlink(p)
                    gone += 1
            except OSError:
                pass
    except OSError:
        pass
    return gone


class Fetch:
    """The caller's side: the pieces of one spilled result, fetched one job at a time, then the
    result unpickled from them (``pickle.loads`` of the first part with the rest as its
    out-of-band buffers)."""

    def __init__(self, header: Dict[str, Any]) -> None:
        token, sizes = header.get("spill"), header.get("sizes")
        if (
            not isinstance(token, str)
            or not isinstance(sizes, list)
            or not sizes
            or not all(type(s) is int and s >= 0 for s in sizes)
        ):
            raise ValueError(
                "the worker's answer is malformed (a spilled result without its token or sizes)"
            )
        self.token = token
        self.sizes = sizes
        self.total = sum(sizes)
        self.data = bytearray(self.total)
        self.offset = 0

    def next_piece(self) -> Tuple[int, int, bool]:
        """(offset, length, last) of the next piece to fetch."""
        length = min(PIECE_BYTES, self.total - self.offset)
        return self.offset, length, self.offset + length >= self.total

    def take(self, piece: np.ndarray) -> bool:
        """Keeps a fetched piece; whether the result is whole."""
        n = int(piece.nbytes)
        if n != self.next_piece()[1]:
            raise ValueError(
                f"a piece of the spilled result {self.token} has {n} bytes, not "
                f"{self.next_piece()[1]}"
            )
        self.data[self.offset : self.offset + n] = piece.data.cast("B")
        self.offset += n
        return self.offset >= self.total

    def result(self) -> Any:
        import pickle

        view = memoryview(self.data)
        parts, at = [], 0
        for s in self.sizes:
            parts.append(view[at : at + s])
            at += s
        return pickle.loads(parts[0], buffers=parts[1:])
