"""One command that checks ampdoctor on an accelerator: ``benchmarks/device_check.py [--device cuda|cpu] [--small]
[--out DIR]``. Under 8 minutes on one GPU; ``--device cpu --small`` runs every section small (tests/test_device_check.py
runs it so, in about half a minute), so the script is known to work before a GPU is lent.

Sections (each timed, each one pass/fail line; a failure in one does not stop the others):
1. Bit-identical training with and without ampdoctor: FP16 + GradScaler and BF16, a model with Dropout and BatchNorm,
   default tiers with an outlier batch (so that the anomaly replay runs) and debug mode: parameters, buffers, losses and
   the loss scale equal.
2. Autocast op lists per device: every op sample of ampdoctor/autocast_ops.py run under the device's autocast (FP16,
   BF16) shows the rule the lists give.
3. Host syncs per step: on CUDA with ``torch.cuda.set_sync_debug_mode("warn")``, on the CPU by counting host reads
   with the accelerator path emulated, and the calls that wait for the device on CUDA without a host read (bincount,
   nonzero, boolean indexing, host data put on the device: hostsync.syncs_on_cuda); ampdoctor's own per clean step
   (expected: none on sentinel and sampled steps), the GradScaler's and the loop's apart.
4. Fault scenarios that do not depend on the CPU's autocast lists (a Linear's FP16 overflow, an initial scale too
   high, a one-off outlier batch on a sentinel-only step, replayed and traced to its operation), each printed fix
   applied as printed; a tiny GPT-2 from a config, healthy in FP16 and BF16 and with a scaled attention weight.
5. Overhead on real kernels (bare, defaults, defaults with budget=0.03, debug, naive .item() hooks, transformers'
   DebugUnderflowOverflow) on the reference model and a GPT-2-small-sized one, FP16 + GradScaler and BF16: median of
   the per-round ratios; see device_overhead.py.
6. The FP8 what-if against real casts: ampdoctor's shares from histograms against real float8_e4m3fn / float8_e5m2
   (and FP16/BF16) casts of the same tensors on the device; the cast boundaries value by value.

Writes DIR/device_check.json (every check, figure and timing) and DIR/device_check.txt (the printed report); exits 0
when every section passed, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))


@dataclass(frozen=True)
class Setup:
    device: str  # "cuda" or "cpu"
    small: bool
    traces: str  # where the runs' traces go: out/traces (out/traces-35 for a rerun of sections 3 and 5)
    rounds: int
    block_s: float

    def trace(self, name: str) -> str:
        path = os.path.join(self.traces, f"{name}.db")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _FOUND.pop(path, None)
        for suffix in ("", "-wal", "-shm"):  # (left by a run that stopped before its report)
            with contextlib.suppress(OSError):
                os.remove(path + suffix)
        return path


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class Section:
    number: int
    title: str
    checks: list[Check] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # this process's CPU time (a loaded machine stretches the wall time, not this)
    error: str | None = None

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c.ok for c in self.checks)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        say(f"  {'ok  ' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""))
        return bool(ok)

    def note(self, text: str) -> None:
        self.notes.append(text)
        say(f"       {text}")

    def say(self, line: str) -> None:
        """A line of the printed report (a table)."""
        say(line)

    def attempt(self, what: str, fn: Callable[[], None]) -> None:
        """Run one part of the section; an exception is a failed check, and the section goes on."""
        try:
            fn()
        except Exception as exc:
            where = traceback.extract_tb(exc.__traceback__)[-1]
            self.check(what, False, f"{type(exc).__name__}: {exc} ({os.path.basename(where.filename)}:{where.lineno})")


BUDGET_S = 480.0  # the whole check, on one GPU
LOG: list[str] = []  # the printed report
_FOUND: dict[str, list] = {}  # trace -> its findings (diagnosed once)
# ampdoctor's warnings that it stopped observing, or wrote an incomplete trace: a section with one fails
_INTERNAL = re.compile(r"ampdoctor: (collection stopped|the trace .* may be incomplete|cannot write)")


def say(line: str = "") -> None:
    LOG.append(line)
    print(line, flush=True)


# -- 1. bit-identical training ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def deterministic(device: str) -> Iterator[None]:
    """Deterministic kernels while comparing two runs bit for bit (on CUDA an atomics-based kernel could differ in its
    last bits between two runs with or without ampdoctor)."""
    import torch

    before = torch.are_deterministic_algorithms_enabled()
    if device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*deterministic")
            yield
    finally:
        torch.use_deterministic_algorithms(before)


def bit_identical(s: Setup, sec: Section) -> None:
    import device_models as M
    import torch

    import ampdoctor

    steps = 45  # past OUTLIER_STEP (37)
    spike = 30.0  # an outlier batch 30x the others: a loss and gradient-norm spike (no overflow), replayed
    # FP16: an initial scale of 2**20 also makes the first steps overflow in the backward (skipped by the scaler)
    scaler_kw = {"init_scale": 2.0**20}

    for precision in ("fp16", "bf16"):
        for mode in ("default", "debug"):
            path = s.trace(f"identical-{precision}-{mode}")
            attach = {"mode": "debug"} if mode == "debug" else {}
            runs = []
            for trace in (None, path):
                data = M.classes(steps, outlier={M.OUTLIER_STEP: spike})
                with deterministic(s.device):
                    runs.append(
                        M.train(
                            M.net(norm=False),
                            data,
                            device=s.device,
                            precision=precision,
                            trace=trace,
                            attach=attach,
                            scaler_kw=scaler_kw,
                        )
                    )
            ref, got = runs
            a, b = ref.model.state_dict(), got.model.state_dict()
            state = all(torch.equal(a[k], b[k]) for k in a)
            losses = [repr(v) for v in ref.losses] == [repr(v) for v in got.losses]
            scale = ref.scaler is None or ref.scaler.get_scale() == got.scaler.get_scale()
            tr = ampdoctor.load(path)
            st = tr.steps()
            replays = tr.events("replay")
            skipped = int(st["skipped"].sum())
            what = f"{len(a)} tensors (parameters and BatchNorm buffers) {'equal' if state else 'DIFFER'}"
            what += f", {steps} losses {'equal' if losses else 'DIFFER'}"
            if ref.scaler is not None:
                what += f", scale {got.scaler.get_scale():g} {'equal' if scale else 'DIFFERS'} ({skipped} skipped)"
            what += f"; replays at steps {sorted(set(replays['step']))}"
            ok = state and losses and scale and len(st) == steps and M.OUTLIER_STEP in set(replays["step"])
            label = {"fp16": "FP16 + GradScaler", "bf16": "BF16"}[precision]
            sec.check(f"{label}, {'debug mode' if mode == 'debug' else 'default tiers'}", ok, what)


# -- 2. autocast op lists ---------------------------------------------------------------------------------------------
def autocast_lists(s: Setup, sec: Section) -> None:
    import torch

    from ampdoctor import autocast_ops

    dtypes = ["float16", "bfloat16"]
    if s.device == "cuda" and not torch.cuda.is_bf16_supported():
        dtypes = ["float16"]
        sec.note("this GPU has no BF16: FP16 only")
    for dtype in dtypes:
        rows = autocast_ops.check(s.device, dtype)
        wrong = [f"{op}: listed {listed}, observed {seen}" for op, listed, seen in rows if listed != seen]
        counts = {rule or "none": sum(1 for _, listed, _ in rows if listed == rule) for rule in sorted_rules(rows)}
        sec.check(
            f"{dtype}: {len(rows)} ops run under {s.device} autocast show the rule of the {s.device} lists",
            not wrong,
            "; ".join(wrong) if wrong else ", ".join(f"{k} {v}" for k, v in counts.items()),
        )
        sec.data[dtype] = [list(r) for r in rows]
    get = getattr(torch._C, "_dispatch_get_registrations_for_dispatch_key", None)
    if get is not None:
        key = "AutocastCUDA" if s.device == "cuda" else "AutocastCPU"
        registered = {autocast_ops.short_name(op) for op in get(key)}
        listed = set().union(*autocast_ops.LISTS[s.device].values()) | autocast_ops.CUDA_BANNED
        missing = sorted(registered - listed)
        sec.check(
            f"every op torch {torch.__version__} registers for {key} is on a list",
            not missing,
            ", ".join(missing) or f"{len(registered)} ops",
        )


def sorted_rules(rows: list) -> list:
    return [r for r in ("lower", "float32", "promote", None) if any(listed == r for _, listed, _ in rows)]


# -- 3. host syncs per step -------------------------------------------------------------------------------------------
@contextlib.contextmanager
def accelerator_path_on_cpu() -> Iterator[None]:
    """The accelerator path run on the CPU: no value read on the host as computed, transfers a step late."""
    from ampdoctor.collect import stats, transfer

    saved = stats.HOST_READS, transfer.EMULATED_LAG
    stats.HOST_READS, transfer.EMULATED_LAG = False, 1
    try:
        yield
    finally:
        stats.HOST_READS, transfer.EMULATED_LAG = saved


@contextlib.contextmanager
def transfer_waits(counter: Any) -> Iterator[dict]:
    """CUDA: count the step-figure copies read before their event completed (a wait in cudaEventSynchronize, which
    set_sync_debug_mode does not report): at most MAX_IN_FLIGHT steps stay in flight before the oldest is waited
    for."""
    from ampdoctor.collect import transfer

    waits: dict[int, int] = {}
    original = transfer.Transfer.values

    def values(self: transfer.Transfer) -> Any:
        event = getattr(self, "_event", None)
        if event is not None and not event.query():
            waits[counter.step] = waits.get(counter.step, 0) + 1
        return original(self)

    transfer.Transfer.values = values
    try:
        yield waits
    finally:
        transfer.Transfer.values = original


def host_syncs(s: Setup, sec: Section) -> None:
    import device_models as M
    from hostsync import AMPDOCTOR, LOOP, SCALER, HostReads, SyncWarnings

    import ampdoctor

    steps = 40 if s.small else 80
    opts = {"calibration": 2, "peak_every": 3, "every": 7, "hist_every": 14}
    how = "set_sync_debug_mode('warn')" if s.device == "cuda" else "host reads, accelerator path emulated"
    sec.note(f"counted by {how}; the loop calls loss.item() every 10th step (a logging loop's own sync)")
    for precision in ("fp16", "bf16"):
        counter = SyncWarnings() if s.device == "cuda" else HostReads()
        path = s.trace(f"syncs-{precision}")
        emulate = accelerator_path_on_cpu() if s.device == "cpu" else contextlib.nullcontext()
        with emulate, transfer_waits(counter) as waits, counter:
            M.train(
                M.mlp(width=32, seed=2),
                M.regression(steps),
                device=s.device,
                precision=precision,
                loss_fn=M.mse,
                lr=0.01,
                trace=path,
                attach=opts,
                on_step=functools.partial(setattr, counter, "step"),
                item_every=10,
            )
        st = ampdoctor.load(path).steps()
        bad = set(st.loc[st["skipped"] | st["nonfinite"].astype(bool), "step"])
        # a step during which an anomalous step's late verdict came in may read (the weights are checked then)
        clean = [t for t in range(opts["calibration"] + 1, steps) if not bad & set(range(t - 3, t + 1))]
        kinds = {-1: "sentinel", 0: "peaks", 1: "full statistics", 2: "histograms"}
        by_kind: dict[str, list[int]] = {}
        for t in clean:
            by_kind.setdefault(kinds[int(st.loc[t, "level"])], []).append(counter.counts[AMPDOCTOR].get(t, 0))
        ours = {t: counter.counts[AMPDOCTOR].get(t, 0) for t in clean}
        detail = ", ".join(f"{k} steps {sum(v)} in {len(v)}" for k, v in by_kind.items())
        offenders = {w: n for w, n in counter.where[AMPDOCTOR].items()}
        if any(ours.values()):
            detail += "; made at " + ", ".join(f"{w} ({n})" for w, n in sorted(offenders.items(), key=lambda x: -x[1]))
        enough = len(clean) >= steps // 2 and {"sentinel", "peaks", "full statistics"} <= set(by_kind)
        sec.check(
            f"{precision}: ampdoctor's syncs on {len(clean)} clean steps: none",
            enough and not any(ours.values()),
            detail,
        )
        per = {p: sum(n for t, n in counter.counts[p].items() if 0 <= t < steps) / steps for p in (SCALER, LOOP)}
        rest = sum(counter.counts[AMPDOCTOR].get(t, 0) for t in range(steps) if t not in ours)
        sec.note(
            f"{precision}: GradScaler {per[SCALER]:.2f} per step (its found-inf check in step() with FP16), the loop "
            f"{per[LOOP]:.2f} per step; ampdoctor {rest} on the {steps - len(clean)} calibration or anomalous steps "
            f"(anomalies at {sorted(bad)})"
            + (f"; waits for an unfinished copy: {sum(waits.values())}" if waits else "")
        )
        on_cuda = getattr(counter, "on_cuda", None)  # (the CPU run: calls that would synchronize on CUDA)
        if on_cuda is not None:
            calls = {t: on_cuda.counts[AMPDOCTOR].get(t, 0) for t in clean}
            kinds_seen = sorted({kinds[int(st.loc[t, "level"])] for t, n in calls.items() if n})
            where = ", ".join(f"{w} ({n})" for w, n in on_cuda.where[AMPDOCTOR].items())
            sec.check(
                f"{precision}: ampdoctor's calls that wait for the device on CUDA without a host read (bincount, "
                f"nonzero, boolean indexing, host data put on the device...) on {len(clean)} clean steps: none",
                enough and not any(calls.values()),
                f"{sum(calls.values())} on clean {' and '.join(kinds_seen)} steps; made at {where}"
                if any(calls.values())
                else f"all calls of the run: {where or 'none'}",
            )
        sec.data[precision] = {
            "cuda_sync_calls": dict(on_cuda.counts[AMPDOCTOR]) if on_cuda is not None else None,
            "clean_steps": clean,
            "ampdoctor_by_step": dict(counter.counts[AMPDOCTOR]),
            "scaler_per_step": per[SCALER],
            "loop_per_step": per[LOOP],
            "where": {p: dict(counter.where[p]) for p in counter.where},
            "copy_waits": waits,
        }


# -- 4. fault scenarios -----------------------------------------------------------------------------------------------
MATMUL_OPS = {"aten::addmm", "aten::mm", "aten::matmul", "aten::linear", "aten::_addmm_activation", "aten::bmm"}


def code_lines(recommendation: str, pattern: str) -> list[str]:
    """The lines of a printed recommendation that match ``pattern`` (the code to apply as printed)."""
    return [ln for ln in recommendation.splitlines() if re.search(pattern, ln)]


def applying(code: str) -> Callable[[dict], None]:
    """A train() setup that executes printed code against the run's own model, optimizer and scaler."""

    def setup(ns: dict) -> None:
        exec(code, ns)

    return setup


