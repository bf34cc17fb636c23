"""make demo: a real model on a real data set, trained with a mixed-precision fault, diagnosed, fixed, trained again.

The data set is scikit-learn's handwritten digits (1,797 8x8 images, shipped inside the package: nothing is
downloaded); the model a 64-128-128-10 MLP in FP16 on the CPU (CPU FP16 matmuls are slow: widths stay <= 128).

    python examples/demo.py [--fault overflow|init-scale|no-scaler|half-weights] [--steps N] [--out runs/demo.db]

1. trains with the fault, ampdoctor attached (the trace goes to --out; an existing file is kept: ampdoctor writes
   name-1.db instead and says so);
2. prints ``ampdoctor diagnose`` of that trace (and, for a loss-scaler fault, ``ampdoctor replay --suggest``);
3. applies the fix of the finding that names the fault, as printed: its code lines are executed on a fresh copy of
   the faulty set-up (a GradScaler line builds the scaler; ``model.float()``, the optimizer line and
   ``ampdoctor.keep_fp32`` run on the model; an autocast line sets the loop's autocast dtype), and trains again into
   name-fixed.db;
4. diagnoses the fixed run, writes the HTML report comparing both, and prints the command that opens the
   dashboard on both traces.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import sys
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import ampdoctor
from ampdoctor import cli


@dataclass(frozen=True)
class Fault:
    """A fault from the troubleshooting table: how the set-up is broken and the rule that must name it."""

    rule: str
    what: str
    half_weights: bool = False  # model.half(), no autocast, FP16 inputs (O3-style)
    scaler: dict | None = None  # GradScaler arguments; None: no scaler
    optimizer: str = "adamw"
    lr: float = 3e-3
    head: str = "linear"  # "cosine": CosineHead, a softmax written by hand


FAULTS = {
    "overflow": Fault(
        "forward-overflow",
        "a cosine classifier (scale 64, as in ArcFace) with a softmax written by "
        "hand: exp(64 cos) passes the FP16 max (65504, about e^11.1) once a cosine exceeds 0.17",
        scaler={},
        head="cosine",
    ),
    "init-scale": Fault(
        "init-scale-too-high",
        "FP16 autocast, GradScaler started at 2^30 (its default is 2^16)",
        scaler={"init_scale": 2.0**30},
    ),
    "no-scaler": Fault(
        "grad-underflow", "FP16 autocast without a GradScaler: nothing lifts small gradients", scaler=None
    ),
    "half-weights": Fault(
        "weight-update-lost",
        "model.half() and plain SGD: FP16 weights, no FP32 master copy",
        half_weights=True,
        optimizer="sgd",
        lr=0.05,
    ),
}


@dataclass
class Setup:
    """What a training run is made of; a printed fix replaces parts of it."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    autocast: torch.dtype | None
    input_dtype: torch.dtype
    lr: float
    applied: list = field(default_factory=list)


# -- data and model ------------------------------------------------------------------------------------------------
def digits():
    """(x_train, y_train, x_val, y_val): pixels 0..16 scaled to 0..1; the last 297 images are held out."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.data, dtype=torch.float32) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    return x[:1500], y[:1500], x[1500:], y[1500:]


class CosineHead(torch.nn.Module):
    """Classes scored by scaled cosine similarity, normalised by a hand-written softmax; returns log-probabilities.

    Under CPU autocast exp runs in FP16 and overflows; CUDA autocast runs exp in FP32, a .half() model does not.
    """

    def __init__(self, d: int, classes: int, scale: float = 64.0):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(classes, d) / d**0.5)
        self.scale = scale

    def forward(self, x):
        cos = torch.nn.functional.normalize(x, dim=-1) @ torch.nn.functional.normalize(self.weight, dim=-1).t()
        e = torch.exp(self.scale * cos)
        return torch.log(e / e.sum(-1, keepdim=True))


def build(fault: Fault, seed: int = 0) -> Setup:
    """The faulty set-up, freshly initialised (the same weights for a given seed)."""
    torch.manual_seed(seed)
    head = CosineHead(128, 10) if fault.head == "cosine" else torch.nn.Linear(128, 10)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), head
    )
    if fault.half_weights:
        model.half()
    opt = (
        torch.optim.SGD(model.parameters(), lr=fault.lr)
        if fault.optimizer == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=fault.lr)
    )
    scaler = torch.amp.GradScaler("cpu", **fault.scaler) if fault.scaler is not None else None
    return Setup(
        model,
        opt,
        scaler,
        None if fault.half_weights else torch.float16,
        torch.float16 if fault.half_weights else torch.float32,
        fault.lr,
    )


# -- the fix, as printed ---------------------------------------------------------------------------------------------
_SETUP_LINE = re.compile(
    r"^(scaler = torch\.amp\.GradScaler\(.*\)|model(\[\d+\]|\.\w+)*\.float\(\)|"
    r"optimizer = torch\.optim\.\w+\(model\.parameters\(\).*\)|"
    r"handle = ampdoctor\.keep_fp32\(model, .*\))(\s*#.*)?$"
)
_AUTOCAST_LINE = re.compile(r'^with torch\.autocast\(device_type="\w+", dtype=torch\.(\w+)\):$')
_LOOP_LINES = (
    "    loss = loss_fn(model(x), y)",
    "scaler.scale(loss).backward()",
    "scaler.step(optimizer)",
    "scaler.update()",
)


def first_option(fix) -> list[str]:
    """The code lines of the fix's first remedy (an alternative starts with a part or line "Or ..." / "# or ...")."""
    lines, seen = [], 0
    for part in fix:
        for ln in part.text.splitlines():
            if seen and ln.startswith(("Or ", "Or,", "# or")):
                return lines
            seen += 1
            if part.kind == "code":
                lines.append(ln)
    return lines


