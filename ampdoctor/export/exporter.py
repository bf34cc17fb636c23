"""The exporter: a trace's new steps and findings to sinks. One code path for live export (a thread, or a
framework's log event, calls ``poll``) and ``ampdoctor export`` (one ``close`` over a finished trace). Offline side:
it reads the file, never the training; no torch import.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Callable

from . import text as T
from .rows import StepRows
from .sinks import Sink

MIN_INTERVAL_S = 2.0  # a live export polls the trace at most this often (one small query)
MAX_SHARE = 0.01  # and spends at most ~1% of the time on it (the interval grows with a poll's cost)


class Exporter:
    """Sends the trace ``path``'s steps to ``sinks`` as they are committed, and the findings ``findings()`` returns
    (e.g. the live diagnosis's, ``lambda: doctor.findings``) as they appear; at ``close`` a last poll and, with
    ``diagnose_at_close``, the rules over the finished trace (a short run ends before the live diagnosis looked)."""

    def __init__(
        self,
        path: str,
        sinks: list[Sink],
        *,
        findings: Callable[[], list] | None = None,
        diagnose_at_close: bool = True,
        rules: dict | None = None,
    ):
        self.path = path
        self.sinks = list(sinks)
        self._source = findings
        self.diagnose_at_close = diagnose_at_close
        self.rules = rules
        self._rows: StepRows | None = None
        self._reported: set = set()
        self.findings: list = []  # every finding exported, in order
        self.steps = 0  # steps read so far
        self._closed = False

    @property
    def last_step(self) -> int:
        return self._rows.last if self._rows is not None else -1

    def poll(self) -> int:
        """Export the steps committed since the last poll and any new finding; the number of steps read."""
        if self._rows is None:
            self._rows = StepRows(self.path)
        n = 0
        for page in self._rows.read_all():
            n += len(page)
            for sink in self.sinks:
                chosen = [p for p in page if sink.wants(p)]
                if chosen:
                    sink.write(chosen)
        self.steps += n
        if self._source is not None:
            self._report(self._source())
        if n:
            for sink in self.sinks:
                sink.flush()
        return n

    def _report(self, found: list) -> None:
        new = []
        for d in found:
            k = T.key(d)
            if k not in self._reported:
                self._reported.add(k)
                new.append(d)
        if new:
            self.findings.extend(new)
            for sink in self.sinks:
                sink.findings(new, list(self.findings), max(self.last_step, 0))

    def close(self) -> None:
        """The last steps, the findings of the whole trace, and every sink closed (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.poll()
            if self.diagnose_at_close and self.steps:
                from ..rules import diagnose

                self._report(diagnose(self.path, rules=self.rules))
        finally:
            for sink in self.sinks:
                sink.close()
            if self._rows is not None:
                self._rows.close()


class LiveExport(threading.Thread):
    """Polls an Exporter off the training thread while training writes the trace. A failure (a sink that raises)
    warns once and stops the export; training never sees it."""

    def __init__(self, exporter: Exporter, interval: float = MIN_INTERVAL_S):
        super().__init__(name="ampdoctor-export", daemon=True)
        self.exporter = exporter
        self.interval = interval
        self._stop_event = threading.Event()
        self.failed: BaseException | None = None

    def run(self) -> None:
        wait = self.interval
        while not self._stop_event.wait(wait):
            t0 = time.perf_counter()
            if not self._guard(self.exporter.poll):
                return
            wait = max(self.interval, (time.perf_counter() - t0) / MAX_SHARE)

    def _guard(self, fn: Callable[[], object]) -> bool:
        if self.failed is not None:
            return False
        try:
            fn()
            return True
        except Exception as exc:
            self.failed = exc
            warnings.warn(
                f"ampdoctor: export stopped ({type(exc).__name__}: {exc}); training continues, the trace has it all",
                RuntimeWarning,
                stacklevel=2,
            )
            return False

    def close(self) -> None:
        """Stop polling, then the last steps and findings (call after the trace's writer closed)."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=60)
        if self.failed is None:
            self._guard(self.exporter.close)
        else:
            for sink in self.exporter.sinks:
                try:
                    sink.close()
                except Exception:
                    pass
