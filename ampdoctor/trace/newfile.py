"""A new trace file: a name nobody else holds, created exclusively, laid out empty. ampdoctor never overwrites a
trace (or what a killed run left next to one)."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterator

from . import schema


def free_names(path: str) -> Iterator[str]:
    """``path``, then ``path`` with -1, -2, ... before the extension: the names a new trace may take."""
    yield path
    stem, ext = os.path.splitext(path)
    i = 1
    while True:
        yield f"{stem}-{i}{ext}"
        i += 1


def _taken(path: str) -> bool:
    """A trace, or what a killed one left next to its name (its -wal holds committed steps), is there."""
    return any(os.path.lexists(path + suffix) for suffix in ("", "-wal", "-shm"))


def _create(path: str) -> bool:
    """Create ``path`` empty, exclusively: O_EXCL makes the existence check and the creation one step, so of two
    processes asking for one name exactly one gets it. False when the name is taken."""
    if _taken(path):
        return False
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def claim(path: str, free_name: bool) -> str:
    """Create the trace file of this process (exclusively) and return its name."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    for name in free_names(path) if free_name else (path,):
        if _create(name):
            return name
    raise FileExistsError(f"{path} exists; ampdoctor never overwrites a trace")


def open_new(path: str) -> sqlite3.Connection:
    """Lay out the trace in the empty file this process created; on failure remove that file and the -wal/-shm
    SQLite made next to it (they cannot be another process's: the name was free and is ours), nothing else."""
    conn = None
    try:
        conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        schema.create(conn)
    except BaseException:
        if conn is not None:
            conn.close()
        for suffix in ("", "-wal", "-shm"):
            try:
                os.remove(path + suffix)
            except OSError:
                pass
        raise
    return conn
