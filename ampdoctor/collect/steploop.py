"""A step's life on the training thread: it begins as the cadence plans it (a new StepState), and it ends where the
run's boundary is seen (boundary_hooks.py, or ``doctor.step()``): the step end closes it into a flight, the
flights judge it, the next step begins, the step's time is stamped and the overhead budget adjusts the cadence.
A halt the live rules asked for is raised into training after a step end."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any

from ..trace.messages import EventKind, EventMsg, MetaMsg
from ..trace.writer import Writer
from .anomaly import Capture
from .boundary import StepEnd
from .cadence import Budget, Cadence
from .collector import Collector
from .flights import Flights
from .guards import Guard, guarded
from .live import LiveDiagnosis, TrainingHalted
from .probe import StepProbe
from .state import RunFacts, StepState


class StepLoop:
    """Begins and ends the steps of one run. Given explicitly what a step end touches: the collector (whose step it
    is), the step end, the flights, the cadence and the budget (None without budget=), the capture of the root calls
    and the probe (None without them), the run's facts, the writer, the run's configuration (written once, after the
    first step), and the live rules (None with live=False) with the callback that takes their halt."""

    def __init__(
        self,
        guard: Guard,
        collector: Collector,
        end: StepEnd,
        flights: Flights,
        cadence: Cadence,
        facts: RunFacts,
        writer: Writer,
        *,
        budget: Budget | None,
        capture: Capture | None,
        probe: StepProbe | None,
        config: Callable[[], dict[str, Any]],
        live: LiveDiagnosis | None,
        on_halt: Callable[[Any], object] | None,
    ) -> None:
        self.guard = guard
        self.collector = collector
        self.end = end
        self.flights = flights
        self.cadence = cadence
        self.facts = facts
        self.writer = writer
        self.put = writer.put
        self.budget = budget
        self.capture = capture
        self.probe = probe
        self.config = config
        self.live = live
        self.on_halt = on_halt
        self.configured = False  # the run's configuration is in the trace (written after the first step)
        self._halted = False
        self.on_begin: Callable[[StepState], None] | None = None  # told of each new step (the lane: lane.py)

    def begin_step(self, index: int) -> None:
        """Step ``index`` starts: a new state as the cadence plans it."""
        observe, reason, store_hist = self.cadence.plan(index)
        state = StepState(index, observe, reason, store_hist, updates=self.facts.updates)
        self.collector.begin(state)
        if self.on_begin is not None:
            self.on_begin(state)

    def end_step(self, skipped: bool | None) -> None:
        """The step in progress ended (``skipped``: the optimizer did not apply it; None: read from the loss scale).
        Not guarded as a whole: the live rules' halt is raised into training from here, on purpose."""
        if self.guard.off:
            return
        self._finish(skipped)
        self.after_step()

    def after_step(self) -> None:
        """After a step end (this one's, or the lane's): the halt the live rules asked for, once."""
        live = self.live
        if live is not None and live.halt is not None and not self._halted:
            self._halted = True  # asked once: a loop that catches TrainingHalted may go on
            if self.on_halt is None:
                raise TrainingHalted(live.halt)
            try:
                self.on_halt(live.halt)
            except Exception as exc:
                warnings.warn(
                    f"ampdoctor: on_halt callback raised {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3
                )

    @guarded(timed=False)  # timed inside: the step's observer_time ends with its row
    def _finish(self, skipped: bool | None) -> None:
        if self.writer.error is not None:
            raise RuntimeError(f"trace writer failed: {self.writer.error}")
        t0 = time.perf_counter()
        state, facts = self.collector.state, self.facts
        flight = self.end.close(state, skipped, facts.step_starts, facts.device)
        if self.capture is not None:
            flight.calls, flight.batch_ids = self.capture.take()
        flight.updates = state.updates
        self.flights.add(flight)
        if self.probe is not None:
            self.probe.end(state.index)
        if not self.configured:
            self.put(MetaMsg("config", self.config()))
            self.configured = True
        self.begin_step(state.index + 1)
        row = flight.row
        self.end.stamp(row, self.guard.take_time() + (time.perf_counter() - t0))
        self.budget_step(state.index, row["observer_time"], row["step_time"], row["reason"])

    def budget_step(self, step: int, observer_time: float, step_time: float, reason: str) -> None:
        """The overhead budget hears a finished step's times; a change of cadence goes into the trace."""
        if self.budget is not None:
            self.budget_change(step, self.budget.update(observer_time, step_time, reason))

    def budget_change(self, step: int, change: dict[str, Any] | None) -> None:
        """A change of cadence the budget made after step ``step`` into the trace."""
        if change is not None:
            self.put(EventMsg(step, EventKind.CADENCE, None, None, _budget_message(change), change))


def _budget_message(change: dict[str, Any]) -> str:
    """The trace's line for a change of the budget's cadence (cadence.Budget.update)."""
    message = (
        f"ampdoctor cost {change['share']:.1%} of the steps against a budget of {change['budget']:.1%}: "
        f"peaks every {change['peak_every']}, full statistics every {change['every']}, weights every "
        f"{change['weight_every']} steps from now on"
    )
    if not change.get("held", True):
        message += (
            f"; the budget cannot be held on this run: the work done on every step, which is never stretched (the "
            f"sentinel, the replay's capture), costs {change['sentinel_share']:.1%} of a step by itself"
        )
    return message
