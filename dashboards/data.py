"""Trace -> plain arrays and rows for the views: no plotly, no dash, no torch.

The figure builders (figures.py) take what these functions return; the dashboard pages and the HTML report both
call them, so the two always show the same numbers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ampdoctor import formats
from ampdoctor.lossscale import TORCH_DEFAULTS
from ampdoctor.lossscale import replay as _replay
from ampdoctor.precision_label import describe_precision
from ampdoctor.trace.observation import cost_line, observation_line
from ampdoctor.trace.schema import ROOT

KINDS = ("act", "grad_out", "param_grad")
# heat map statistic id -> label; for every one of them the worst value of a layer is the largest
STATS = {
    "fp16_under": "FP16 underflow share",
    "fp16_over": "FP16 overflow count",
    "absmax_log2": "log2 abs max",
    "zeros": "zero share",
    "nonfinite": "NaN/Inf count",
}
# the layer types the recommended allocation keeps in FP32 (normalisation, softmax, losses) and the ones that
# should compute in FP16/BF16 (the matrix multiplies and convolutions that make mixed precision fast)
_FP32_TYPES = re.compile(r"Norm|Softmax|Loss|Softmin")
_HALF_TYPES = re.compile(
    r"^(Linear|Bilinear|LazyLinear|Conv\w*|LazyConv\w*|MultiheadAttention|LSTM|GRU|RNN|"
    r"TransformerEncoderLayer|TransformerDecoderLayer)$"
)


# -- summary ----------------------------------------------------------------------------------------------------
def run_summary(tr) -> list[tuple[str, str]]:
    """(label, value) rows: steps, model, precision configuration with observed dtypes, scaler, skips."""
    meta, cfg = tr.meta, tr.config
    run = meta.get("run", {})
    steps = tr.steps()
    sites = tr.sites()
    rows = [
        ("trace", os.path.basename(tr.path)),
        ("steps", f"{len(steps)}" + ("" if "closed" in meta else " (run still writing)")),
        ("model", f"{run.get('model', '?')} ({run.get('params', 0):,} parameters) on {run.get('device', '?')}"),
        ("precision", describe_precision(cfg)),
    ]
    if len(sites):
        for kind in ("act", "grad_out", "param_grad"):
            d = sites[sites["kind"] == kind].groupby("dtype").size().to_dict()
            if d:
                rows.append((f"{kind} dtypes", ", ".join(f"{k} ({v})" for k, v in sorted(d.items()))))
    if cfg.get("param_dtypes"):
        rows.append(("parameters", ", ".join(f"{k} ({v:,})" for k, v in cfg["param_dtypes"].items())))
    sc = cfg.get("scaler")
    if sc:
        settings = ", ".join(
            f"{k} {sc[k]:g}"
            for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
            if isinstance(sc.get(k), (int, float))
        )
        rows.append(("scaler", f"{sc.get('class')} ({'enabled' if sc.get('enabled') else 'disabled'}; {settings})"))
    else:
        rows.append(("scaler", "none"))
    if len(steps):
        n_skip = int(steps["skipped"].sum())
        n_bad = int(steps["nonfinite"].sum())
        rows.append(("skipped steps", f"{n_skip} ({100.0 * n_skip / len(steps):.1f}%)"))
        rows.append(("non-finite steps", str(n_bad)))
        scales = steps["loss_scale"].dropna()
        if len(scales):
            rows.append(
                (
                    "loss scale",
                    f"{scales.iloc[0]:g} at start, {scales.iloc[-1]:g} last, "
                    f"range {scales.min():g} .. {scales.max():g}",
                )
            )
        loss = steps["loss"].replace([np.inf, -np.inf], np.nan).dropna()
        if len(loss):
            rows.append(("loss", f"{loss.iloc[0]:.4g} -> {loss.iloc[-1]:.4g}"))
    rows.append(("observed", observation_line(meta, steps)))
    cost = cost_line(steps)
    if cost:
        rows.append(("overhead", cost))
    ev = tr.events("nonfinite")
    if len(ev):
        e = ev.iloc[0]
        where = f"{e['path']} ({e['site_kind']})" if isinstance(e["path"], str) else "the loss"
        rows.append(("first non-finite", f"step {int(e['step'])}: {where}, {e['phase']} phase"))
    return rows


# -- layers ------------------------------------------------------------------------------------------------------
@dataclass
class LayerMatrix:
    """A statistic of every site of one kind: ``values[site, step]`` at ``steps``; ``worst`` per site."""

    stat: str
    kind: str
    steps: np.ndarray
    site_ids: np.ndarray
    labels: list
    types: list
    values: np.ndarray
    worst: np.ndarray = field(init=False)

    def __post_init__(self):
        v = np.where(np.isfinite(self.values), self.values, np.nan)
        self.worst = np.array([np.nanmax(r) if np.isfinite(r).any() else np.nan for r in v], dtype=float)

    def order(self, by: str = "order") -> np.ndarray:
        """Row order: as recorded (forward order) or worst value first."""
        if by == "worst":
            key = np.where(np.isnan(self.worst), -np.inf, self.worst)
            return np.argsort(-key, kind="stable")
        return np.arange(len(self.labels))


def layer_matrix(tr, stat: str = "fp16_under", kind: str = "grad_out", unscale: bool = False) -> LayerMatrix:
    """``stat`` of every site of ``kind`` over steps. grad_out values are recorded scaled by the loss scale (as
    FP16 holds them, which is what overflow and underflow are about); ``unscale`` divides abs max by the scale in
    force, to compare runs with different scales or none."""
    if stat not in STATS:
        raise ValueError(f"Argument stat should be one of {', '.join(STATS)}, but given {stat!r}")
    sites = tr.sites(kind)
    if stat == "absmax_log2":  # peaks exist at every step
        peak = tr.records("peak", kind)
        with np.errstate(divide="ignore", invalid="ignore"):
            vals = np.log2(peak)
        vals[~np.isfinite(vals)] = np.nan
        steps = np.arange(len(vals))
        if unscale and kind == "grad_out":
            scale = tr.steps()["loss_scale"].to_numpy(dtype=float)[: len(vals)]
            shift = np.where(np.isfinite(scale) & (scale > 0), np.log2(np.where(scale > 0, scale, 1.0)), 0.0)
            vals = vals - shift[:, None]
    else:
        steps = tr.full_steps()
        steps = steps[steps < tr.n_steps]

        def rec(f):
            return tr.records(f, kind)[steps]

        with np.errstate(divide="ignore", invalid="ignore"):
            if stat == "fp16_under":
                vals = (rec("fp16_sub") + rec("fp16_flush")) / rec("numel")
            elif stat == "zeros":
                vals = rec("zeros") / rec("numel")
            elif stat == "fp16_over":
                vals = rec("fp16_over")
            else:
                vals = rec("nan") + rec("inf")
    labels = [str(p) for p in sites["path"]]
    types = [t if isinstance(t, str) else "" for t in sites["module_type"]]
    return LayerMatrix(
        stat,
        kind,
        np.asarray(steps),
        sites["id"].to_numpy(),
        labels,
        types,
        np.asarray(vals, dtype=float).T.reshape(len(labels), len(steps)),
    )


def layer_series(tr, site_id: int, kind: str) -> dict:
    """abs max (every step), RMS (full steps) and the run's gradient norm, for one site."""
    sites = tr.sites(kind)
    j = int(np.flatnonzero(sites["id"].to_numpy() == site_id)[0])
    peak = tr.records("peak", kind)[:, j]
    full = tr.full_steps()
    full = full[full < tr.n_steps]
    rms = tr.records("rms", kind)[full, j] if len(full) else np.array([])
    st = tr.steps()
    return {
        "absmax": (np.arange(len(peak)), peak),
        "rms": (full, rms),
        "grad_norm": (st["step"].to_numpy(), st["grad_norm"].to_numpy()),
    }


