"""A training script as text, run batch by batch: the loop of every reproduction. A printed fix is pasted into it as
printed: a setup part runs once before the loop, a step part replaces the script's forward (computes ``loss``) or
backward (backward and optimizer step) part; a part with an "# and in the loop:" line is both, split there. The
script's names are the ones the fix templates use: torch, ampdoctor, model, optimizer, scaler, loss_fn, x, y, loss."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import torch

import ampdoctor

torch.set_num_threads(1)

LOOP_MARK = "# and in the loop:"
FP16 = 'with torch.autocast(device_type="cpu", dtype=torch.float16):\n    loss = loss_fn(model(x), y)'
SCALED = "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"
PLAIN = "loss.backward()\noptimizer.step()"


@dataclass(frozen=True)
class Script:
    setup: str  # once, before the loop: optimizer (and scaler) over ``model``
    forward: str = FP16  # each step: ``loss`` from model, x, y
    backward: str = SCALED  # each step: backward and optimizer step
    after: str = ""  # each step, after the optimizer step (e.g. scheduler.step())

    def with_fix(self, part: str, role: str) -> Script:
        """This script with one printed code part pasted in as printed: ``role`` is where its text says it goes
        ("setup": before the loop, after the script's own set-up; "forward"/"backward": in place of that part;
        "step": in place of both;
        "setup+step" / "setup+backward": split at its "# and in the loop:" line, the lines before it set-up, the
        lines after it in place of the step's forward and backward / of its backward)."""
        if role == "setup":
            return replace(self, setup=self.setup + "\n" + part)
        if role == "step":  # a whole step: forward, backward and optimizer step
            return replace(self, forward=part, backward="")
        if role in ("setup+step", "setup+backward"):
            before, _, step = part.partition(LOOP_MARK)
            assert step, f"no {LOOP_MARK!r} line in the printed part"
            if role == "setup+step":
                return replace(self, setup=self.setup + "\n" + before, forward=step, backward="")
            return replace(self, setup=self.setup + "\n" + before, backward=step)
        return replace(self, **{role: part})


@dataclass
class Result:
    losses: list
    ns: dict

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)

    def improved(self, factor: float) -> bool:
        """The loss of the last fifth fell to ``factor`` x that of the first fifth (median)."""
        n = max(1, len(self.losses) // 5)
        first, last = sorted(self.losses[:n])[n // 2], sorted(self.losses[-n:])[n // 2]
        return math.isfinite(last) and last <= factor * first


def run(script: Script, model, data, steps: int, trace=None, *, loss_fn=None, attach=None) -> Result:
    """Run ``script`` over ``steps`` batches of ``data``; with ``trace``, ampdoctor attached with its defaults."""
    ns = {"torch": torch, "ampdoctor": ampdoctor, "math": math, "model": model, "loss_fn": loss_fn}
    exec(compile(script.setup, "<setup>", "exec"), ns)
    doc = (
        ampdoctor.attach(ns["model"], optimizer=ns["optimizer"], scaler=ns.get("scaler"), trace=trace, **(attach or {}))
        if trace is not None
        else None
    )
    ns["doctor"] = doc
    # without a GradScaler ampdoctor is told the loss (its documented call); with one it reads it from scale()
    log = "\ndoctor.log_loss(loss)\n" if doc is not None and ns.get("scaler") is None else "\n"
    step = compile(script.forward + log + script.backward + "\n" + script.after, "<step>", "exec")
    losses = []
    with doc if doc is not None else contextlib.nullcontext():
        it = iter(data)
        for _ in range(steps):
            ns["x"], ns["y"] = next(it)
            ns["optimizer"].zero_grad(set_to_none=True)
            exec(step, ns)
            losses.append(float(ns["loss"].detach()))
    return Result(losses, ns)


def code_parts(d) -> list[str]:
    """A finding's code parts, as printed."""
    return [p.text for p in d.fix if p.kind == "code"]


def serious(found) -> list:
    return [d for d in found if d.severity in ("warning", "critical")]


def diagnose(path, **kw) -> tuple[dict, list]:
    found = ampdoctor.diagnose(path, **kw)
    return {d.rule: d for d in reversed(found)}, found