def apply_fix(setup: Setup, finding) -> Setup:
    """Execute the code lines of the printed fix on ``setup`` (setup lines run, loop lines switch the loop)."""
    ns = {"torch": torch, "ampdoctor": ampdoctor, "model": setup.model, "optimizer": setup.optimizer, "lr": setup.lr}
    for line in first_option(finding.fix):
        if _SETUP_LINE.match(line):
            exec(line, ns)
            setup.applied.append(line)
        elif m := _AUTOCAST_LINE.match(line):
            setup.autocast = getattr(torch, m.group(1))
            setup.applied.append(line)
        elif line in _LOOP_LINES:
            setup.applied.append(line)
    setup.scaler = ns.get("scaler", setup.scaler)
    setup.optimizer = ns["optimizer"]
    if any(".float()" in ln for ln in setup.applied):
        setup.input_dtype = torch.float32
    if not setup.applied:
        raise SystemExit(
            "demo: the recommendation holds no code line this demo knows how to apply:\n" + finding.recommendation
        )
    return setup


# -- training --------------------------------------------------------------------------------------------------------
def train(setup: Setup, trace: str, steps: int, label: str, batch: int = 64, seed: int = 1) -> tuple[str, float]:
    """Train ``steps`` optimizer steps with ampdoctor attached; returns (trace path written, validation accuracy)."""
    data = digits()
    with (
        ampdoctor.attach(
            setup.model,
            optimizer=setup.optimizer,
            scaler=setup.scaler,
            trace=trace,
            every=10,
            hist_every=20,
            weight_every=10,
        ) as doctor,
        logging_redirect_tqdm(loggers=[logging.getLogger("ampdoctor")]),
    ):
        # (the findings ampdoctor logs while training are printed above the progress bar, not through it)
        acc = _loop(setup, doctor, data, steps, label, batch, torch.Generator().manual_seed(seed))
    return doctor.path, acc


def _loop(setup: Setup, doctor, data, steps: int, label: str, batch: int, g) -> float:
    """The training loop: FP16 autocast (when set), the GradScaler (when set), validation every 50 steps."""
    xt, yt, xv, yv = data
    model, opt, scaler = setup.model, setup.optimizer, setup.scaler
    acc = float("nan")
    bar = tqdm(range(steps), desc=label, unit="step", disable=None)  # disable=None: no bar outside a terminal
    for step in bar:
        idx = torch.randint(0, len(xt), (batch,), generator=g)
        x, y = xt[idx].to(setup.input_dtype), yt[idx]
        ctx = torch.autocast("cpu", dtype=setup.autocast) if setup.autocast else contextlib.nullcontext()
        with ctx:
            out = model(x)
        # Label smoothing, common practice, also keeps the logit gradients of the unlikely classes (p / batch, ~1e-9
        # without it) out of FP16's subnormal range (without it grad-underflow notes them, as info: they are too
        # small to matter).
        loss = torch.nn.functional.cross_entropy(out.float(), y, label_smoothing=0.1)
        opt.zero_grad(set_to_none=True)
        if scaler is None:
            doctor.log_loss(loss)  # (with a GradScaler, ampdoctor reads it from scaler.scale(loss))
        backward_and_step(loss, opt, scaler)
        if step % 50 == 49 or step == steps - 1:
            acc = accuracy(setup, xv, yv)
            doctor.log_metric("val/acc", acc)
            bar.set_postfix(
                loss=f"{loss.item():.3f}",
                val_acc=f"{acc:.3f}",
                **({"scale": f"{scaler.get_scale():g}"} if scaler is not None else {}),
            )
    return acc


