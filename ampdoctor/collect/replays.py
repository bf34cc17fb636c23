"""The anomaly replay in a run (its mechanism, the passes and the checks: anomaly.py). Every step the root module's
calls are captured; an anomalous step is replayed (a few per incident, a bounded number per run), its sites observed
in full into a record of the replay's own, which takes the step's place in its packet; what the replay found goes
to the trace as events: the replay, the operation that made the first NaN/Inf, a module healed."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from ..trace.messages import EventKind, EventMsg
from ..trace.vectors import FULL_BLOCK, Entry, Phase
from . import guards, stats
from .anomaly import Call, Capture, Replay, Replayer
from .collector import Collector
from .guards import Guard, guarded
from .options import Boundary, Observe
from .record import StepRecord
from .sites import Sites
from .state import RunFacts, StepState

MAX_REPLAYS_PER_INCIDENT = 2  # anomalous steps replayed until the run is clean again (heal needs two)
MAX_REPLAYS = 32  # per run: a run whose every step is broken does not pay a replay per step
MAX_BATCH_IDS = 1024  # sample ids kept per step (log_batch_ids)


_CPU = torch.device("cpu")


class Replays:
    """The replays of one run. Given explicitly what a replay reads and writes: the collector (whose step is set
    aside during a replay's passes), the run's facts (the optimizer updates applied: whether the weights moved), the
    sites, the trainable parameters and the writer's ``put``."""

    def __init__(
        self,
        guard: Guard,
        model: torch.nn.Module,
        modules: list[tuple[str, torch.nn.Module]],
        params: list[tuple[str, torch.nn.Parameter]],
        collector: Collector,
        facts: RunFacts,
        sites: Sites,
        put: Callable[[Any], None],
        *,
        boundary: Boundary,
        scaler_enabled: bool,
        heal: bool,
    ) -> None:
        self.guard = guard
        self.collector = collector
        self.facts = facts
        self.sites = sites
        self.params = params
        self.put = put
        self.boundary = boundary
        self.scaler_enabled = scaler_enabled
        self.runs = 0  # replays run so far
        self.in_incident = 0  # replays since the flight recorder last saw the run clean
        self._anchor = next(iter(model.parameters()), None)
        self.capture = Capture(self._device)
        self.replayer = Replayer(
            model, modules, params, self.capture, self._observing, self._pause, collector.hook_ids, heal=heal
        )
        self._target: StepState | None = None  # the step a replay's passes observe (set around them)

    # -- when -----------------------------------------------------------------------------------------------------
    def wanted(self, calls: list[Call] | None) -> bool:
        """A replay may run (its step's calls were kept, and neither bound is reached)."""
        return self.runs < MAX_REPLAYS and self.in_incident < MAX_REPLAYS_PER_INCIDENT and bool(calls)

    def clean_again(self) -> None:
        """The flight recorder saw the run clean again: the next anomaly is a new incident."""
        self.in_incident = 0

    def moved_since(self, updates: int) -> str | None:
        """Why the weights may no longer be those of a step that started after ``updates`` optimizer updates (None:
        they are; the replay at the step's verdict is exact)."""
        if self.facts.updates != updates:
            return "the optimizer had applied an update since the step started when its anomaly was known"
        if self.boundary is Boundary.MANUAL:
            return "the step ended after the loop's own optimizer step (doctor.step())"
        return None  # the scaler skipped it, and every step since: the weights are the step's own

    # -- what a step keeps for it ---------------------------------------------------------------------------------
    @guarded
    def on_root_output(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.collector.paused and not self.facts.external_batches:
            self.capture.on_output(module, args, output)

    def log_batch_ids(self, ids: Iterable[Any]) -> None:
        self.capture.batch_ids = [_plain_id(i) for i in list(ids)[:MAX_BATCH_IDS]]

    def _device(self) -> torch.device | None:
        """The model's device, read from its first parameter at each root call: walking the modules to find it
        costs microseconds every step. A moved model keeps its Parameter objects (``.to()`` swaps their data)."""
        anchor = self._anchor
        if anchor is None:
            return None
        return _CPU if anchor.is_cpu else anchor.device  # (.device makes a torch.device each call: ~1 us)

    # -- the replay -----------------------------------------------------------------------------------------------
    def replay(
        self, state: StepState, why: str, calls: list[Call], batch_ids: list[Any], *, moved: str | None
    ) -> Replay | None:
        """Replay the step, record what it found; a replay that fails is recorded as such and training goes on."""
        for call in calls:
            call.take_held()
        scale = state.scale_before
        scale = float(scale) if scale is not None else None  # (a device value: read on an anomalous step only)
        full = state.observe is Observe.FULL  # it observed its sites itself
        self.runs += 1
        self.in_incident += 1
        self._target = state
        try:
            result = self.replayer.run(
                state.index,
                why,
                calls,
                batch_ids=batch_ids,
                weights_changed=moved,
                scale=scale,
                observe_sites=not full,
            )
        except Exception as exc:
            state.replay_record = None
            message = f"the replay of step {state.index} failed ({type(exc).__name__}: {exc})"
            self.put(EventMsg(state.index, EventKind.REPLAY, None, None, message, {"failed": str(exc)[:500]}))
            return None
        finally:
            self._target = None
        state.replay = result
        if state.replay_record is not None:
            self._observe_grads(state, state.replay_record, scale)
        self.put(EventMsg(state.index, EventKind.REPLAY, None, None, _replay_line(result), result.to_dict()))
        op = result.operation
        if op is not None:
            site = self.sites.act.get(op["module"]) if op["phase"] == "fwd" else self.sites.grad.get(op["module"])
            data = {**op, "producers": result.producers}
            self.put(EventMsg(state.index, EventKind.OPERATION, site, op["phase"], _op_line(result), data))
        for path in self.replayer.heal_now():
            message = f"{path} kept in FP32 from step {state.index + 1} on (heal=True): two replays confirmed it"
            self.put(EventMsg(state.index, EventKind.HEAL, self.sites.act.get(path), "fwd", message, {"module": path}))
        return result

    def unheal(self) -> None:
        """The modules heal=True kept in FP32 are as the user made them again (close())."""
        self.replayer.unheal()

    def _pause(self, on: bool) -> None:
        """A replay's root forwards are not micro-batches of the step in progress."""
        self.collector.paused = self.capture.paused = on

    @contextlib.contextmanager
    def _observing(self, full: bool) -> Iterator[None]:
        """During a replay pass: every site observed in full (``full``) into a record of the replay's own, or
        nothing. The collector's current step is set aside meanwhile and put back, whatever happens."""
        collector = self.collector
        saved = (collector.state, collector.record)
        target = self._target
        assert target is not None  # (set by replay() around the replay's passes)
        record = StepRecord()
        observe = Observe.FULL if full else Observe.NONE
        collector.state = dataclasses.replace(
            target, observe=observe, reason="replay", store_hist=True, first_backward=False, look_at_autocast=False
        )
        collector.record = record
        collector.sync_hooks()
        try:
            yield
            if full:
                target.replay_record = record
        finally:
            collector.state, collector.record = saved
            collector.sync_hooks()

    def _observe_grads(self, state: StepState, record: StepRecord, scale: float | None) -> None:
        """The replayed parameter gradients into the replay's record, unscaled as the step's .grad was."""
        inv = 1.0 / scale if self.scaler_enabled and scale else 1.0
        for (name, _), g in zip(self.params, self.replayer.grads):
            if g is None:
                continue
            g = g * inv if inv != 1.0 else g
            sid = self.sites.param(name, "param_grad", g, state.index)
            record.entries.append(Entry(sid, Phase.PARAM, [(record.add_full(stats.full(g)), FULL_BLOCK, g.numel())]))


def _replay_line(r: Replay) -> str:
    how = "exactly" if r.exact else "not exactly (" + "; ".join(r.not_exact) + ")"
    found = {True: "reproduced the anomaly", False: "did not reproduce the anomaly", None: "observed every site"}
    return f"step {r.step} ({r.why}) replayed {how}: {found[r.reproduced]}"


def _op_line(r: Replay) -> str:
    op = r.operation
    assert op is not None  # (called for a replay that found the operation)
    made = r.producers[0] if r.producers else None
    where = f" ({op['line']})" if op.get("line") else ""
    text = f"{op['op']} in {op['module']} ({op['phase']}, {op['dtype']}) produced a non-finite value from finite inputs"
    if made is not None:
        text += f"; the values it overflowed were made by {made['op']} in {made['module']}"
        where = f" ({made['line']})" if made.get("line") else where
    return text + where


def _plain_id(i: Any) -> Any:
    if isinstance(i, (bool, int, str)):
        return i if not isinstance(i, str) else guards.text(i[:200])
    if isinstance(i, torch.Tensor) and i.numel() == 1:
        return i.item()
    try:
        return int(i)
    except Exception:
        return guards.text(str(i)[:200])
