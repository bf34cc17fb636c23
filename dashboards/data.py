"""Trace -> plain rows and arrays for the views: no plotly, no dash, no torch.

The figure builders (figures.py) take what these functions return; the dashboard pages and the HTML report both
call them, so the two always show the same numbers. Per-step series are in series.py, per-layer statistics in
matrix.py; everything here reads the trace with aggregates or small tables (no whole steps table in memory).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from ampdoctor.lossscale import TORCH_DEFAULTS, Evidence
from ampdoctor.lossscale import replay as _replay
from ampdoctor.precision_label import describe_precision
from ampdoctor.rules.policy import NORM_TYPES, SOFTMAX_TYPES
from ampdoctor.trace import observation
from ampdoctor.trace.schema import ROOT

from . import matrix
from .series import n_steps, sql

if TYPE_CHECKING:
    from ampdoctor.rules.result import Diagnosis
    from ampdoctor.trace import Trace

KINDS = matrix.KINDS
STATS = {k: s.label for k, s in matrix.STATS.items()}


# -- summary ----------------------------------------------------------------------------------------------------
def _finite_sql(c: str) -> str:
    return f"CASE WHEN typeof({c}) IN ('integer','real') AND abs({c}) <= 1.7e308 THEN {c} END"


def run_summary(tr: Trace, run: Any = None) -> list[tuple[str, str]]:
    """(label, value) rows: steps, model, precision configuration with observed dtypes, scaler, skips, what was
    observed and what observing cost. From the steps the rules' ``run`` already holds when given (the report), else
    from aggregate queries (ampdoctor.trace.observation.summarize: a million steps cost a few scans, no row read)."""
    meta, cfg = tr.meta, tr.config
    info = meta.get("run", {}) or {}
    n = n_steps(tr)
    sites = tr.sites()
    rows = [
        ("trace", os.path.basename(tr.path)),
        ("steps", f"{n:,}" + ("" if "closed" in meta else " (run still writing)")),
        ("model", f"{info.get('model', '?')} ({info.get('params', 0):,} parameters) on {info.get('device', '?')}"),
        ("precision", describe_precision(cfg)),
    ]
    if len(sites):
        for kind in KINDS:
            d = sites[sites["kind"] == kind].groupby("dtype").size().to_dict()
            if d:
                rows.append(
                    (f"{matrix.KIND_LABELS[kind]}: dtypes", ", ".join(f"{k} ({v})" for k, v in sorted(d.items())))
                )
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
    if n:
        steps = run.view.steps if run is not None else observation.summarize(tr)
        fig = _step_figures(tr, steps)
        rows.append(("skipped steps", f"{fig['skipped']:,} ({100.0 * fig['skipped'] / n:.1f}%)"))
        rows.append(("non-finite steps", f"{fig['nonfinite']:,}"))
        if fig["scale"] is not None:
            first, last, lo, hi = fig["scale"]
            rows.append(("loss scale", f"{first:g} at start, {last:g} last, range {lo:g} .. {hi:g}"))
        if fig["loss"] is not None:
            rows.append(("loss", f"{fig['loss'][0]:.4g} -> {fig['loss'][1]:.4g}"))
        rows.append(("observed", observation.observation_line(meta, steps)))
        cost = observation.cost_line(steps)
        if cost is not None:
            rows.append(("overhead", cost))
    ev = sql(
        tr,
        "SELECT e.step, s.path, s.kind, e.phase FROM events e LEFT JOIN sites s ON s.id = e.site "
        "WHERE e.kind = 'nonfinite' ORDER BY e.id LIMIT 1",
    )
    if ev:
        step, path, kind, phase = ev[0]
        where = f"{path} ({kind})" if isinstance(path, str) else "the loss"
        rows.append(("first non-finite", f"step {step}: {where}, {phase} phase"))
    return rows


def _step_figures(tr: Trace, steps: Any) -> dict[str, Any]:
    """The summary's step figures from a steps DataFrame or an observation.Summary: skipped and non-finite (flagged)
    step counts, the loss scale's (first, last, min, max) and the finite loss's (first, last), None when none."""
    if isinstance(steps, observation.Summary):
        nonfinite = sql(tr, "SELECT count(*) FROM steps WHERE ifnull(nonfinite, 0) != 0")[0][0]
        sc, loss = steps.scale, steps.loss
        return {
            "skipped": len(steps.skipped),
            "nonfinite": int(nonfinite or 0),
            "scale": None if sc is None or sc["min"] is None else (sc["first"], sc["last"], sc["min"], sc["max"]),
            "loss": None if loss is None else (loss["first"], loss["last"]),
        }
    scale = steps["loss_scale"].to_numpy(float)
    scale = scale[np.isfinite(scale)]
    loss = steps["loss"].to_numpy(float)
    loss = loss[np.isfinite(loss)]
    return {
        "skipped": int(steps["skipped"].sum()),
        "nonfinite": int(steps["nonfinite"].sum()),
        "scale": (scale[0], scale[-1], scale.min(), scale.max()) if len(scale) else None,
        "loss": (loss[0], loss[-1]) if len(loss) else None,
    }


def compute_dtype(tr: Trace, run: Any = None) -> str | None:
    """The reduced dtype the run computed in, as the rules judge it (rules.engine.Run.compute_dtype); ``run``: the
    rules' Run of ``tr`` when there is one (diagnosis.diagnose_run)."""
    from ampdoctor.rules.engine import Run

    return (run if run is not None else Run(tr)).compute_dtype


