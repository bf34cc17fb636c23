"""Live diagnosis while training writes the trace: the same rules, run off the training thread.

A daemon thread re-reads the trace (a second, read-only SQLite connection, kept open; WAL lets it read while the
writer writes) whenever new steps were committed, runs the rules (``diagnose``: handed in by ``ampdoctor.attach``, so
that the training side never imports them) and reports each new finding once: one line through ``logging``, the
``on_finding`` callback, and, at or above ``halt_on``, a request that the Doctor raises
``TrainingHalted`` at the next step boundary. Torch-free: it only reads the file.

Its share of the machine is bounded in CPU time, not wall time: every check's CPU time (time.thread_time: what it
took from training, however long it waited for a core) is added up, and the next check starts only once the checks so
far plus the next one's expected cost (the last one's, grown with the trace) stay within MAX_SHARE of the time
training has run. A wide model's trace makes each check costly; the checks then come less often, never more of the
run.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from ..severity import at_least
from ..trace import load

log = logging.getLogger("ampdoctor")

MIN_INTERVAL_S = 5.0  # how often to look at most: a broken run is stopped within seconds, not hours
MAX_SHARE = 0.02  # the checks' CPU time stays within ~2% of the run's time (on a 2-core machine the rules compete
# with training for the cores, and hold the GIL while they run Python)
GROWTH = 1.5  # the next check reads a longer trace: its cost expected at this much the last one's
MAX_ERRORS = 3  # consecutive failed checks before live diagnosis gives up


class TrainingHalted(RuntimeError):
    """Raised at a step boundary when a live finding reached the ``halt_on`` severity."""

    def __init__(self, finding: Any) -> None:  # a Diagnosis (collect/ never imports the rules)
        self.finding = finding
        layer = f" in {finding.layers[0]}" if finding.layers else ""
        super().__init__(f"ampdoctor halted training: {finding.severity} {finding.rule}{layer}: {finding.summary}")


def finding_line(f: Any) -> str:
    """One line: severity, rule id, layer, fix (the first line of its fix's first part)."""
    layer = f" [{f.layers[0]}]" if f.layers else ""
    fix = next((ln.strip() for part in f.fix for ln in part.text.splitlines() if ln.strip()), "")
    return f"ampdoctor: {f.severity} {f.rule}{layer}: {f.summary}" + (f" Fix: {fix}" if fix else "")


class LiveDiagnosis(threading.Thread):
    def __init__(
        self,
        path: str,
        diagnose: Callable[..., Any],
        on_finding: Callable[[Any], object] | None = None,
        halt_on: str | None = None,
        rules: dict[str, Any] | None = None,
        interval: float = MIN_INTERVAL_S,
        share: float = MAX_SHARE,
        load: Callable[[], object] | None = None,
    ) -> None:
        super().__init__(name="ampdoctor-live", daemon=True)
        self.path = path
        self.diagnose = diagnose  # (trace, rules=...) -> findings worst first
        self.on_finding = on_finding
        self.halt_on = halt_on
        self.rules = rules
        self.interval = interval
        self.share = min(share, MAX_SHARE)  # the checks' CPU time as a share of the run's (an overhead budget's part)
        # Imports the rules (and pandas) when the thread starts, beside the run's first steps: a one-off cost, as the
        # native kernels' load is, not charged to the checks' share (its CPU seconds: load_cost). Left to the first
        # check, it made that check cost 4x the next ones (0.8 s against 0.2 s of CPU on a 4,000-step trace) and
        # landed seconds into training.
        self.load = load
        self.load_cost = 0.0
        self.loaded = threading.Event()  # the rules are imported (or the import failed: the first check says so)
        self.halt = None  # the finding that asks to stop training
        self.findings: list[Any] = []  # every finding reported so far, in order
        self._reported: set[Any] = set()
        self._last_steps = -1
        self._stop_event = threading.Event()
        self._failed = False
        self._errors = 0
        self._trace: Any = None  # the Trace, kept open between checks
        self.spent = 0.0  # CPU seconds the checks took so far
        self.checks = 0  # checks that diagnosed the trace
        self.first_cost = 0.0  # CPU seconds of the first of them
        self._last_cost = 0.0

    def run(self) -> None:
        start = time.perf_counter()
        if self.load is not None:
            c0 = time.thread_time()
            try:
                self.load()
            except Exception:  # the first check fails the same way, and warns
                pass
            self.load_cost = time.thread_time() - c0
        self.loaded.set()
        wait = self.interval
        while not self._stop_event.wait(wait):
            c0 = time.thread_time()
            diagnosed = self.check()
            self._last_cost = time.thread_time() - c0
            self.spent += self._last_cost
            if diagnosed:
                self.checks += 1
                self.first_cost = self.first_cost or self._last_cost
            wait = self.next_wait(time.perf_counter() - start)
        self._close()

    def next_wait(self, elapsed: float) -> float:
        """Seconds until the next check: at least the interval, and long enough that the checks' CPU time so far plus
        the next one's expected cost stay within ``share`` (MAX_SHARE, or less under a budget) of the run's time."""
        due = (self.spent + GROWTH * self._last_cost) / self.share  # the run's time at which that share holds
        return max(self.interval, due - elapsed)

    def _close(self) -> None:
        if self._trace is not None:
            try:
                self._trace.close()
            except Exception:  # closing a read-only connection: nothing to report
                pass
            self._trace = None

    def stop(self) -> None:
        """No check at the end: the run is over, `ampdoctor diagnose` reads the finished trace."""
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=60)

    def check(self) -> bool:
        """Diagnose the trace as it stands and report what is new (False: nothing new to diagnose); never raises."""
        if self._failed:
            return False
        try:
            if self._trace is None:
                self._trace = load(self.path)
            n = self._trace.n_steps
            if n == self._last_steps or n == 0:
                return False
            self._last_steps = n
            found = self.diagnose(self._trace, rules=self.rules)
        except Exception as exc:  # never break training: say it once; stop looking if it keeps failing
            self._close()  # opened afresh next time
            self._errors += 1
            if self._errors == 1:
                warnings.warn(
                    f"ampdoctor: live diagnosis failed ({type(exc).__name__}: {exc}); training continues",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if self._errors >= MAX_ERRORS:
                self._failed = True
            return True
        self._errors = 0
        for f in found:
            key = (f.rule, tuple(f.layers[:1]))
            if key in self._reported:
                continue
            self._reported.add(key)
            self.findings.append(f)
            log.log(logging.WARNING if f.severity != "info" else logging.INFO, finding_line(f))
            if self.on_finding is not None:
                try:
                    self.on_finding(f)
                except Exception as exc:
                    warnings.warn(
                        f"ampdoctor: on_finding callback raised {type(exc).__name__}: {exc}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
            if self.halt_on is not None and self.halt is None and at_least(f.severity, self.halt_on):
                self.halt = f
        return True