def findings(path: str) -> list:
    """ampdoctor.diagnose(path), once per trace."""
    import ampdoctor

    if path not in _FOUND:
        _FOUND[path] = list(ampdoctor.diagnose(path))
    return _FOUND[path]


def serious(path: str) -> list:
    return [d for d in findings(path) if d.severity in ("warning", "critical")]


def by_rule(path: str) -> dict:
    """The first finding of each rule."""
    return {d.rule: d for d in reversed(findings(path))}


KEEP_FP32 = r"^handle = ampdoctor\.keep_fp32\(model, "


def faults(s: Setup, sec: Section) -> None:
    sec.attempt("a Linear's forward overflow", lambda: fault_linear(s, sec))
    sec.attempt("an initial scale too high", lambda: fault_init_scale(s, sec))
    sec.attempt("a one-off outlier batch", lambda: fault_outlier(s, sec))
    sec.attempt("Hugging Face GPT-2", lambda: hf(s, sec))


def fault_linear(s: Setup, sec: Section) -> None:
    """A Linear whose FP16 output always overflows, located in its module; keep_fp32 as printed removes it."""
    import device_models as M

    import ampdoctor

    dev = s.device
    x0 = next(M.classes(1))[0]
    keep = KEEP_FP32
    path = s.trace("fault-linear")
    M.train(M.scale_output_peak(M.net(), M.BIG, 2e5, x0), M.classes(20), device=dev, trace=path)
    d = by_rule(path).get("forward-overflow")
    sec.check(
        "forward overflow of a Linear located in its module",
        d is not None and d.layers[0] == M.BIG,
        f"{d.severity}: {d.summary[:160]}" if d else f"no forward-overflow finding ({sorted(by_rule(path))})",
    )
    line = code_lines(d.recommendation, keep) if d else []
    fixed = s.trace("fault-linear-fixed")
    if line:
        run = M.train(
            M.scale_output_peak(M.net(), M.BIG, 2e5, x0),
            M.classes(20),
            device=dev,
            trace=fixed,
            setup=applying(line[0]),
        )
        st = ampdoctor.load(fixed).steps()
        ok = not st["nonfinite"].any() and all(math.isfinite(v) for v in run.losses)
        sec.check(
            f"its fix as printed ({line[0].split('#')[0].strip()}): no non-finite step",
            ok,
            f"{int(st['nonfinite'].sum())} non-finite of {len(st)}; findings {sorted(by_rule(fixed))}",
        )
    else:
        sec.check("its fix is printed (a keep_fp32 line)", False, d.recommendation[:300] if d else "")