def site_info(tr, site_id: int) -> dict | None:
    s = tr.sites()
    row = s[s["id"] == site_id]
    if not len(row):
        return None
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.iloc[0].to_dict().items()}


# -- precision map -----------------------------------------------------------------------------------------------
def precision_rows(tr) -> list[dict]:
    """The recommended allocation against what the run did, module by module, plus loss and weight update.

    Recommended (the guide's table): matmuls/convolutions forward and backward in FP16/BF16; normalisation,
    softmax and the loss in FP32; weights kept and updated in FP32 (master weights).
    """
    cfg = tr.config
    ac = cfg.get("autocast", {}) or {}
    reduced = ac.get("dtype") if ac.get("enabled") else None
    sites = tr.sites()
    act = sites[sites["kind"] == "act"]
    grad = sites[sites["kind"] == "grad_out"].set_index("path")["dtype"].to_dict()
    pdt = cfg.get("module_param_dtypes", {}) or {}
    half = reduced or "float16/bfloat16"
    rows = []
    for s in act.itertuples():
        mtype = s.module_type if isinstance(s.module_type, str) else ""
        if s.path == ROOT:
            continue
        if _FP32_TYPES.search(mtype):
            rec = "float32"
        elif _HALF_TYPES.match(mtype):
            rec = half
        else:
            rec = "follows input"
        observed = s.dtype or "?"
        param = pdt.get(s.path, "-")
        verdict = "ok"
        if rec == "float32" and observed in formats.REDUCED:
            verdict = "should run in FP32"
        elif rec not in ("float32", "follows input") and observed == "float32":
            verdict = "runs in FP32 (no speed-up)"
        if param in formats.REDUCED:
            verdict = "weights in half precision" if verdict == "ok" else verdict + "; weights in half precision"
        rows.append(
            {
                "module": s.path,
                "type": mtype,
                "recommended": rec,
                "forward": observed,
                "backward": grad.get(s.path, "-"),
                "weights": param,
                "verdict": verdict,
            }
        )
    loss = cfg.get("loss_dtype")
    if loss:
        rows.append(
            {
                "module": "loss",
                "type": "",
                "recommended": "float32",
                "forward": loss,
                "backward": "-",
                "weights": "-",
                "verdict": "ok" if loss == "float32" else "should be FP32",
            }
        )
    params = cfg.get("param_dtypes", {}) or {}
    if params:
        upd = ", ".join(sorted(params))
        rows.append(
            {
                "module": "weight update",
                "type": (cfg.get("optimizer") or {}).get("class", ""),
                "recommended": "float32",
                "forward": "-",
                "backward": "-",
                "weights": upd,
                "verdict": "ok" if set(params) == {"float32"} else "keep FP32 master weights",
            }
        )
    return rows


