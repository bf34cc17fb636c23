"""From training's calls to the step's record: the root forward (a micro-batch starts), each observed module's forward
and output gradient, the loss (logged, or read in ``scaler.scale``), and the optimizer's update. Each entry runs
under ``guards.guarded``; what it observes goes into ``record`` (StepRecord), what it learns about the run into
``facts`` (RunFacts), for the step ``state`` (StepState) the step loop hands it at every step start."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..trace.vectors import FULL_BLOCK, Entry, Phase
from . import buffers, hooks, stats
from .guards import Guard, guarded, no_boundary
from .options import Observe
from .record import StepRecord
from .sites import Sites
from .state import RunFacts, StepState

if TYPE_CHECKING:
    from .probe import StepProbe

WARN_AFTER_STEPS = 3  # steps (or cleared gradients) before a run that is not observed as it should be warns
# Observations held for one step: a step of 1,000 observed modules with 32 accumulated micro-batches holds ~64k
# (forward + backward). Beyond this the step boundary is taken to be missing (an optimizer of another model) and
# the step's observations so far are dropped, so that memory stays bounded.
MAX_STEP_ENTRIES = 200_000
MAX_STEP_LOSSES = 64  # micro-batch losses kept apart per step; beyond, they are summed into one


class LateLoss(Protocol):
    """A finished step a loss logged after its boundary may still join (boundary.InFlight, lane.Lane's open row)."""

    @property
    def has_loss(self) -> bool: ...

    def add_late_loss(self, loss: float | torch.Tensor) -> None: ...


class Collector:
    """The module hooks' side of a run. The wiring (core.py) sets what else hears of a step's root calls:
    ``on_step_start`` runs at the first micro-batch of each step (the finished steps' packets are sent then, so that a
    loss logged after ``optimizer.step()`` still joins its step), ``on_root_call`` at each root forward (the anomaly
    replay's capture), ``probe`` at the step's first forward."""

    def __init__(
        self,
        guard: Guard,
        model: torch.nn.Module,
        modules: list[tuple[str, torch.nn.Module]],
        sites: Sites,
        record: StepRecord,
        facts: RunFacts,
        params: list[tuple[str, torch.nn.Parameter]],
        *,
        boundary_name: str,
        keep_hooks: bool = False,
    ) -> None:
        self.guard = guard
        self.model = model
        self.modules = modules
        self.sites = sites
        self.record = record
        self.facts = facts
        self.params = params
        self.state = StepState(0, Observe.NONE, "sentinel", False)  # (the step loop begins step 0 at once)
        self.on_step_start: Callable[[], None] = _nothing
        # (args, kwargs) of the step's root forwards (the anomaly replay)
        self.on_root_call: Callable[..., Any] | None = None
        self.autocast_now: tuple[str, torch.dtype] | None = None  # (device type, dtype) at the last root call
        self.probe: StepProbe | None = None  # a StepProbe when attach(probe_every=...)
        self.paused = False  # a replay is running: its root forwards are not micro-batches
        self._boundary_name = boundary_name
        self.anchor = next(iter([*model.parameters(), *model.buffers()]), None)
        # Per-module hooks are made once and registered only for steps that observe sites (sync_hooks): a sentinel
        # step runs no Python per module call. A compiled model keeps them (its graphs would change with every
        # registration); they return at once on steps that observe no site.
        self.keep_hooks = keep_hooks
        self._grad_hooks = {path: hooks.eager(functools.partial(self.on_grad, path, mod)) for path, mod in modules}
        self._fwd_hooks = [(mod, hooks.eager(functools.partial(self.on_forward, path))) for path, mod in modules]
        self._handles: list[Any] = []

    # -- the step's hooks ------------------------------------------------------------------------------------------
    def begin(self, state: StepState) -> None:
        """A new step: its state, and the per-module hooks it needs (registering ~25 hooks costs ~30 us, paid when
        the cadence switches, not every step)."""
        self.state = state
        self.record.clear()
        self.sync_hooks()

    def sync_hooks(self) -> None:
        want = ((self.state is not None and self.state.observe is not Observe.NONE) or self.keep_hooks) and not (
            self.guard.off
        )
        if want == bool(self._handles):
            return
        if want:
            self._handles = [mod.register_forward_hook(fn) for mod, fn in self._fwd_hooks]
        else:
            self.unhook()

    def hook_ids(self) -> set[int]:
        """The handle ids of the per-module hooks registered now (a replay switches others' hooks off)."""
        return {h.id for h in self._handles}

    def unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # -- the forward pass ----------------------------------------------------------------------------------------
    @guarded
    def on_root_pre(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.paused or self.facts.external_batches or not torch.is_grad_enabled() or hooks.graph_task_id() != -1:
            return
        first = self.state.t_first is None
        a0 = args[0] if args else None
        call = self.on_root_call
        self.start_micro(a0 if type(a0) is torch.Tensor else hooks.first_tensor(args, kwargs), call is not None)
        if call is not None:
            call(args, kwargs, self.state.observe is not Observe.NONE, self.facts.device, self.autocast_now)
        if first and self.probe is not None:
            self.probe.begin(self.state.index, args, kwargs)  # the step's first forward: its RNG state, inputs

    def start_micro(self, t: torch.Tensor | None, capture: bool = False) -> None:
        """A micro-batch's forward begins: the step's first one ends the data wait; ``t`` gives the batch size;
        ``capture``: the replay's capture keeps this call (it reads the autocast state read here)."""
        state, facts = self.state, self.facts
        first = state.t_first is None
        if first:
            state.t_first = time.perf_counter()
            self.on_step_start()
            facts.device = self.device_now()  # once a step: a model may be moved
        # The autocast state: asked at every call the capture keeps (once, for it and the step's record: a torch
        # call inside a training loop costs microseconds), else at a step's start until autocast is seen on
        dev = facts.device
        if capture or (first and dev is not None and not self.autocast_known(dev)):
            self.autocast_now = autocast_state(dev) if dev is not None else None
            if first:
                self.record_autocast(self.autocast_now)
        facts.step_starts += 1
        state.micro += 1
        if t is not None and t.dim() > 0:
            state.samples += int(t.shape[0])
        state.first_backward = True

    def device_now(self) -> str | None:
        """The model's device type, read from its first parameter (or buffer): walking the modules to find one
        costs ~10 us, every step. A moved model keeps its Parameter objects (``.to()`` swaps their data)."""
        anchor = self.anchor
        if anchor is not None:
            return "cpu" if anchor.is_cpu else anchor.device.type  # (.device makes a torch.device: ~1 us)
        return next((t.device.type for t in [*self.model.parameters(), *self.model.buffers()]), None)

    def read_autocast(self) -> None:
        """Record the autocast state as it is now, at an observed forward: frameworks enter autocast inside
        ``forward`` (accelerate wraps it), after the root pre-hook, so the first observed forward inside looks
        again."""
        dev = self.facts.device
        if dev is not None and not self.autocast_known(dev):
            self.record_autocast(autocast_state(dev))

    def record_autocast(self, now: tuple[str, torch.dtype] | None) -> None:
        """Record the autocast state read at a micro-batch's start (``now``: (device type, dtype), or None: off)."""
        dev, seen = self.facts.device, self.facts.autocast
        if dev is None or self.autocast_known(dev):
            return
        if now is not None or not seen:
            dtype = buffers.dtype_name(now[1]) if now is not None else None
            self.facts.autocast = {"device_type": dev, "enabled": now is not None, "dtype": dtype}

    def autocast_known(self, dev: str) -> bool:
        """Autocast was seen on for this device already (what is recorded stays)."""
        seen = self.facts.autocast
        return bool(seen.get("enabled")) and seen.get("device_type") == dev

    @guarded
    def on_forward(self, path: str, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        state = self.state
        if state.observe is Observe.NONE or not torch.is_grad_enabled():
            return
        if type(output) is torch.Tensor:  # the common case: one tensor out, one in
            if not output.is_floating_point():
                return
            tensors: tuple[Any, ...] | list[Any] = (output,)
        else:
            tensors = hooks.float_tensors(output)
            if not tensors:
                return
        if state.look_at_autocast:
            state.look_at_autocast = False
            state.first_backward = True  # (also where no root forward marks the micro-batches)
            if self.facts.device is None:
                self.facts.device = self.device_now()
            self.read_autocast()
        rec = self.record
        if len(rec.entries) >= MAX_STEP_ENTRIES:
            self._drop_observations()
        sid = self.sites.act.get(path)
        if sid is None:
            sid = self.sites.act[path] = self.sites.get(path, "act", module, tensors[0], state.index)
        if sid in rec.act_seen and hooks.graph_task_id() != -1:
            return  # checkpoint recomputation: the original forward was already recorded
        rec.act_seen.add(sid)
        want = state.observe
        observe = rec.observe
        outs = [observe(tensors[0], want)] if len(tensors) == 1 else [observe(t, want) for t in tensors]
        a0 = args[0] if len(args) == 1 else None
        if type(a0) is torch.Tensor and a0.is_floating_point():
            ins = [observe(a0, Observe.PEAK)]
        else:
            ins = [observe(t, Observe.PEAK) for t in hooks.float_tensors(args)]
        rec.entries.append(Entry(sid, Phase.FWD, outs, ins))
        for t in tensors:
            if t.requires_grad:
                hooks.grad_hook(t, self._grad_hooks[path])

    # -- the backward pass ---------------------------------------------------------------------------------------
    @guarded  # (on an accelerator autograd's thread: the training thread waits for it)
    def on_grad(self, path: str, module: torch.nn.Module, grad: torch.Tensor | None) -> None:
        if grad is None:
            return
        state = self.state
        if state.first_backward:
            state.first_backward = False
            self._check_missed_step()
        state.grads_seen = True
        rec = self.record
        if len(rec.entries) >= MAX_STEP_ENTRIES:
            self._drop_observations()
        sid = self.sites.grad.get(path)
        if sid is None:
            sid = self.sites.grad[path] = self.sites.get(path, "grad_out", module, grad, state.index)
        rec.entries.append(Entry(sid, Phase.BWD, [rec.observe(grad, state.observe)]))

    def _check_missed_step(self) -> None:
        """At a micro-batch's first backward hook: gradients of an earlier backward of this step that are gone
        (``zero_grad()``) mean a step passed with no step boundary, unless they were cleared inside the optimizer's step
        (a closure's, as LBFGS evaluates several in one step). Warn once after a few; the step's observations are
        bounded by MAX_STEP_ENTRIES meanwhile."""
        state = self.state
        if not state.grads_seen or state.in_update or any(p.grad is not None for _, p in self.params):
            return  # (only asked after an earlier backward of this step: accumulated micro-batches)
        self.facts.missed_steps += 1
        if self.facts.missed_steps == WARN_AFTER_STEPS:
            what = f"{self.facts.missed_steps} optimizer steps"
            self.guard.warn_once("no-boundary", no_boundary(self._boundary_name, what))

    def _drop_observations(self) -> None:
        """The step has grown past MAX_STEP_ENTRIES: its boundary is missing. Drop what it observed so far (its
        timing, micro-batches and losses stay), warn once, keep collecting."""
        self.record.drop_observations()
        message = (
            no_boundary(self._boundary_name, f"{MAX_STEP_ENTRIES:,} observations")
            + "; the observations of the unfinished step are dropped to bound memory"
        )
        self.guard.warn_once("bounded", message)

    # -- the optimizer's update ------------------------------------------------------------------------------------
    @guarded
    def keep_weights(self) -> None:
        """Before an optimizer step that records updates: the weights as they are."""
        self.state.weights_before = [p.detach().clone() for _, p in self.params]

    @guarded
    def record_updates(self) -> None:
        """After it: each parameter's update (its value now minus the copy taken before the step)."""
        state = self.state
        if state.weights_before is None:
            return
        rec = self.record
        for (name, p), old in zip(self.params, state.weights_before):
            sid = self.sites.param(name, "update", p, state.index)
            delta = stats.full(p.detach() - old)
            rec.entries.append(Entry(sid, Phase.UPDATE, [(rec.add_full(delta), FULL_BLOCK, p.numel())]))
        state.weights_before = None

    # -- the loss ------------------------------------------------------------------------------------------------
    def log_loss(self, loss: Any, pending: LateLoss | None = None) -> None:
        """A loss of this step (summed over micro-batches). ``pending``: the finished step (boundary.InFlight, or the
        lane's open row) a loss logged after its boundary (``optimizer.step()`` before the loss was logged) and before
        the next step joins."""
        if isinstance(loss, torch.Tensor):
            if self.facts.loss_dtype is None:
                self.facts.loss_dtype = buffers.dtype_name(loss.dtype)
            n = loss.numel()
            if not n:
                return
            # a CPU value is read now (no sync to wait for); an accelerator's joins the step's one transfer
            loss = loss.item() if n == 1 and stats.on_host(loss) else loss.detach().reshape(-1)[0]
        if loss is None:
            return
        state = self.state
        if len(state.losses) >= MAX_STEP_LOSSES:  # a step without an end: keep one running sum
            state.losses = [buffers.sum_losses(state.losses)]
        if state.t_first is None and pending is not None and not pending.has_loss:
            pending.add_late_loss(loss)  # logged after the optimizer step ended the step
        else:
            state.losses.append(loss)


def autocast_state(dev: str) -> tuple[str, torch.dtype] | None:
    """(device type, dtype) where autocast is on for ``dev`` now, else None."""
    return (dev, torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None


def _nothing() -> None:
    pass
