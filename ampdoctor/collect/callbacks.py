"""What the Doctor does when training calls it: the root forward (a micro-batch starts), each observed module's
forward and output gradient, the optimizer step, the scaler's scale() and update(), and a logged loss.

A mixin of Doctor (session.py): these methods read and write the step's fields on the hot path, where an object
per concern would add an attribute hop per call. Each entry runs under ``guards.guarded``."""

from __future__ import annotations

import functools
import time

import torch

from ..trace.vectors import Entry
from . import buffers as B
from . import cadence as C
from . import guards as G
from . import hooks as H
from . import meta
from . import stats as K

WARN_AFTER_STEPS = 3  # steps (or cleared gradients) before a run that is not observed as it should be warns
# Observations held for one step: a step of 1,000 observed modules with 32 accumulated micro-batches holds ~64k
# (forward + backward). Beyond this the step boundary is taken to be missing (an optimizer of another model) and
# the step's observations so far are dropped, so that memory stays bounded.
MAX_STEP_ENTRIES = 200_000
MAX_STEP_LOSSES = 64  # micro-batch losses kept apart per step; beyond, they are summed into one


class Callbacks:
    # -- the forward pass ----------------------------------------------------------------------------------------
    @G.guarded
    def _on_root_pre(self, module, args, kwargs):
        if self._external_batches or not torch.is_grad_enabled() or H.graph_task_id() != -1:
            return
        first = self._t_first is None
        self._start_micro(H.first_tensor(args, kwargs))
        if first and self._probe is not None:
            self._probe.begin(self._step, args, kwargs)  # the step's first forward: its RNG state, inputs

    def _start_micro(self, t: torch.Tensor | None) -> None:
        """A micro-batch's forward begins: the step's first one ends the data wait; ``t`` gives the batch size."""
        if self._t_first is None:
            self._t_first = time.perf_counter()
            self._flush_pending()
            self._device = self._device_now()  # once a step: a model may be moved
            self._probe_autocast()
        self._step_starts += 1
        self._micro += 1
        if t is not None and t.dim() > 0:
            self._samples += int(t.shape[0])
        self._bwd_probe = True

    def _device_now(self) -> str | None:
        """The model's device type, read from its first parameter (or buffer): walking the modules to find one
        costs ~10 us, every step. A moved model keeps its Parameter objects (``.to()`` swaps their data)."""
        return self._anchor.device.type if self._anchor is not None else meta.device_type(self.model)

    def _probe_autocast(self) -> None:
        """Record the autocast state at the step's first forward. Frameworks enter autocast inside ``forward``
        (accelerate wraps it), after the root pre-hook: the first observed forward inside looks again."""
        dev = self._device
        if dev is None or (self._autocast.get("enabled") and self._autocast.get("device_type") == dev):
            return
        enabled = torch.is_autocast_enabled(dev)
        if enabled or not self._autocast:
            self._autocast = {
                "device_type": dev,
                "enabled": enabled,
                "dtype": B.dtype_name(torch.get_autocast_dtype(dev)) if enabled else None,
            }

    @G.guarded
    def _on_forward(self, path, module, args, output):
        if self._cur_mode == C.NONE or not torch.is_grad_enabled():
            return
        if type(output) is torch.Tensor:  # the common case: one tensor out, one in
            if not output.is_floating_point():
                return
            tensors = (output,)
        else:
            tensors = H.float_tensors(output)
            if not tensors:
                return
        if self._ac_probe:
            self._ac_probe = False
            self._bwd_probe = True  # (also where no root forward marks the micro-batches)
            if self._device is None:
                self._device = self._device_now()
            self._probe_autocast()
        rec = self._rec
        if len(rec.entries) >= MAX_STEP_ENTRIES:
            self._drop_observations()
        sid = self._sites.act.get(path)
        if sid is None:
            sid = self._sites.act[path] = self._sites.get(path, "act", module, tensors[0], self._step)
        if sid in rec.act_seen and H.graph_task_id() != -1:
            return  # checkpoint recomputation: the original forward was already recorded
        rec.act_seen.add(sid)
        mode = self._cur_mode
        observe = rec.observe
        outs = [observe(tensors[0], mode)] if len(tensors) == 1 else [observe(t, mode) for t in tensors]
        a0 = args[0] if len(args) == 1 else None
        ins = (
            [observe(a0, "p")]
            if type(a0) is torch.Tensor and a0.is_floating_point()
            else [observe(t, "p") for t in H.float_tensors(args)]
        )
        rec.entries.append(Entry(sid, "fwd", outs, ins))
        for t in tensors:
            if t.requires_grad:
                t.register_hook(self._grad_hooks[path])

    # -- the backward pass ---------------------------------------------------------------------------------------
    @G.guarded  # (on an accelerator autograd's thread: the training thread waits for it)
    def _on_grad(self, path, module, grad):
        if grad is None:
            return
        if self._bwd_probe:
            self._bwd_probe = False
            self._check_missed_step()
        self._grads_seen = True
        rec = self._rec
        if len(rec.entries) >= MAX_STEP_ENTRIES:
            self._drop_observations()
        sid = self._sites.grad.get(path)
        if sid is None:
            sid = self._sites.grad[path] = self._sites.get(path, "grad_out", module, grad, self._step)
        rec.entries.append(Entry(sid, "bwd", [rec.observe(grad, self._cur_mode)]))

    def _check_missed_step(self) -> None:
        """At a micro-batch's first backward hook: gradients of an earlier backward of this step that are gone
        (``zero_grad()``) mean a step passed with no step boundary. Warn once after a few; the step's observations
        are bounded by MAX_STEP_ENTRIES meanwhile."""
        if not self._grads_seen or any(p.grad is not None for _, p in self._params):
            return  # (only asked after an earlier backward of this step: accumulated micro-batches)
        self._missed += 1
        if self._missed == WARN_AFTER_STEPS:
            self._warn_once("no-boundary", G.no_boundary(self._boundary, f"{self._missed} optimizer steps"))

    def _drop_observations(self) -> None:
        """The step has grown past MAX_STEP_ENTRIES: its boundary is missing. Drop what it observed so far (its
        timing, micro-batches and losses stay), warn once, keep collecting."""
        self._rec.drop_observations()
        self._warn_once(
            "bounded",
            G.no_boundary(self._boundary, f"{MAX_STEP_ENTRIES:,} observations")
            + "; the observations of the unfinished step are dropped to bound memory",
        )

    # -- the optimizer and the scaler ----------------------------------------------------------------------------
    @G.guarded
    def _on_opt_pre(self, optimizer, args, kwargs):
        if self._step % self.weight_every == 0:
            self._snapshot = [p.detach().clone() for _, p in self._params]

    def _on_opt_post(self, optimizer, args, kwargs):
        if self._off:
            return
        self._opt_stepped = True
        self._record_updates()
        if self._boundary == "optimizer":
            self._end_step(skipped=False)

    @G.guarded
    def _record_updates(self) -> None:
        """On weight steps: each parameter's update (its value now minus the snapshot taken before the step)."""
        if self._snapshot is None:
            return
        rec = self._rec
        for (name, p), old in zip(self._params, self._snapshot):
            sid = self._sites.param(name, "update", p, self._step)
            rec.entries.append(Entry(sid, "update", [(rec.add_full(K.full(p.detach() - old)), "f", p.numel())]))
        self._snapshot = None

    def _wrap_scale(self, original):
        @functools.wraps(original)
        def scale(outputs):
            result = original(outputs)
            self._after_scale(outputs)
            return result

        return scale

    @G.guarded
    def _after_scale(self, outputs) -> None:
        t = outputs if isinstance(outputs, torch.Tensor) else H.first_tensor(outputs)
        if t is not None:
            self._log_loss(t)
        if self._scale_before is None:
            self._scale_before = self._read_scale()

    def _wrap_update(self, original):
        @functools.wraps(original)
        def update(*args, **kwargs):
            self._before_update()
            result = original(*args, **kwargs)
            if not self._off and self._boundary == "scaler":
                self._end_step(skipped=(not self._opt_stepped) if self.optimizer is not None else None)
            return result

        return update

    @G.guarded
    def _before_update(self) -> None:
        if self._scale_before is None:
            self._scale_before = self._read_scale()

    def _read_scale(self):
        """The scale in force, as a device tensor when the scaler keeps one (no host sync)."""
        s = getattr(self.scaler, "_scale", None)
        if isinstance(s, torch.Tensor):
            if K.on_host(s):
                return s.item()
            return s.detach().clone().reshape(())  # update() changes it in place
        return float(self.scaler.get_scale())

    # -- the loss ------------------------------------------------------------------------------------------------
    def _log_loss(self, loss) -> None:
        if isinstance(loss, torch.Tensor):
            if self._loss_dtype is None:
                self._loss_dtype = B.dtype_name(loss.dtype)
            if not loss.numel():
                return
            # a CPU value is read now (no sync to wait for); an accelerator's joins the step's one transfer
            loss = loss.item() if loss.numel() == 1 and K.on_host(loss) else loss.detach().reshape(-1)[0]
        if loss is None:
            return
        if len(self._losses) >= MAX_STEP_LOSSES:  # a step without an end: keep one running sum
            self._losses = [B.sum_losses(self._losses)]
        if self._t_first is None and self._pending is not None and self._pending.loss is None:
            self._pending.late_loss = loss  # logged after the optimizer step ended the step
        else:
            self._losses.append(loss)