# -- what-if -----------------------------------------------------------------------------------------------------
def scaler_settings(tr) -> dict:
    """The scaler's recorded settings, PyTorch GradScaler defaults for what was not recorded."""
    sc = tr.config.get("scaler") or {}
    out = dict(TORCH_DEFAULTS)
    for k in out:
        if isinstance(sc.get(k), (int, float)):
            out[k] = sc[k]
    st = tr.steps()
    if len(st) and not math.isnan(st["loss_scale"].iloc[0]) and "init_scale" not in sc:
        out["init_scale"] = float(st["loss_scale"].iloc[0])
    return out


def whatif(tr, init_scale=None, growth_factor=None, backoff_factor=None, growth_interval=None) -> dict:
    """Recorded vs simulated loss scale and skipped steps for other scaler settings."""
    cfg = scaler_settings(tr)
    args = {
        "init_scale": init_scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
    }
    used = {k: (cfg[k] if v is None else v) for k, v in args.items()}
    used["growth_interval"] = max(1, int(used["growth_interval"]))
    st = tr.steps()
    if not len(st):
        sim_scales, sim_skipped, engine = np.array([]), np.array([], bool), "nothing to replay yet"
    else:  # settings left at None: the replay keeps the run's own (and its scaler state)
        r = _replay(tr, **{k: (int(v) if k == "growth_interval" else v) for k, v in args.items() if v is not None})
        sim_scales, sim_skipped = np.asarray(r.scales, float), np.asarray(r.skipped, bool)
        used = dict(r.settings)
        engine = "ampdoctor.lossscale"
    n = min(len(st), len(sim_scales))  # a live trace may have grown between the reads
    st, sim_scales, sim_skipped = st.iloc[:n], sim_scales[:n], sim_skipped[:n]
    return {
        "steps": st["step"].to_numpy(),
        "recorded": st["loss_scale"].to_numpy(dtype=float),
        "recorded_skipped": st["skipped"].to_numpy(bool),
        "simulated": sim_scales,
        "simulated_skipped": sim_skipped,
        "settings": used,
        "engine": engine,
    }


