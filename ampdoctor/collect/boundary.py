"""The step end: from the step's record to the writer's packet. The parameter gradients, the sentinel's figures
(global gradient norm and peak, the loss, the loss scale), the step's one host transfer, the verdict (skipped,
non-finite, anomalous: the flight recorder's input), and the packet, sent when the next step starts so that a loss
logged after ``optimizer.step()`` still joins it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from ..trace import schema
from ..trace.messages import EventKind, EventMsg, StepPacket
from ..trace.vectors import EXTRAS_BLOCK, FULL_BLOCK, Entry, Phase
from . import buffers, stats
from .cadence import SPIKE_FACTOR, Cadence
from .guards import Guard, finite_or_none, no_forward
from .options import Observe
from .record import HostCopy, StepRecord
from .sites import Sites
from .state import StepState
from .transfer import Transfer

if TYPE_CHECKING:
    from .anomaly import Call

_LEVELS = {Observe.NONE: schema.LEVEL_SENTINEL, Observe.PEAK: schema.LEVEL_PEAK, Observe.FULL: schema.LEVEL_FULL}
WARN_NO_FORWARD_AFTER = 3  # steps without a root forward (or begin_batch) before the run warns
# The values and their blocks of a step whose figures were on the host at its end (it observed no site)
NO_VALUES = np.zeros(0)
SENTINEL_BASES = {FULL_BLOCK: 0, EXTRAS_BLOCK: 0}


def read_scale(scaler: Any) -> float | torch.Tensor:
    """The scale in force, as a device tensor when the scaler keeps one there (no host sync)."""
    s = getattr(scaler, "_scale", None)  # GradScaler's own tensor: get_scale() would sync
    if isinstance(s, torch.Tensor):
        if stats.on_host(s):
            return s.item()
        return s.detach().clone().reshape(())  # update() changes it in place
    return float(scaler.get_scale())


@dataclass(slots=True)
class Verdict:
    """What the sentinel concluded about a finished step."""

    skipped: bool  # the optimizer did not apply it
    nonfinite: bool  # a NaN/Inf in the loss, the gradients or an observed value
    spike: bool = False  # a finite gradient-norm spike
    loss_spike: bool = False  # a finite loss spike
    weights_bad: bool = False  # half-precision weights hold NaN/Inf after the update

    @property
    def anomalous(self) -> bool:
        """The flight recorder's trigger (and the anomaly replay's)."""
        return self.skipped or self.nonfinite or self.spike or self.loss_spike

    @property
    def kind(self) -> str:
        """The anomaly, most serious first: "nonfinite", "skipped", "loss_spike" (the one a practitioner sees in the
        loss curve), "grad_spike"."""
        if self.nonfinite:
            return "nonfinite"
        if self.skipped:
            return "skipped"
        return "loss_spike" if self.loss_spike else "grad_spike"


class StepFigures(NamedTuple):
    """The sentinel's figures of a finished step on the host (None: not known this step)."""

    loss: float | None
    grad_norm: float | None
    grad_max: float | None
    scale: float | None  # the loss scale in force, and after the scaler's update
    scale_next: float | None
    bad_weights: float | None  # half-precision parameter tensors holding NaN/Inf (None: none are half)