def fault_init_scale(s: Setup, sec: Section) -> None:
    """An initial loss scale too high; the printed GradScaler line applied as printed."""
    import device_models as M

    import ampdoctor

    dev = s.device
    path = s.trace("fault-init-scale")
    M.train(
        M.mlp(), M.regression(40), device=dev, loss_fn=M.mse, lr=0.01, trace=path, scaler_kw={"init_scale": 2.0**30}
    )
    found = by_rule(path)
    d = found.get("init-scale-too-high")
    skipped = int(ampdoctor.load(path).steps()["skipped"].sum())
    sec.check(
        "initial scale 2**30: init-scale-too-high",
        d is not None and d.severity != "info",
        f"{skipped} steps skipped; findings {sorted(found)}",
    )
    line = code_lines(d.recommendation, r"^scaler = torch\.amp\.GradScaler\(") if d else []
    if line:
        fixed = s.trace("fault-init-scale-fixed")
        M.train(M.mlp(), M.regression(40), device=dev, loss_fn=M.mse, lr=0.01, trace=fixed, setup=applying(line[0]))
        left = serious(fixed)
        sec.check(f"its fix as printed ({line[0]}): no warning", not left, "; ".join(x.rule for x in left))
    else:
        sec.check("its fix is printed (a GradScaler line)", False, d.recommendation[:300] if d else "")