# -- compare -----------------------------------------------------------------------------------------------------
def compare_layers(tr_a, tr_b, stat: str = "absmax_log2", kind: str = "grad_out") -> pd.DataFrame:
    """Per layer (matched by path): the mean of ``stat`` over steps in both runs and the difference b - a
    (gradient abs max unscaled, so runs with different loss scales compare)."""
    out = []
    for tr in (tr_a, tr_b):
        lm = layer_matrix(tr, stat, kind, unscale=True)
        with np.errstate(all="ignore"):
            v = np.where(np.isfinite(lm.values), lm.values, np.nan)
            means = [np.nanmean(r) if np.isfinite(r).any() else np.nan for r in v]
        out.append(pd.Series(means, index=lm.labels, dtype=float))
    df = pd.DataFrame({"a": out[0], "b": out[1]}).dropna(how="all")  # a layer with no value in either run goes
    order = dict.fromkeys([*out[0].index, *out[1].index])  # this run's layer order, then the other's
    df = df.loc[[p for p in order if p in df.index]]
    df["diff"] = df["b"] - df["a"]
    return df


# -- formats: the FP8/FP16/BF16 what-if and the precision-loss probe --------------------------------------------
def formats_rows(tr, max_rows: int = 200) -> list[dict]:
    """Per site (activations, output gradients): the share of non-zero values each format would lose (saturated or
    flushed; FP8 with Transformer Engine's default delayed scaling) and the FP16 headroom, worst E4M3 first."""
    from ampdoctor import whatif

    table = whatif.formats_table(tr)
    if not len(table):
        return []
    table = table.sort_values("e4m3_lost", ascending=False, na_position="last").head(max_rows)

    def pct(v):
        return "-" if v != v else f"{100 * v:.2f}%"

    def binades(v):
        return "-" if v != v else f"{v:.1f}"

    return [
        {
            "layer": r.path,
            "kind": r.kind,
            "dtype": r.dtype,
            "FP16 headroom (binades)": binades(r.fp16_headroom),
            "BF16 headroom": binades(r.bf16_headroom),
            "span (binades)": binades(r.span),
            "FP16 lost": pct(r.fp16_lost),
            "BF16 lost": pct(r.bf16_lost),
            "E4M3 lost": pct(r.e4m3_lost),
            "E5M2 lost": pct(r.e5m2_lost),
        }
        for r in table.itertuples()
    ]


def formats_shares(tr, max_rows: int = 40) -> tuple[list, dict]:
    """(labels, {format: lost shares}) of the sites worst in E4M3, for the formats bar chart."""
    from ampdoctor import whatif

    table = whatif.formats_table(tr)
    if not len(table):
        return [], {}
    table = table.sort_values("e4m3_lost", ascending=False, na_position="last").head(max_rows)
    labels = [f"{p} ({k})" for p, k in zip(table["path"], table["kind"])]
    return labels, {n.upper(): table[f"{n}_lost"].to_numpy(float) for n in whatif.FORMATS}


def probe_series(tr, max_layers: int = 12) -> tuple[dict, dict, list[dict]]:
    """Probe error over steps: ({layer: (steps, rel_err)}, {layer: sqrt(k)*u bound}, per-layer verdicts), the
    named layers and the largest ratios first."""
    from ampdoctor.rules import precision
    from ampdoctor.rules.engine import Run as _DiagRun

    verdicts = precision.layer_verdicts(_DiagRun(tr))
    pr = tr.probes()
    series, bounds = {}, {}
    for v in verdicts[:max_layers]:
        g = pr[pr["path"] == v["path"]]
        series[v["path"]] = (g["step"].to_numpy(), g["rel_err"].to_numpy(float))
        bounds[v["path"]] = v["bound"]
    return series, bounds, verdicts