@dataclass(slots=True)
class InFlight:
    """A finished step whose figures are on their way to the host: its transfer (``copy``, with where each figure
    sits in it), or, where every figure was on the host already at the step end, the figures themselves (a
    sentinel step on the CPU: no transfer, nothing to look up)."""

    state: StepState
    skipped: bool | None
    row: dict[str, Any]  # the steps-table fields known now (the packet's row once resolved)
    entries: list[Entry]
    figures: StepFigures | None = None  # on the host at the step end (then copy is None)
    copy: HostCopy | None = None
    offsets: dict[str, Any] | None = None  # where the step figures sit among the copy's extras
    scales: list[Any] | None = None  # [before, after] the scaler's update: floats, or device tensors in the copy
    scale_offs: list[Any] | None = None
    calls: list[Call] | None = None  # what a replay of it needs (anomaly.Capture), kept until it is resolved
    updates: int = 0  # optimizer updates applied before it started (a replay is exact while this holds)
    # a loss logged after its boundary (a float, or a Transfer of a device value)
    late_loss: float | Transfer | None = None
    packet: StepPacket | None = None
    verdict: Verdict | None = None
    batch_ids: list[Any] = field(default_factory=list)
    closed: bool = False  # a later step has started: no loss can join it any more

    @property
    def has_loss(self) -> bool:
        """A loss was logged before its boundary, or after it (a late loss)."""
        if self.figures is not None:
            own = self.figures.loss
        else:  # (where the transfer holds it: an offset, or None)
            own = self.offsets["loss"] if self.offsets is not None else None
        return own is not None or self.late_loss is not None

    def ready(self) -> bool:
        return self.copy is None or self.copy.ready()

    def add_late_loss(self, loss: float | torch.Tensor) -> None:
        """A loss logged after the step's boundary (``optimizer.step()`` came first): a device value is copied
        asynchronously, like the step's figures."""
        if isinstance(loss, torch.Tensor):
            self.late_loss = (
                Transfer(loss.detach().to(torch.float64).reshape(1)) if not stats.on_host(loss) else loss.item()
            )
        else:
            self.late_loss = loss

    def late_loss_ready(self) -> bool:
        return not isinstance(self.late_loss, Transfer) or self.late_loss.ready()

    def take_late_loss(self) -> float | None:
        v = self.late_loss
        if isinstance(v, Transfer):
            v = float(v.values()[0])
        return None if v is None else float(v)


