"""Work a view needs that can take longer than a request (a diagnosis, a run's step summary, a long heat map):
run in the background, once per (run, what, version of the trace), while the page shows what it has and says what
is being computed and for how long ("diagnosing: 3 s"). No dash here."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable


@dataclass
class State:
    """What a view knows of one job: its latest value (``None`` before the first result, else possibly of an
    earlier version), whether that value is current, since when the current version is being computed, and the
    error of the last attempt."""

    value: Any = None
    current: bool = False
    since: float | None = None  # time.monotonic() when the running job started
    error: str | None = None
    version: object = None

    @property
    def running(self) -> bool:
        return self.since is not None

    def elapsed(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since


class Failed(Exception):
    """A job that failed and says why in its message (shown as is, without the exception's type)."""


class Jobs:
    """A small pool of background workers and the latest result of every job, by key."""

    def __init__(self, workers: int = 2, on_done: Any = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ampdoctor-view")
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified whenever ``generation`` is bumped
        self._state: dict[Any, State] = {}  # key -> State
        self._futures: dict[Any, tuple[Any, Future[None]]] = {}  # key -> (version, Future)
        self._on_done = on_done  # called with the key when a job ends (the views poll for it)
        self.generation = 0  # bumped whenever a job ends

    def get(self, key: Any, version: Any, fn: Callable[[], Any], wait: float = 0.0) -> State:
        """The state of job ``key`` at ``version``; starts ``fn()`` in the background when that version has not
        been computed and is not being computed. Waits up to ``wait`` seconds for it first (a quick job then
        shows at once, with no "computing" flash)."""
        with self._lock:
            st = self._state.setdefault(key, State())
            running = self._futures.get(key)
            done = st.version == version and (st.current or st.error is not None)
            if not done and running is None:  # one job per key at a time; a newer version starts when it ends
                fut = self._pool.submit(self._run, key, version, fn)
                self._futures[key] = (version, fut)
                st.since = time.monotonic()
                running = (version, fut)
        if wait > 0 and running is not None and running[0] == version:
            try:
                running[1].result(timeout=wait)
            except Exception:  # a timeout, or the job's own error (recorded in its state)
                pass
        with self._lock:
            st = self._state[key]
            return State(st.value, st.current and st.version == version, st.since, st.error, st.version)

    def touch(self) -> None:
        """A job's partial result arrived: the views that show it redraw (as when a job ends)."""
        with self._lock:
            self.generation += 1
            self._changed.notify_all()

    def wait_change(self, generation: int, timeout: float) -> int:
        """Wait up to ``timeout`` s for a job to end or a partial result to arrive after ``generation`` (a value of
        ``generation`` read before); the generation then."""
        with self._lock:
            if timeout > 0 and self.generation == generation:
                self._changed.wait(timeout)
            return self.generation

    def peek(self, key: Any) -> State | None:
        with self._lock:
            st = self._state.get(key)
            return None if st is None else State(st.value, st.current, st.since, st.error, st.version)

    def _run(self, key: Any, version: Any, fn: Callable[[], Any]) -> None:
        try:
            value, error = fn(), None
        except Failed as exc:
            value, error = None, str(exc)
        except Exception as exc:
            value, error = None, f"{type(exc).__name__}: {exc}"
        with self._lock:
            st = self._state.setdefault(key, State())
            st.version = version
            st.since = None
            st.error = error
            if error is None:
                st.value, st.current = value, True
            else:
                st.current = False
            self._futures.pop(key, None)
            self.generation += 1
            self._changed.notify_all()
        if self._on_done is not None:
            self._on_done(key)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