def fault_outlier(s: Setup, sec: Section) -> None:
    """A one-off outlier batch on a sentinel-only step: replayed exactly, its operation and batch found, an
    outlier-batch finding; its printed keep_fp32 line (checked on the replayed step) applied as printed."""
    import device_models as M

    import ampdoctor

    dev = s.device
    x0 = next(M.classes(1))[0]
    keep = KEEP_FP32
    path = s.trace("fault-outlier")
    data = M.classes(45, outlier={M.OUTLIER_STEP: M.OUTLIER})
    M.train(M.scale_output_peak(M.net(), M.BIG, 256.0, x0), data, device=dev, trace=path)
    tr = ampdoctor.load(path)
    st = tr.steps().set_index("step")
    row = st.loc[M.OUTLIER_STEP]
    before = set(st.loc[M.OUTLIER_STEP - 6 : M.OUTLIER_STEP - 1, "reason"])
    sec.check(
        f"step {M.OUTLIER_STEP} (an outlier batch, {M.OUTLIER:g}x) between sentinel-only steps: skipped, replayed",
        bool(row["skipped"]) and bool(row["nonfinite"]) and row["reason"] == "replay" and before == {"sentinel"},
        f"reason {row['reason']}, skipped {bool(row['skipped'])}, steps before: {sorted(before)}",
    )
    replays = tr.events("replay").set_index("step")
    rep = replays.loc[M.OUTLIER_STEP, "data"] if M.OUTLIER_STEP in replays.index else {}
    sec.check(
        "the replay was exact and reproduced the non-finite step",
        bool(rep.get("exact")) and bool(rep.get("reproduced")),
        "; ".join(rep.get("not_exact", [])) or f"in {rep.get('seconds', 0):.2f} s",
    )
    ops = tr.events("operation").set_index("step")
    op = ops.loc[M.OUTLIER_STEP, "data"] if M.OUTLIER_STEP in ops.index else {}
    sec.check(
        f"the operation: a matmul in {M.BIG} (forward)",
        op.get("op") in MATMUL_OPS and op.get("module") == M.BIG and op.get("phase") == "fwd",
        f"{op.get('op')} in {op.get('module')} ({op.get('phase')}, {op.get('dtype')})" if op else "no operation event",
    )
    batch = rep.get("batch", {})
    sec.check(
        "its batch: an outlier against the usual peak",
        bool(batch.get("outlier")) and batch.get("factor", 0) >= 100,
        f"factor {batch.get('factor', float('nan')):.0f}",
    )
    rules = by_rule(path)
    d = rules.get("outlier-batch")  # (it suppresses forward-overflow on its step: the batch explains the overflow)
    sec.check("the finding: outlier-batch", d is not None, str(sorted(rules)))
    line = code_lines(d.recommendation, keep) if d else []
    if line:
        fixed = s.trace("fault-outlier-fixed")
        data = M.classes(45, outlier={M.OUTLIER_STEP: M.OUTLIER})
        M.train(
            M.scale_output_peak(M.net(), M.BIG, 256.0, x0),
            data,
            device=dev,
            trace=fixed,
            setup=applying(line[0]),
        )
        st2 = ampdoctor.load(fixed).steps().set_index("step")
        sec.check(
            f"its fix as printed ({line[0].split('#')[0].strip()}): the outlier step passes",
            not st2.loc[M.OUTLIER_STEP, "nonfinite"] and not st2["skipped"].loc[M.OUTLIER_STEP :].any(),
        )
    else:
        sec.check(
            "a fix checked on the step is printed for it (outlier-batch's keep_fp32 line)", False, str(sorted(rules))
        )


