"""Finished steps on their way to the writer. A step's figures may still be copying from an accelerator when it
ends: it waits here, in order, for its verdict (StepEnd.resolve), which arms the flight recorder and may replay the
step; its packet goes to the writer once a later step has started, so that a loss logged after
``optimizer.step()`` still joins it."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

from ..trace.messages import EventKind, EventMsg
from .boundary import InFlight, StepEnd
from .cadence import STREAK_FULL, Cadence
from .replays import Replays

# Finished steps whose values may still be on their way from an accelerator before the oldest is waited for: the
# verdict (and the flight recorder, the replay) comes at most this many steps late.
MAX_IN_FLIGHT = 2


class Flights:
    """The finished steps not yet sent to the writer, oldest first. Given explicitly: the step end (verdicts,
    packets), the cadence (its flight recorder), the replays (None without replay=True) and the writer's ``put``."""

    def __init__(self, end: StepEnd, cadence: Cadence, replays: Replays | None, put: Callable[[Any], None]) -> None:
        self.end = end
        self.cadence = cadence
        self.replays = replays
        self.put = put
        self.queue: deque[InFlight] = deque()

    def add(self, flight: InFlight) -> None:
        """A step ended. On the CPU its values are here: its verdict now. On an accelerator, whatever finished
        copying; more than MAX_IN_FLIGHT steps behind, the oldest is waited for (memory and lateness stay bounded)."""
        self.queue.append(flight)
        self.resolve(wait=len(self.queue) > MAX_IN_FLIGHT)

    def last_open(self) -> InFlight | None:
        """The finished step a loss logged now belongs to (after ``optimizer.step()``, before the next forward)."""
        queue = self.queue
        return queue[-1] if queue and not queue[-1].closed else None

    def on_step_start(self) -> None:
        """The next step's first forward: no loss can join the finished steps any more; send those resolved."""
        for flight in self.queue:
            flight.closed = True
        self.resolve(wait=False)
        self.send()

    def resolve(self, wait: bool) -> None:
        """Verdicts for the finished steps whose values reached the host, in step order (``wait``: the oldest is
        waited for)."""
        for flight in self.queue:
            if flight.packet is not None:
                continue
            if not wait and not flight.ready():
                break
            wait = False
            flight.packet, flight.verdict = self.end.resolve(flight)
            self._judged(flight)

    def _judged(self, flight: InFlight) -> None:
        """An anomalous step is replayed (unless it was before its update); the flight recorder hears the verdict."""
        state, verdict, packet, calls = flight.state, flight.verdict, flight.packet, flight.calls
        assert verdict is not None and packet is not None  # (resolved just before)
        replays = self.replays
        if (
            verdict.anomalous
            and state.replay is None
            and replays is not None
            and replays.wanted(calls)
            and calls is not None  # (wanted: some calls)
        ):
            replays.replay(state, verdict.kind, calls, flight.batch_ids, moved=replays.moved_since(flight.updates))
        if state.replay_record is not None:
            self.end.rebuild(packet, state.replay_record, "replay")
            state.replay_record = None
        flight.calls = None  # (its batch, RNG states and output gradients are let go)
        # The flight recorder: an anomaly seen now gets every site in full from the next step it can still plan,
        # until a run of clean steps (a lasting one, at fewer of its steps from STREAK_FULL on).
        if self.cadence.after(verdict.anomalous):
            message = (
                f"the anomaly has lasted {self.cadence.streak} steps: from now on its steps at a power of two into it "
                f"and every {self.cadence.hist_every}th are observed in full, the others as a clean step's"
            )
            data = {"anomaly_streak": self.cadence.streak, "full_first": STREAK_FULL}
            self.put(EventMsg(state.index, EventKind.CADENCE, None, None, message, data))
        if replays is not None and not self.cadence.alarmed:
            replays.clean_again()

    def send(self, final: bool = False) -> None:
        """Finished steps to the writer, in order: resolved, closed to late losses, their late loss on the host."""
        queue = self.queue
        while queue:
            flight = queue[0]
            if flight.packet is None or not flight.closed or not (final or flight.late_loss_ready()):
                break
            queue.popleft()
            packet = flight.packet
            late = flight.take_late_loss()
            if late is not None:
                packet.loss = late
                packet.nonfinite = packet.nonfinite or not math.isfinite(late)
                self.end.late_loss(flight.state, late)
            self.put(packet)

    def drain(self) -> None:
        """Every finished step to the writer, waiting for what is still on its way (close())."""
        for flight in self.queue:
            flight.closed = True
        while any(f.packet is None for f in self.queue):
            self.resolve(wait=True)
        self.send(final=True)