def default_view(tr: Trace, found: list[Diagnosis] | None = None, run: Any = None) -> tuple[str, str]:
    """(kind, statistic) the Layers page opens with: the view of the first finding that names layers, else what
    matters in the run's precision (FP16: output-gradient underflow; BF16 and FP32: log2 abs max, whose range
    both formats hold); never an FP16 statistic on a run that has no FP16 in it."""
    from . import evidence

    for d in found or []:
        if d.layers and d.rule in evidence.LAYER_VIEWS:
            link = evidence.layer_link(d, str(d.layers[0]))
            p = dict(link.params)
            if p.get("kind") in KINDS and p.get("stat") in STATS:
                return p["kind"], p["stat"]
    have = set(tr.sites()["kind"].tolist())
    dtype = compute_dtype(tr, run)
    if dtype == "float16" and "grad_out" in have:
        return "grad_out", "fp16_under"
    kind = "grad_out" if "grad_out" in have else next((k for k in KINDS if k in have), "act")
    return kind, "absmax_log2"


def site_info(tr: Trace, site_id: int) -> dict[str, Any] | None:
    s = tr.sites()
    return _first(s[s["id"] == site_id])


def _first(rows: pd.DataFrame) -> dict[str, Any] | None:
    """The first of sites() ``rows`` as a dict (NaN as None), None when there is none."""
    if not len(rows):
        return None
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in rows.iloc[0].to_dict().items()}


def find_site(tr: Trace, path: str, kind: str | None) -> dict[str, Any] | None:
    """The site of a layer path (a module or a parameter) and kind; the closest one when that kind was not
    recorded for it (a parameter of the module, another kind), None when the layer is not in the trace."""
    s = tr.sites()
    s = s[(s["path"] == path) | (s["module"] == path)]  # (two comparisons over every site, then a few rows)
    order = [kind] if kind else []
    order += [k for k in ("act", "grad_out", "param_grad", "update", "weight") if k not in order]
    for k in order:
        for col in ("path", "module"):
            hit = s[(s[col] == path) & (s["kind"] == k)]
            if len(hit):
                return _first(hit)
    return None


# -- precision map -----------------------------------------------------------------------------------------------
def allocation(module_type: str, compute: str | None) -> str:
    """What the recommended allocation asks of a module type, in the words of the rule that judges it
    (precision-policy: normalisation keeps its parameters and statistics in FP32, softmax runs in FP32 when its
    outputs underflow; matrix multiplies and convolutions are what computes in half precision)."""
    if module_type in NORM_TYPES:
        return "parameters and statistics in FP32"
    if module_type in SOFTMAX_TYPES:
        return "FP32 if its outputs underflow"
    if module_type.startswith(("Linear", "Conv", "LazyLinear", "LazyConv", "Bilinear", "MultiheadAttention")):
        return compute or "float16/bfloat16"
    return "follows its input"