def backward_and_step(
    loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
) -> None:
    """The end of a training step: through the GradScaler where the run has one (it skips a step whose gradients
    hold Inf/NaN and adjusts its scale), else a plain backward and optimizer step. (benchmarks/device_models.py's loop
    ends its steps with this one too.)"""
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        optimizer.step()


def accuracy(setup: Setup, x, y) -> float:
    with torch.no_grad():
        ctx = torch.autocast("cpu", dtype=setup.autocast) if setup.autocast else contextlib.nullcontext()
        with ctx:
            pred = setup.model(x.to(setup.input_dtype)).argmax(1)
    return float((pred == y).float().mean())


# -- the story -------------------------------------------------------------------------------------------------------
def fixed_path(path: str) -> str:
    root, ext = os.path.splitext(path)
    return f"{root}-fixed{ext or '.db'}"


def command(*args: str) -> str:
    """How to run ampdoctor from here: the console script beside this Python, else ``python -m ampdoctor``."""
    exe = os.path.join(os.path.dirname(sys.executable), "ampdoctor")
    head = os.path.relpath(exe) if os.path.exists(exe) else f"{sys.executable} -m ampdoctor"
    return " ".join([head, *args])


def run_cli(*args: str) -> int:
    print(f"\n$ {command(*args)}", flush=True)
    code = cli.main(list(args))
    sys.stdout.flush()
    return code


def cycle(fault_name: str, path: str, steps: int, show=True) -> dict:
    """Fault -> diagnosis -> printed fix applied -> healthy run. Returns the traces, findings and accuracies."""
    fault = FAULTS[fault_name]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    print(f"== 1. training with a fault: {fault.what}", flush=True)
    faulty, acc0 = train(build(fault), path, steps, f"{fault_name} (faulty)")
    findings = ampdoctor.diagnose(faulty)
    if show:
        run_cli("diagnose", faulty)
    named = next((d for d in findings if d.rule == fault.rule), None)
    if named is None:
        raise SystemExit(f"demo: the diagnosis did not name {fault.rule}; found {[d.rule for d in findings]}")
    if show and fault.rule in ("init-scale-too-high", "grad-underflow"):
        run_cli("replay", faulty, "--suggest")
    print(f"\n== 2. applying the fix printed for {named.rule}:")
    setup = apply_fix(build(fault), named)
    for line in setup.applied:
        print(f"    {line}")
    print(flush=True)
    fixed, acc1 = train(setup, fixed_path(faulty), steps, f"{fault_name} (fixed)")
    after = ampdoctor.diagnose(fixed)
    if show:
        run_cli("diagnose", fixed)
    return {
        "fault": fault,
        "faulty": faulty,
        "fixed": fixed,
        "finding": named,
        "findings": findings,
        "after": after,
        "acc": (acc0, acc1),
        "setup": setup,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=list(FAULTS), default="overflow", help="the fault to train with first")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument("--out", default="runs/demo.db", help="trace of the faulty run (the fixed one: NAME-fixed.db)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # 128-wide matrices gain nothing from intra-op threads; on 2 busy cores they cost
    r = cycle(args.fault, args.out, args.steps)
    report = os.path.splitext(r["faulty"])[0] + ".html"
    run_cli("report", r["faulty"], "--reference", r["fixed"], "-o", report)
    serious = [d.rule for d in r["after"] if d.severity != "info"]
    print(f"\n== 3. {r['finding'].rule}: found, fixed as printed, trained again")
    rows = [
        ("warnings or worse", *(sum(d.severity != "info" for d in f) for f in (r["findings"], r["after"]))),
        ("skipped steps", *(int(ampdoctor.load(p).steps()["skipped"].sum()) for p in (r["faulty"], r["fixed"]))),
        ("validation accuracy", *(f"{a:.3f}" for a in r["acc"])),
    ]
    print(f"    {'':20s} {'faulty':>8s} {'fixed':>8s}")
    for name, a, b in rows:
        print(f"    {name:20s} {a!s:>8s} {b!s:>8s}")
    print("the fixed run is healthy" if not serious else f"the fixed run still shows {', '.join(serious)}")
    print(f"\nreport:    {report}")
    print(f"dashboard: {command('serve', r['faulty'], '--reference', r['fixed'])}")
    print("           then open http://127.0.0.1:8050/ (Compare shows both runs side by side)")
    return 0 if not serious else 1


if __name__ == "__main__":
    sys.exit(main())