def hf(s: Setup, sec: Section) -> None:
    """A tiny GPT-2 from a config: healthy in FP16 + GradScaler and BF16; a scaled attention weight located."""
    import device_models as M
    import torch

    try:
        import transformers  # noqa: F401
    except ImportError:
        sec.check("transformers is installed (the Hugging Face scenarios)", False)
        return
    kw = {"device": s.device, "forward": M.hf_loss, "optimizer": "adamw", "lr": 1e-3, "attach": M.HF_CADENCE}
    for precision in ("fp16", "bf16"):
        if precision == "bf16" and s.device == "cuda" and not torch.cuda.is_bf16_supported():
            continue
        path = s.trace(f"gpt2-healthy-{precision}")
        run = M.train(M.gpt2(), M.tokens(8), precision=precision, trace=path, **kw)
        left = serious(path)
        sec.check(
            f"GPT-2 (tiny, from a config) in {precision}: healthy, no warning",
            not left and all(math.isfinite(v) for v in run.losses),
            "; ".join(d.rule for d in left),
        )
    attn = "transformer.h.1.attn.c_attn"
    model = M.gpt2()
    ids = next(M.tokens(1))[0]
    M.scale_output_peak(model, attn, 2e5, ids)
    path = s.trace("gpt2-attention-weight")
    M.train(model, M.tokens(8), precision="fp16", trace=path, **kw)
    d = by_rule(path).get("forward-overflow")
    sec.check(
        f"GPT-2 with {attn}'s weight scaled: the overflow located there",
        d is not None and d.layers[0] == attn,
        f"{d.severity}: {d.summary[:160]}" if d else f"findings {sorted(by_rule(path))}",
    )


