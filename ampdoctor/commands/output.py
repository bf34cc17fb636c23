"""Where a command writes a file: never over one of its inputs or over any trace, and never half-written.

A report is written to a temporary file next to its destination and renamed over it once complete (a full disk,
a read-only file system or Ctrl+C leaves the old file as it was, and no partial one). The destination is refused
when it is one of the command's inputs (the same file under any name: symbolic and hard links alike), when it is
a SQLite database or a SQLite side file (-wal, -shm, -journal) of one, told by its content and not by its name,
and when it is not a regular file (a directory, ``/dev/full``, a FIFO).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator

from ..trace.files import SIDE_FILES, SQLITE_MAGIC
from .common import UsageError

_WAL_MAGIC = (b"\x37\x7f\x06\x82", b"\x37\x7f\x06\x83")  # a SQLite WAL file's first 4 bytes (either byte order)


def _head(path: str, n: int) -> bytes:
    """The first ``n`` bytes of a regular file (b"" when it cannot be read); never blocks on a FIFO."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return b""
    try:
        return os.read(fd, n) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return b""
    finally:
        os.close(fd)


def is_database(path: str) -> bool:
    """``path`` holds a SQLite database or a SQLite WAL (a trace, or a part of one), by its first bytes."""
    head = _head(path, len(SQLITE_MAGIC))
    return head.startswith(SQLITE_MAGIC) or head[:4] in _WAL_MAGIC


def _side_of_database(path: str) -> str | None:
    """The database ``path`` is the -wal/-shm/-journal file of (whether or not that side file exists yet)."""
    for side in SIDE_FILES:
        if path.endswith(side) and is_database(path[: -len(side)]):
            return path[: -len(side)]
    return None


def _same(a: str, b: str) -> bool:
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def check_output(out: str, inputs: Iterable[str], command: str, default: bool = False) -> str:
    """The real path a command may write ``out`` to; a UsageError (one line, exit 2) when it may not: empty, a
    directory, not a regular file, in a missing directory, one of ``inputs``, or a database or part of one.
    ``default``: ``out`` is the name the command chose (said so in the message)."""
    where = f"ampdoctor {command}"
    named = f"the default output {out}" if default else f"the output {out}"
    if not out:
        raise UsageError(f"{where}: the output file name is empty")
    real = os.path.realpath(out)  # a symbolic link is followed: the file it names is replaced, the link stays
    for path in inputs:
        if _same(out, path):
            raise UsageError(
                f"{where}: {named} is the input {path}; ampdoctor never writes over its input (give another -o)"
            )
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UsageError(f"{where}: cannot use {out} as the output ({exc.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{where}: {named} is a directory; give a file name (-o DIR/report.html)")
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{where}: {named} is not a regular file (a device, FIFO or socket)")
    if st is not None and is_database(real):
        raise UsageError(
            f"{where}: {named} is a SQLite database (a trace?); ampdoctor never writes over one (give another -o)"
        )
    db = _side_of_database(real)
    if db is not None:
        raise UsageError(f"{where}: {named} is SQLite's side file of the database {db}; give another -o")
    parent = os.path.dirname(real)
    if not os.path.isdir(parent):
        raise UsageError(f"{where}: {os.path.dirname(os.path.abspath(out))}: no such directory for the output")
    return real


@contextlib.contextmanager
def atomic_write(real: str, out: str, command: str) -> Iterator[str]:
    """A temporary file next to ``real`` to write the whole output into; renamed over ``real`` when the block ends
    without an error, removed when it raises. An OSError (disk full, read-only file system, no permission)
    becomes a UsageError naming ``out``; ``real`` is then exactly as it was."""
    where = f"ampdoctor {command}"
    parent, name = os.path.split(real)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise UsageError(f"{where}: cannot write {out} ({exc.strerror})") from None
    try:
        try:
            os.fchmod(fd, _mode(real))
        finally:
            os.close(fd)
        yield tmp
        with open(tmp, "rb") as f:  # on the disk before the rename, so a crash leaves the old file or the new one
            os.fsync(f.fileno())
        if os.path.lexists(real) and (is_database(real) or not os.path.isfile(real)):
            raise UsageError(f"{where}: {out} became a database or a special file while the report was written")
        os.replace(tmp, real)
    except OSError as exc:
        raise UsageError(f"{where}: cannot write {out} ({exc.strerror or exc})") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _mode(path: str) -> int:
    """The permissions a replaced file keeps; a new file gets what open() would give it (0o666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
