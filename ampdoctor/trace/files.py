"""Opening a trace file safely, before anything reads its tables. Offline side: no torch import.

Only regular files are opened (a FIFO, socket or device, even as the -wal/-shm/-journal file next to a trace, would
block SQLite), the header and size are checked before SQLite sees the file, and the connection is read-only: in
place, or on a private copy when a WAL cannot be read where it lies.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import stat
import tempfile
import urllib.parse
import weakref
from collections.abc import Callable

from .schema import TraceError

SQLITE_MAGIC = b"SQLite format 3\x00"
SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite's own files next to a database


def read_head(path: str, n: int = 100) -> bytes:
    """The first bytes of a regular file. Opened non-blocking and checked with fstat: a FIFO (or device, socket)
    is refused instead of blocking the reader forever."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TraceError(f"{path}: not a regular file, not a trace")
        return os.read(fd, n)
    finally:
        os.close(fd)


def check_file(path: str) -> None:
    """A one-line TraceError unless ``path`` is a whole SQLite file: missing, a directory, not regular (itself or
    its side files), empty, foreign or cut short."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    if stat.S_ISDIR(st.st_mode):
        raise TraceError(f"{path}: is a directory, not a trace file")
    if not stat.S_ISREG(st.st_mode):
        raise TraceError(f"{path}: not a regular file (a FIFO, socket or device), not a trace")
    for side in SIDE_FILES:  # SQLite opens these too: a FIFO there would block it
        if os.path.lexists(path + side) and not os.path.isfile(path + side):
            raise TraceError(f"{path}: {os.path.basename(path + side)} next to it is not a regular file")
    size = st.st_size
    if size == 0:
        raise TraceError(f"{path}: empty file (0 bytes), not an ampdoctor trace")
    try:
        head = read_head(path)
    except OSError as exc:
        raise TraceError(f"{path}: cannot read ({exc.strerror})") from None
    if not head.startswith(SQLITE_MAGIC):
        raise TraceError(f"{path}: not an ampdoctor trace (not a SQLite database)")
    if len(head) < 100:
        raise TraceError(f"{path}: truncated trace ({size} bytes, shorter than a SQLite header)")
    page_size = int.from_bytes(head[16:18], "big")
    page_size = 65536 if page_size == 1 else page_size
    if page_size and size % page_size:
        raise TraceError(
            f"{path}: truncated or corrupt trace ({size} bytes is not a whole number of {page_size}-byte pages)"
        )


def _uri(path: str) -> str:
    """The ``file:`` URI of a path: every byte that is not plain is %-escaped (SQLite decodes the path), so a file
    named ``%2E%2E%2Foutside.db`` or ``lr 1e-3?.db`` opens that very file."""
    return "file:" + urllib.parse.quote(os.path.abspath(path), safe="/")


def _ids(conn: sqlite3.Connection) -> tuple[int, int]:
    return conn.execute("PRAGMA application_id").fetchone()[0], conn.execute("PRAGMA user_version").fetchone()[0]


class _CopyConnection(sqlite3.Connection):
    """A connection to a private copy of a trace; closing it (or dropping it) removes the copy."""

    removes: Callable[[], object] | None = None

    def close(self) -> None:
        super().close()
        if self.removes is not None:
            self.removes()


def connect(path: str) -> tuple[sqlite3.Connection, int, int]:
    """Read-only connection: (conn, application id, format version).

    A WAL reader needs the -shm file next to the trace. In a read-only directory SQLite reads the WAL only through
    an -shm that is already there (a killed run leaves one); when there is none and the WAL holds data (a killed run
    whose -shm was not copied along), the trace and its WAL are copied to a private temporary directory and read
    there (SQLite cannot read a WAL without an -shm it can create, and ``immutable=1`` would silently drop the steps
    still in the WAL); without a WAL, ``immutable=1`` reads the file in place."""
    try:
        conn = sqlite3.connect(f"{_uri(path)}?mode=ro", uri=True, check_same_thread=False)
        return (conn, *_ids(conn))
    except sqlite3.OperationalError:
        if os.access(os.path.dirname(os.path.abspath(path)), os.W_OK) and not os.path.exists(path + "-shm"):
            raise
    wal = path + "-wal"
    if os.path.exists(wal) and os.path.getsize(wal) > 0:
        tmp = tempfile.mkdtemp(prefix="ampdoctor-")
        copy = os.path.join(tmp, "trace.db")
        shutil.copyfile(path, copy)
        shutil.copyfile(wal, copy + "-wal")
        conn = sqlite3.connect(f"{_uri(copy)}?mode=ro", uri=True, check_same_thread=False, factory=_CopyConnection)
        conn.removes = weakref.finalize(conn, shutil.rmtree, tmp, True)
    else:
        conn = sqlite3.connect(f"{_uri(path)}?immutable=1", uri=True, check_same_thread=False)
    return (conn, *_ids(conn))