def precision_rows(tr: Trace, found: list[Diagnosis] | None, run: Any = None) -> list[dict[str, Any]]:
    """The run module by module (plus the loss and the weight update): type, what the allocation asks, the dtypes
    it computed and kept, and the verdict: exactly the findings that name the module (the rules' judgement, never
    one of this page's own). ``found`` None: the diagnosis is not done yet."""
    cfg = tr.config
    sites = tr.sites()
    act = sites[sites["kind"] == "act"]
    grad = sites[sites["kind"] == "grad_out"].drop_duplicates("path").set_index("path")["dtype"].to_dict()
    pdt = cfg.get("module_param_dtypes", {}) or {}
    compute = compute_dtype(tr, run)
    modules = set(act["path"].tolist())

    named: dict[str, list[Diagnosis]] = {}  # module path -> the findings naming it, in their order
    for d in found or []:  # the module itself, or one of its parameters (not a child module)
        paths = {str(p) for p in d.layers or ()}
        for p in paths | {p.rpartition(".")[0] for p in paths if p not in modules}:
            named.setdefault(p, []).append(d)

    def verdict(ds: Any) -> str:
        if found is None:
            return "diagnosing…"
        return "; ".join(f"{d.rule}: {d.title}" for d in ds) or "ok"

    rows = []
    # the columns as lists, not the frame's rows: a wide model has thousands of modules
    for path, module_type, dtype in zip(act["path"].tolist(), act["module_type"].tolist(), act["dtype"].tolist()):
        if path == ROOT:
            continue
        mtype = module_type if isinstance(module_type, str) else ""
        rows.append(
            {
                "module": path,
                "type": mtype,
                "allocation": allocation(mtype, compute),
                "forward": dtype or "?",
                "backward": grad.get(path, "–"),
                "parameters": pdt.get(path, "–"),
                "verdict": verdict(named.get(path, [])),
            }
        )
    loss = cfg.get("loss_dtype")
    if loss:
        rows.append(
            {
                "module": "(loss)",
                "type": "",
                "allocation": "FP32",
                "forward": loss,
                "backward": "–",
                "parameters": "–",
                "verdict": verdict([d for d in found or [] if "(loss)" in (d.evidence or {})]),
            }
        )
    units = (cfg.get("fsdp") or {}).get("units") or {} if isinstance(cfg.get("fsdp"), dict) else {}
    if isinstance(units, dict) and units:  # FSDP: each unit's MixedPrecisionPolicy as recorded
        if ROOT_UNIT in units:
            rows.insert(
                0,
                {
                    "module": ROOT_UNIT,
                    "type": "FSDP root unit",
                    "allocation": "–",
                    "forward": "–",
                    "backward": "–",
                    "parameters": "–",
                    "verdict": verdict(named.get(ROOT_UNIT, [])),
                },
            )
        for row in rows:
            u = units.get(row["module"])
            row["FSDP policy"] = _fsdp_policy(u) if isinstance(u, dict) else "–"
    params = cfg.get("param_dtypes", {}) or {}
    if params:
        rows.append(
            {
                "module": "(weight update)",
                "type": (cfg.get("optimizer") or {}).get("class", ""),
                "allocation": "FP32 master weights",
                "forward": "–",
                "backward": "–",
                "parameters": ", ".join(sorted(params)),
                "verdict": verdict([d for d in found or [] if d.rule in ("weight-update-lost", "weights-nonfinite")]),
            }
        )
    return rows


ROOT_UNIT = "(model)"  # the FSDP unit of the root module, as the trace's config names it


def _fsdp_policy(u: dict[str, Any]) -> str:
    """An FSDP unit's policy in a cell: "param float16 · reduce float16 (reduce_dtype unset) · 1,234 parameters"."""
    out = [f"param {u.get('param_dtype') or 'float32'}", f"reduce {u.get('reduce') or u.get('reduce_dtype') or '?'}"]
    if u.get("reduce") and not u.get("reduce_dtype"):
        out[-1] += " (reduce_dtype unset)"
    if isinstance(u.get("params"), int):
        out.append(f"{u['params']:,} parameters")
    return " · ".join(out)


# -- what-if -----------------------------------------------------------------------------------------------------
def scaler_settings(tr: Trace) -> dict[str, Any]:
    """The scaler's recorded settings, PyTorch GradScaler defaults for what was not recorded."""
    sc = tr.config.get("scaler") or {}
    out = dict(TORCH_DEFAULTS)
    for k in out:
        if isinstance(sc.get(k), (int, float)):
            out[k] = sc[k]
    if "init_scale" not in sc or not isinstance(sc.get("init_scale"), (int, float)):
        first = sql(tr, f"SELECT {_finite_sql('loss_scale')} FROM steps WHERE step = 0")
        if first and first[0][0] is not None:
            out["init_scale"] = float(first[0][0])
    return out


def recorded_scale(tr: Trace, s: Any) -> dict[str, Any]:
    """The run's own loss scale and skipped steps, as whatif() returns them with nothing simulated yet (drawn at
    once while the replay runs in the background), from the step series the charts draw (``s``: series.read's, the
    range's minimum and maximum per bucket on a long run): never every step read in a request."""
    x, y = s.envelope("loss_scale") if s.n else (np.array([], np.int64), np.array([]))
    skipped = np.zeros(len(x), bool)
    for a, b in s.skipped:  # a point inside a skipped interval (a bucket that holds a skipped step)
        skipped |= (x >= a) & (x <= b)
    return {
        "steps": np.asarray(x, dtype=np.int64),
        "recorded": np.asarray(y, dtype=float),
        "recorded_skipped": skipped,
        "simulated": np.full(len(x), np.nan),
        "simulated_skipped": np.zeros(len(x), bool),
        "settings": scaler_settings(tr),
        "engine": "replaying",
        "n": s.n,
    }