# -- 5. overhead ------------------------------------------------------------------------------------------------------
def overhead(s: Setup, sec: Section) -> None:
    import device_overhead

    device_overhead.section(s, sec)


# -- 6. the FP8 what-if against real casts ----------------------------------------------------------------------------
def fp8_whatif(s: Setup, sec: Section) -> None:
    import device_fp8

    device_fp8.section(s, sec)


SECTIONS: list[tuple[str, Callable[[Setup, Section], None]]] = [
    ("bit-identical training with and without ampdoctor", bit_identical),
    ("autocast op lists observed on the device", autocast_lists),
    ("host syncs per step", host_syncs),
    ("fault scenarios and Hugging Face GPT-2", faults),
    ("overhead on real kernels", overhead),
    ("FP8 what-if against real casts", fp8_whatif),
]


def environment(device: str) -> dict:
    import torch

    env = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gb=props.total_memory / 2**30,
            cuda=torch.version.cuda,
            bf16=torch.cuda.is_bf16_supported(),
        )
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None, help="default: cuda when available")
    ap.add_argument("--small", action="store_true", help="small models and few rounds (the CPU run of the suite)")
    ap.add_argument("--out", help="directory for device_check.json and .txt (default: runs/device_check-<device>)")
    ap.add_argument("--sections", default="1,2,3,4,5,6", help="which sections, e.g. 3,5 (a rerun of some)")
    ap.add_argument("--rounds", type=int, default=None, help="overhead rounds (default 5; --small 2)")
    ap.add_argument("--block-s", type=float, default=None, help="seconds of bare training per overhead block")
    args = ap.parse_args(argv)
    try:
        wanted = sorted({int(x) for x in args.sections.split(",")})
        assert wanted and all(1 <= k <= len(SECTIONS) for k in wanted)
    except (ValueError, AssertionError):
        print(f"device_check: --sections should be numbers from 1 to {len(SECTIONS)}, given {args.sections!r}")
        return 2
    if (args.rounds is not None and args.rounds < 1) or (args.block_s is not None and not args.block_s > 0):
        print(f"device_check: --rounds should be >= 1 and --block-s > 0, given {args.rounds} and {args.block_s}")
        return 2
    name = "device_check" if len(wanted) == len(SECTIONS) else "device_check-" + "".join(map(str, wanted))
    if args.out and os.path.exists(os.path.join(args.out, f"{name}.json")):
        print(f"device_check: {os.path.join(args.out, name)}.json exists; give another --out (nothing is overwritten)")
        return 2
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print(f"device_check: --device cuda, but this torch ({torch.__version__}) sees no CUDA device")
        return 2
    if device == "cuda":  # before any GEMM: cuBLAS reads it when it creates its handle (deterministic GEMMs)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    out = args.out or os.path.join("runs", f"device_check-{device}{'-small' if args.small else ''}")
    report = os.path.join(out, f"{name}.json")
    if os.path.exists(report):
        print(f"device_check: {report} exists; give another --out (nothing is overwritten)")
        return 2
    os.makedirs(out, exist_ok=True)
    if device == "cpu":
        torch.set_num_threads(1)  # small models: a second thread only waits on a loaded machine
    traces = os.path.join(out, name.replace("device_check", "traces"))
    rounds, block_s = args.rounds or (2 if args.small else 5), args.block_s or (0.05 if args.small else 0.4)
    setup = Setup(device, args.small, traces, rounds, block_s)
    env = environment(device)
    say(
        f"ampdoctor device check on {env.get('gpu', env['cpu'])} ({device}), torch {env['torch']}"
        f"{', small' if args.small else ''}"
    )
    t_all = time.perf_counter()
    sections = []
    for k in wanted:
        title, fn = SECTIONS[k - 1]
        sec = Section(k, title)
        say(f"\n== {k}. {title}")
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn(setup, sec)
            internal = sorted({str(w.message) for w in caught if _INTERNAL.search(str(w.message))})
            if internal:
                sec.check("ampdoctor ran without an internal error", False, "; ".join(internal)[:600])
        except Exception as exc:
            sec.error = f"{type(exc).__name__}: {exc}"
            say(f"  FAIL the section stopped: {sec.error}")
            say("\n".join("       " + ln for ln in traceback.format_exc().rstrip().splitlines()[-12:]))
        sec.seconds, sec.cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
        say(f"   -> {'PASS' if sec.passed else 'FAIL'} in {sec.seconds:.1f} s (CPU {sec.cpu_seconds:.1f} s)")
        sections.append(sec)
    total = time.perf_counter() - t_all
    say("\nSummary")
    for sec in sections:
        say(f"  {'PASS' if sec.passed else 'FAIL'}  {sec.number}. {sec.title} ({sec.seconds:.1f} s)")
    say(f"  {sum(x.passed for x in sections)} of {len(sections)} sections passed in {total:.0f} s; {report}")
    if device == "cuda" and len(wanted) == len(SECTIONS) and not args.small and total > BUDGET_S:
        say(f"  (over the {BUDGET_S / 60:.0f}-minute budget of one GPU check: the slowest sections are above)")
    result = {
        "environment": env,
        "small": args.small,
        "seconds": total,
        "passed": all(x.passed for x in sections),
        "sections": [{**asdict(x), "passed": x.passed} for x in sections],
    }
    with open(report, "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, f"{name}.txt"), "w") as f:
        f.write("\n".join(LOG) + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
