"""The step boundary: what the Doctor does when a step ends (the optimizer's step, the scaler's update or
``doctor.step()``): the parameter gradients, the sentinel's figures, the step's one host transfer, the flight
recorder's decision, and the packet the writer receives when the next step starts.

A mixin of Doctor (session.py), over the same per-step fields as the callbacks."""

from __future__ import annotations

import math
import time

import torch

from ..trace import schema
from ..trace.vectors import Entry
from ..trace.writer import StepPacket
from . import buffers as B
from . import cadence as C
from . import callbacks as CB
from . import guards as G
from . import meta
from . import stats as K
from .live import TrainingHalted

_LEVELS = {C.NONE: schema.LEVEL_SENTINEL, C.PEAK: schema.LEVEL_PEAK, C.FULL: schema.LEVEL_FULL}


class StepBoundary:
    def _end_step(self, skipped) -> None:
        if self._off:
            return
        self._record_step(skipped)
        live = self._live
        if live is not None and live.halt is not None and not self._halted:
            self._halted = True  # raised once: a loop that catches it may go on
            # -- issue 23 (on_halt): begin; a framework's callback stops the run its own way and checkpoints --
            if self._on_halt is not None:
                self._on_halt(live.halt)
                return
            # -- issue 23: end --
            raise TrainingHalted(live.halt)

    @G.guarded(timed=False)  # timed inside: the step's observer_time ends with its row
    def _record_step(self, skipped) -> None:
        if self._writer.error is not None:
            raise RuntimeError(f"trace writer failed: {self._writer.error}")
        t0 = time.perf_counter()
        step, mode, store_hist = self._step, self._cur_mode, self._store_hist
        rec = self._rec
        entries = rec.entries

        if mode != C.NONE:
            self._observe_param_grads(mode, entries)
        # The sentinel: global norm and largest unscaled gradient, fused over all gradients, every step.
        norm, gmax = self._grad_figures(self._params)
        norm_off = rec.add_extra(norm) if norm is not None else None
        max_off = rec.add_extra(gmax) if gmax is not None else None
        if step % self.weight_every == 0:
            for name, p in self._params:
                sid = self._sites.param(name, "weight", p, step)
                entries.append(Entry(sid, "weight", [rec.observe(p.detach(), "f")]))
        loss_off = rec.add_extra(B.sum_losses(self._losses)) if self._losses else None
        # Half-precision weights can turn NaN/Inf in an optimizer step from finite gradients (Adam's eps is 0 in
        # FP16): watched every step for them (one fused norm), on anomalous steps only for FP32 weights.
        bad_w_off = rec.add_extra(B.count_nonfinite([p for _, p in self._params])) if self._half_params else None
        scaler_on = self.scaler is not None and self._scaler_enabled()
        scales = [self._scale_before, self._read_scale()] if scaler_on else [None, None]
        scale_offs = [rec.add_extra(v) if isinstance(v, torch.Tensor) else v for v in scales]

        plan = self._grad_plan
        values, bases, bad = rec.to_host(plan.buffers if plan is not None and mode == C.PEAK else ())  # one transfer
        if self._probe is not None:
            self._probe.end(step)
        extra_base = bases["x"]
        # Same control flow as a recent step (the tiers alternate a few layouts): the writer reuses its Layout.
        known = self._known_entries
        same = next((e for e in known if e == entries), None)
        if same is not None:
            entries = same
        else:
            known.insert(0, entries)
            del known[4:]

        def pick(off):
            return None if off is None else float(values[extra_base + off])

        scale_vals = [pick(o) if isinstance(v, torch.Tensor) else v for o, v in zip(scale_offs, scales)]
        # No forward of the attached module and no begin_batch() this step: when the data arrived is unknown, so
        # the data wait is left empty (a wait of the whole step would make the time rules blame the input pipeline).
        started = self._t_first is not None
        if not started and self._step + 1 >= CB.WARN_AFTER_STEPS and not self._step_starts:
            self._warn_once("no-forward", G.no_forward(type(self.model).__name__, self._step + 1))
        row = {
            "time": time.time(),
            "data_time": max(self._t_first - self._t_prev_end, 0.0) if started else None,
            "samples": (self._samples or None) if started else None,
            "lr": [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer is not None else None,
            "microbatches": self._micro,
            "peak_mem": int(torch.cuda.max_memory_allocated()) if self._device == "cuda" else None,
            "level": _LEVELS[mode] if not store_hist else schema.LEVEL_HIST,
            "reason": self._reason,
            "grad_max": pick(max_off),
        }
        packet = StepPacket(
            step=step,
            row=row,
            values=values,
            bases=bases,
            entries=entries,
            loss=pick(loss_off),
            scale=scale_vals[0],
            scale_next=scale_vals[1],
            grad_norm=pick(norm_off),
            skipped=skipped,
            store_hist=store_hist,
        )
        grads_bad = not all(v is None or math.isfinite(v) for v in (packet.grad_norm, row["grad_max"]))
        backoff = skipped is None and None not in scale_vals and scale_vals[1] < scale_vals[0]
        anomalous = (
            bool(skipped) or backoff or bad or grads_bad or (packet.loss is not None and not math.isfinite(packet.loss))
        )
        if anomalous or (bad_w_off is not None and pick(bad_w_off)):
            self._check_weights(step)
        if not anomalous and self._cadence.spike(packet.grad_norm):
            anomalous = True  # observed in full from the next step on; the spike itself is an event
            self._put(
                (
                    "event",
                    step,
                    "grad_spike",
                    None,
                    None,
                    f"gradient norm {packet.grad_norm:.4g} jumped above {C.SPIKE_FACTOR:g}x its running mean "
                    f"{self._cadence.typical_norm:.4g}",
                    {"grad_norm": packet.grad_norm, "running_mean": self._cadence.typical_norm},
                )
            )
        if not self._config_written:
            self._put(("meta", "config", meta.config(self)))
            self._config_written = True
        self._flush_pending()
        self._pending = packet  # sent when the next step starts: a loss logged after opt.step() joins it
        # The flight recorder: an anomaly seen now gets every site in full from the next step on, until a run of
        # clean steps (the tensors of this one are gone; what it observed, or "origin unknown", is recorded).
        self._cadence.after(anomalous)
        obs = self._obs
        self._step += 1
        self._reset_step()
        # The step spans from the end of the previous step's boundary work to the end of this one's, so the steps'
        # times add up to the run's; observer_time is ampdoctor's share of it on the training thread.
        end = time.perf_counter()
        row["step_time"] = end - self._t_prev_end
        row["observer_time"] = obs + (end - t0)
        self._t_prev_end = end

    def _observe_param_grads(self, mode: str, entries: list) -> None:
        """Peaks (or full statistics) of every parameter gradient, in parameter order."""
        if mode != "f":
            present = tuple([p.grad is not None for _, p in self._params])  # (no generator: one call)
            plan = self._grad_plan
            if plan is None or plan.key != present:
                plan = self._grad_plan = B.GradPlan(self._params, present, self._grad_site)
            try:
                plan.run()
            except RuntimeError:  # parameters moved to another device or dtype since the plan was made
                plan = self._grad_plan = B.GradPlan(self._params, present, self._grad_site)
                plan.run()
            entries.extend(plan.entries)
            return
        rec = self._rec
        for name, p in self._params:
            g = p.grad
            if g is None:
                continue
            g = g.detach()
            sid = self._grad_site(name, g)
            if g.layout != torch.strided:  # a sparse gradient: peaks of its stored values only
                entries.append(Entry(sid, "param", [rec.observe(B.dense_values(g), "p")]))
            else:
                entries.append(Entry(sid, "param", [(rec.add_full(K.full(g)), "f", g.numel())]))

    def _check_weights(self, step: int) -> None:
        """On an anomalous step only: are the weights themselves non-finite after the optimizer step? Then a later
        forward NaN comes from the update (e.g. Adam's eps lost in FP16), not from the forward computation."""
        if not self._params:
            return
        norms = torch.stack(
            [n.to(torch.float32) for n in torch._foreach_norm([p.detach() for _, p in self._params])]
        ).cpu()
        bad = [name for (name, _), ok in zip(self._params, torch.isfinite(norms).tolist()) if not ok]
        if len(bad) != self._bad_weights:
            self._bad_weights = len(bad)
            if bad:
                self._put(
                    (
                        "event",
                        step,
                        "nonfinite_weights",
                        None,
                        "update",
                        f"{len(bad)} parameter tensor(s) hold NaN/Inf after the optimizer step",
                        {"params": bad[:100], "count": len(bad)},
                    )
                )

    def _grad_site(self, name: str, grad: torch.Tensor) -> int:
        return self._sites.param(name, "param_grad", grad, self._step)

    def _flush_pending(self) -> None:
        p = self._pending
        if p is None:
            return
        self._pending = None
        if p.late_loss is not None:
            v = p.late_loss
            p.loss = float(v.item() if isinstance(v, torch.Tensor) else v)
            p.late_loss = None
        self._put(("step", p))