def recorded_steps(tr: Trace) -> np.ndarray:
    """[steps x 3]: every step, its recorded loss scale (NaN where none or not finite) and whether it was skipped
    (0 / 1), as the what-if compares them with a replay (every step: ~2 s at 10^6 steps, kept per content)."""
    rows = sql(tr, f"SELECT step, {_finite_sql('loss_scale')}, ifnull(skipped, 0) != 0 FROM steps ORDER BY step")
    return np.array(rows, dtype=float).reshape(-1, 3)


def whatif(
    tr: Trace,
    init_scale: Any = None,
    growth_factor: Any = None,
    backoff_factor: Any = None,
    growth_interval: Any = None,
    evidence: Evidence | None = None,
    recorded: np.ndarray | None = None,
) -> dict[str, Any]:
    """Recorded vs simulated loss scale and skipped steps for other scaler settings. ``evidence`` (lossscale.gather's)
    and ``recorded`` (recorded_steps') of this content, kept from before: only the scaler is stepped (else they are
    read here)."""
    args = {
        "init_scale": init_scale,
        "growth_factor": growth_factor,
        "backoff_factor": backoff_factor,
        "growth_interval": growth_interval,
    }
    n = n_steps(tr)
    rec = recorded_steps(tr) if recorded is None else recorded
    if not n:
        sim_scales, sim_skipped, engine = np.array([]), np.array([], bool), "nothing to replay yet"
        used = scaler_settings(tr)
    else:  # settings left at None: the replay keeps the run's own (and its scaler state)
        r = _replay(
            tr if evidence is None else evidence,
            **{k: (int(v) if k == "growth_interval" else v) for k, v in args.items() if v is not None},
        )
        sim_scales, sim_skipped = np.asarray(r.scales, float), np.asarray(r.skipped, bool)
        used = dict(r.settings)
        engine = "ampdoctor.lossscale"
    m = min(len(rec), len(sim_scales)) if n else 0  # a live trace may have grown between the reads
    return {
        "steps": rec[:m, 0].astype(np.int64),
        "recorded": rec[:m, 1],
        "recorded_skipped": rec[:m, 2] > 0,
        "simulated": sim_scales[:m],
        "simulated_skipped": sim_skipped[:m],
        "settings": used,
        "engine": engine,
    }


# -- compare -----------------------------------------------------------------------------------------------------
def compare_layers(tr_a: Trace, tr_b: Trace, stat: str = "absmax_log2", kind: str = "grad_out") -> pd.DataFrame:
    """Per layer (matched by path): the mean of ``stat`` over the recorded steps in both runs and the difference
    b - a (output-gradient abs max unscaled, so that runs with different loss scales compare)."""
    out = []
    for tr in (tr_a, tr_b):
        m = matrix.layer_matrix(tr, kind, stat, max_cols=400)
        v = m.values
        if stat == "absmax_log2" and kind == "grad_out" and len(m.steps):
            sc = np.array(
                [
                    r[0] if r[0] is not None else np.nan
                    for r in sql(
                        tr,
                        f"SELECT {_finite_sql('loss_scale')} FROM steps WHERE step IN "
                        f"({','.join(map(str, m.steps.tolist()))}) ORDER BY step",
                    )
                ],
                dtype=float,
            )
            if len(sc) == v.shape[1]:
                with np.errstate(divide="ignore", invalid="ignore"):
                    v = v - np.where(sc > 0, np.log2(np.where(sc > 0, sc, 1.0)), 0.0)[None, :]
        with np.errstate(all="ignore"):
            means = [np.nanmean(r) if np.isfinite(r).any() else np.nan for r in v]
        out.append(pd.Series(means, index=m.labels, dtype=float))
    out = [s[~s.index.duplicated()] for s in out]
    df = pd.DataFrame({"a": out[0], "b": out[1]}).dropna(how="all")  # a layer with no value in either run goes
    order = dict.fromkeys([*out[0].index, *out[1].index])  # this run's layer order, then the other's
    df = df.loc[[p for p in order if p in df.index]]
    df["diff"] = df["b"] - df["a"]
    return df


# -- formats: the FP8/FP16/BF16 what-if and the precision-loss probe --------------------------------------------
FORMAT_NAMES = {"fp16": "FP16", "bf16": "BF16", "e4m3": "E4M3", "e5m2": "E5M2"}