class StepEnd:
    """Turns a finished StepState into a StepPacket and a Verdict. Given explicitly what it reads: the record, the
    sites, the trainable parameters, the cadence (spikes), the optimizer (learning rates) and scaler, the writer's
    ``put``."""

    def __init__(
        self,
        guard: Guard,
        record: StepRecord,
        sites: Sites,
        params: list[tuple[str, torch.nn.Parameter]],
        cadence: Cadence,
        put: Callable[..., Any],
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: Any = None,
        scaler_enabled: bool = False,
        model_name: str,
    ) -> None:
        self.guard = guard
        self.record = record
        self.sites = sites
        self.params = params
        self.cadence = cadence
        self.put = put
        self.optimizer = optimizer
        self.scaler = scaler if scaler_enabled else None
        self._model_name = model_name
        self._grad_plan: buffers.GradPlan | None = None
        self._grad_figures = buffers.GradFigures()
        self.half_params = any(p.dtype in (torch.float16, torch.bfloat16) for _, p in params)
        self._known_entries: list[Any] = []  # the entries of recent steps' distinct layouts, newest first
        self.no_entries: list[Entry] = []  # every sentinel step's (never appended to)
        self._bad_weights = 0
        self.t_prev_end = time.perf_counter()

    def figures(self, state: StepState) -> tuple[Any, ...]:
        """The sentinel: global norm and largest unscaled gradient, fused over all gradients, once per step (before
        the optimizer step when it has one, else at the step end): floats on the CPU, else device tensors."""
        if state.figures is None:
            state.figures = self._grad_figures(self.params)
        return state.figures

    def early_verdict(self, state: StepState) -> Verdict | None:
        """Before the optimizer applies the step (its pre-hook): what the sentinel already knows, when its figures
        are on the host (on an accelerator they come with the step's one transfer, later). None: nothing to say."""
        norm, gmax = self.figures(state)
        loss = buffers.sum_losses(state.losses) if state.losses else None
        if isinstance(norm, torch.Tensor) or isinstance(gmax, torch.Tensor) or isinstance(loss, torch.Tensor):
            return None
        nonfinite = not (finite_or_none(norm) and finite_or_none(gmax) and finite_or_none(loss))
        verdict = Verdict(skipped=False, nonfinite=nonfinite)
        if not nonfinite:
            verdict.spike, verdict.loss_spike = self.spikes(state, norm, loss)
        return verdict

    def spikes(self, state: StepState, norm: float | None, loss: float | None) -> tuple[bool, bool]:
        if state.grad_spike is None:
            state.grad_spike = self.cadence.spike(norm)
        if state.loss_spike is None and loss is not None:
            state.loss_spike = self.cadence.loss_spike(loss)
        return state.grad_spike, bool(state.loss_spike)

    def late_loss(self, state: StepState, loss: float) -> None:
        """The step's loss came after its verdict (logged after ``optimizer.step()``): judged for a spike now, where
        the verdict judged the step's spikes (a finite step the scaler applied), as an early loss would have been."""
        if state.loss_spike is None and state.grad_spike is not None:
            state.loss_spike = self.cadence.loss_spike(loss)
            if state.loss_spike:
                self.loss_spike_event(state.index, loss)

    def loss_spike_event(self, step: int, loss: float | None, mean: float | None = None) -> None:
        """The trace's event for a loss spike at ``step``; ``mean``: the running mean it was judged against (the
        cadence's, unless the lane's held steps judged it: lane.py)."""
        if mean is None:
            mean = self.cadence.typical_loss
        message = f"loss {loss:.4g} jumped far above its running mean {mean:.4g}"
        self.put(EventMsg(step, EventKind.LOSS_SPIKE, None, None, message, {"loss": loss, "running_mean": mean}))

    def close(self, state: StepState, skipped: bool | None, step_starts: int, device: str | None) -> InFlight:
        """The step ``state`` ended (``skipped``: known from the optimizer; None: to read from the loss scale). Its
        figures start their way to the host; ``resolve`` turns them into the packet. A sentinel step whose figures
        are all on the host already (the CPU) keeps them as they are: no transfer to make, nothing to look up."""
        step, observe, rec = state.index, state.observe, self.record
        if observe is Observe.NONE and not self.cadence.reads_weights(step):
            figures = self._host_figures(state)
            if figures is not None:
                row = self._row(state, step_starts, device)
                return InFlight(state, skipped, row, self.no_entries, figures)
        entries = rec.entries
        if observe is not Observe.NONE:
            self._observe_param_grads(observe, state, entries)
        norm, gmax = self.figures(state)
        offsets = {"norm": rec.add_extra(norm) if norm is not None else None}
        offsets["max"] = rec.add_extra(gmax) if gmax is not None else None
        if self.cadence.reads_weights(step):
            for name, p in self.params:
                sid = self.sites.param(name, "weight", p, step)
                entries.append(Entry(sid, Phase.WEIGHT, [rec.observe(p.detach(), Observe.FULL)]))
        offsets["loss"] = rec.add_extra(buffers.sum_losses(state.losses)) if state.losses else None
        # Half-precision weights can turn NaN/Inf in an optimizer step from finite gradients (Adam's eps is 0 in
        # FP16): watched every step for them (one fused norm), on anomalous steps only for FP32 weights.
        nonfinite_weights = buffers.count_nonfinite([p for _, p in self.params]) if self.half_params else None
        offsets["bad_weights"] = rec.add_extra(nonfinite_weights) if nonfinite_weights is not None else None
        scales = [state.scale_before, read_scale(self.scaler)] if self.scaler is not None else [None, None]
        scale_offs = [rec.add_extra(v) if isinstance(v, torch.Tensor) else None for v in scales]

        plan = self._grad_plan
        grad_slots = plan.buffers if plan is not None and observe is Observe.PEAK else ()
        copy = rec.start_transfer(grad_slots)  # the step's one transfer
        # Same control flow as a recent step (the tiers alternate a few layouts): the writer reuses its Layout.
        if not entries:
            entries = self.no_entries  # a sentinel step
        else:
            same = next((e for e in self._known_entries if e == entries), None)
            if same is not None:
                entries = same
            else:
                self._known_entries.insert(0, entries)
                del self._known_entries[4:]
        row = self._row(state, step_starts, device)
        return InFlight(state, skipped, row, entries, None, copy, offsets, scales, scale_offs)

    def _host_figures(self, state: StepState) -> StepFigures | None:
        """The step's figures, when every one of them is on the host already (None: some are device values, to be
        read with the step's transfer; asked before anything is computed for them on the device)."""
        norm, gmax = self.figures(state)
        # (``figures``, ``log_loss`` and ``read_scale`` give floats wherever a read is free)
        losses = state.losses
        if (
            isinstance(norm, torch.Tensor)
            or isinstance(gmax, torch.Tensor)
            or any([type(v) is not float for v in losses])
        ):
            return None
        before = after = bad_weights = None
        if self.scaler is not None:
            before = state.scale_before
            if isinstance(before, torch.Tensor):
                return None
            scale = read_scale(self.scaler)
            if isinstance(scale, torch.Tensor):  # (not expected: the scale in force was a float)
                return None
            after = scale
        if self.half_params:
            count = buffers.count_nonfinite([p for _, p in self.params])
            if not stats.on_host(count):
                return None
            bad_weights = count.item()
        loss = float(buffers.sum_losses(losses)) if losses else None
        return StepFigures(loss, norm, gmax, before, after, bad_weights)

    def _row(self, state: StepState, step_starts: int, device: str | None) -> dict[str, Any]:
        """The steps-table fields known at the step end."""
        # No forward of the attached module and no begin_batch() this step: when the data arrived is unknown, so
        # the data wait is left empty (a wait of the whole step would make the time rules blame the input pipeline).
        step, t_first = state.index, state.t_first
        started = t_first is not None
        if not started and step + 1 >= WARN_NO_FORWARD_AFTER and not step_starts:
            self.guard.warn_once("no-forward", no_forward(self._model_name, step + 1))
        return {
            "time": time.time(),
            "data_time": max(t_first - self.t_prev_end, 0.0) if t_first is not None else None,
            "samples": (state.samples or None) if started else None,
            "lr": [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer is not None else None,
            "microbatches": state.micro,
            "peak_mem": int(torch.cuda.max_memory_allocated()) if device == "cuda" else None,
            "level": _LEVELS[state.observe] if not state.store_hist else schema.LEVEL_HIST,
            "reason": state.reason,
        }

    def resolve(self, flight: InFlight) -> tuple[StepPacket, Verdict]:
        """The step's values are on the host: its packet and the sentinel's verdict (spikes and weights checked,
        their events sent). Called in step order."""
        if flight.copy is None:
            assert flight.figures is not None  # (one or the other: close())
            values, bases, bad, figures = NO_VALUES, SENTINEL_BASES, False, flight.figures
        else:
            values, bases, bad = flight.copy.result()
            figures = self._read(flight, values[bases[EXTRAS_BLOCK] :].tolist())  # (Python floats in one call)
        return self._judge(flight, figures, values, bases, bad)

    @staticmethod
    def _read(flight: InFlight, extras: list[float]) -> StepFigures:
        """The step's figures out of its transfer's extras."""
        offsets, scales, scale_offs = flight.offsets, flight.scales, flight.scale_offs
        assert offsets is not None and scales is not None and scale_offs is not None  # (with the copy: close())

        def pick(off: int | None) -> float | None:
            return None if off is None else extras[off]

        (off_before, off_after), (before, after) = scale_offs, scales
        return StepFigures(
            pick(offsets["loss"]),
            pick(offsets["norm"]),
            pick(offsets["max"]),
            before if off_before is None else pick(off_before),
            after if off_after is None else pick(off_after),
            pick(offsets["bad_weights"]),
        )

    def _judge(
        self, flight: InFlight, figures: StepFigures, values: np.ndarray, bases: dict[str, int], bad: bool
    ) -> tuple[StepPacket, Verdict]:
        state = flight.state
        step = state.index
        loss, grad_norm, grad_max, scale, scale_next, bad_weights = figures
        row = flight.row
        row["grad_max"] = grad_max
        skipped = flight.skipped
        if skipped is None:  # no optimizer to tell: a scale that backed off means the scaler skipped the step
            skipped = scale is not None and scale_next is not None and scale_next < scale
        nonfinite = bad or not (finite_or_none(grad_norm) and finite_or_none(grad_max) and finite_or_none(loss))
        verdict = Verdict(skipped=bool(skipped), nonfinite=nonfinite)
        if verdict.anomalous or bad_weights:
            verdict.weights_bad = self._check_weights(step)
        if not verdict.anomalous:  # (observed in full from the next step on; the spike itself is an event)
            verdict.spike, verdict.loss_spike = self.spikes(state, grad_norm, loss)
        if verdict.spike:
            mean = self.cadence.typical_norm
            message = f"gradient norm {grad_norm:.4g} jumped above {SPIKE_FACTOR:g}x its running mean {mean:.4g}"
            data = {"grad_norm": grad_norm, "running_mean": mean}
            self.put(EventMsg(step, EventKind.GRAD_SPIKE, None, None, message, data))
        if verdict.loss_spike:
            self.loss_spike_event(step, loss)
        packet = StepPacket(
            step=step,
            row=row,
            values=values,
            bases=bases,
            entries=flight.entries,
            loss=loss,
            scale=scale,
            scale_next=scale_next,
            grad_norm=grad_norm,
            skipped=verdict.skipped,
            nonfinite=verdict.nonfinite,
            store_hist=state.store_hist,
        )
        return packet, verdict

    def rebuild(self, packet: StepPacket, record: StepRecord, reason: str) -> None:
        """The step was replayed: its packet takes the replay's full observation of every site in place of what the
        step itself observed (``record``: the replay's own, holding its parameter gradients too)."""
        entries = record.entries
        values, bases, bad = record.start_transfer(()).result()
        packet.values, packet.bases, packet.entries = values, bases, entries
        packet.row.update(level=schema.LEVEL_HIST, reason=reason)
        packet.store_hist = True
        packet.nonfinite = packet.nonfinite or bad

    def stamp(self, row: dict[str, Any], observer_time: float) -> None:
        """The step spans from the end of the previous step's boundary work to the end of this one's, so the steps'
        times add up to the run's; observer_time is ampdoctor's share of it on the training thread."""
        end = time.perf_counter()
        row["step_time"] = end - self.t_prev_end
        row["observer_time"] = observer_time
        self.t_prev_end = end

    def _observe_param_grads(self, observe: Observe, state: StepState, entries: list[Entry]) -> None:
        """Peaks (or full statistics) of every parameter gradient, in parameter order."""
        if observe is not Observe.FULL:
            present = tuple([p.grad is not None for _, p in self.params])  # (no generator: one call)
            plan = self._grad_plan
            if plan is None or plan.key != present:
                plan = self._grad_plan = buffers.GradPlan(self.params, present, self._grad_site(state.index))
            try:
                plan.run()
            except RuntimeError:  # parameters moved to another device or dtype since the plan was made
                plan = self._grad_plan = buffers.GradPlan(self.params, present, self._grad_site(state.index))
                plan.run()
            entries.extend(plan.entries)
            return
        rec = self.record
        site = self._grad_site(state.index)
        for name, p in self.params:
            g = p.grad
            if g is None:
                continue
            g = g.detach()
            sid = site(name, g)
            if g.layout != torch.strided:  # a sparse gradient: peaks of its stored values only
                entries.append(Entry(sid, Phase.PARAM, [rec.observe(buffers.dense_values(g), Observe.PEAK)]))
            else:
                entries.append(Entry(sid, Phase.PARAM, [(rec.add_full(stats.full(g)), FULL_BLOCK, g.numel())]))

    def _grad_site(self, step: int) -> Callable[[str, torch.Tensor], int]:
        return lambda name, grad: self.sites.param(name, "param_grad", grad, step)

    def _check_weights(self, step: int) -> bool:
        """On an anomalous step only: are the weights themselves non-finite after the optimizer step? Then a later
        forward NaN comes from the update (e.g. Adam's eps lost in FP16), not from the forward computation."""
        if not self.params:
            return False
        norms = torch.stack(
            [n.to(torch.float32) for n in torch._foreach_norm([p.detach() for _, p in self.params])]
        ).cpu()
        bad = [name for (name, _), ok in zip(self.params, torch.isfinite(norms).tolist()) if not ok]
        if len(bad) != self._bad_weights:
            self._bad_weights = len(bad)
            if bad:
                message = f"{len(bad)} parameter tensor(s) hold NaN/Inf after the optimizer step"
                data = {"params": bad[:100], "count": len(bad)}
                self.put(EventMsg(step, EventKind.NONFINITE_WEIGHTS, None, "update", message, data))
        return bool(bad)