def format_table(tr: Any, fp8: bool = True) -> pd.DataFrame:
    """Per site (activations, output gradients), what each format would lose (ampdoctor.whatif.formats_table).
    ``tr``: a Trace, or the rules' Run of one (its View read once for both kinds, and shared with the diagnosis).
    ``fp8=False``: the table without its FP8 columns, which wait for the pass over the peaks (``fp8_pending``)."""
    from ampdoctor import whatif
    from ampdoctor.trace.view import View

    return whatif.formats_table(View.of(tr), fp8=fp8)


def fp8_pending(table: pd.DataFrame) -> bool:
    """Whether a formats table still lacks its FP8 columns (format_table(..., fp8=False): handed over first)."""
    return len(table) > 0 and "e4m3_lost" not in table.columns


def default_format(tr: Trace, run: Any = None) -> str:
    """The format the Formats page ranks by: the one the run computes in (FP16 or BF16), else FP16 (what an FP32
    run would move to first)."""
    return "bf16" if compute_dtype(tr, run) == "bfloat16" else "fp16"


def formats_rows(table: Any, by: str = "fp16", limit: int | None = None) -> list[dict[str, Any]]:
    """Per site: the share of non-zero values each format would lose (saturated or flushed; FP8 with Transformer
    Engine's default delayed scaling) and the headroom, worst in format ``by`` first (every site: the page pages;
    the first ``limit`` when given). ``table``: format_table()'s, or a trace."""
    if not isinstance(table, pd.DataFrame):
        table = format_table(table)
    if not len(table):
        return []
    table = table.sort_values(f"{by}_lost", ascending=False, na_position="last", kind="stable")
    if limit is not None:
        table = table.head(limit)

    def pct(v: Any) -> Any:
        if v is None:
            return "…"  # (an FP8 column still being computed)
        return "–" if v != v else f"{100 * v:.3g}%"

    def binades(v: Any) -> Any:
        return "–" if v != v else f"{v:.1f}"

    return [
        {
            "layer": r.path,
            "kind": matrix.KIND_LABELS.get(r.kind, r.kind),
            "dtype": r.dtype,
            "FP16 headroom (binades)": binades(r.fp16_headroom),
            "BF16 headroom (binades)": binades(r.bf16_headroom),
            "span (binades)": binades(r.span),
            "FP16 lost": pct(r.fp16_lost),
            "BF16 lost": pct(r.bf16_lost),
            "E4M3 lost": pct(getattr(r, "e4m3_lost", None)),
            "E5M2 lost": pct(getattr(r, "e5m2_lost", None)),
        }
        for r in table.itertuples()
    ]


def formats_shares(
    table: Any, by: str = "fp16", max_rows: int = 40, only: Any = ()
) -> tuple[list[str], dict[str, Any]]:
    """(labels, {format: lost shares}) of the sites worst in format ``by`` (and the ``only`` layers when given),
    for the formats bar chart. ``table``: format_table()'s, or a trace (it is computed)."""
    from ampdoctor import whatif

    if not isinstance(table, pd.DataFrame):
        table = format_table(table)
    if not len(table):
        return [], {}
    if only:
        table = table[table["path"].isin(only)]
    table = table.sort_values(f"{by}_lost", ascending=False, na_position="last", kind="stable").head(max_rows)
    labels = [f"{p} ({matrix.KIND_LABELS.get(k, k)})" for p, k in zip(table["path"], table["kind"])]
    return labels, {n.upper(): table[f"{n}_lost"].to_numpy(float) for n in whatif.FORMATS if f"{n}_lost" in table}


def probe_series(
    tr: Trace, max_layers: int = 12, include: Any = (), run: Any = None
) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, Any], list[dict[str, Any]]]:
    """Probe error over steps: ({layer: (steps, rel_err)}, {layer: sqrt(k)*u bound}, per-layer verdicts), the
    named layers and the largest ratios first (and the ``include`` layers, whatever their rank). ``run``: the rules'
    Run of ``tr`` when there is one (its probe table read once)."""
    from ampdoctor.rules import precision
    from ampdoctor.rules.engine import Run as _DiagRun

    run = run if run is not None else _DiagRun(tr)
    verdicts = precision.layer_verdicts(run)
    pr = precision.probes(run)
    series, bounds = {}, {}
    shown = verdicts[:max_layers] + [v for v in verdicts[max_layers:] if v["path"] in include]
    for v in shown:
        g = pr[pr["path"] == v["path"]]
        series[v["path"]] = (g["step"].to_numpy(), g["rel_err"].to_numpy(float))
        bounds[v["path"]] = v["bound"]
    return series, bounds, verdicts
