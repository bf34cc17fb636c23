"""Where a finding's evidence is seen: for every rule, the views that prove it (the page, the kind of site and the
statistic, the steps zoomed and outlined, the rank whose trace holds it), as links. No plotly, no dash: the
dashboard renders these as links, the report as anchors to its figures, the tests follow them.

A view is named by a page and URL parameters (pages/common.py reads the same names back):
``x0``/``x1`` the step range shown, ``hl`` the finding's steps outlined ("a-b"), ``kind``/``stat`` a site kind and
statistic, ``path`` (+``kind``) a layer, ``sel`` the layers outlined (repeatable), ``fmt`` a number format, ``logy``,
``metric``, ``other`` a run to compare with, the What-if settings ``init``/``interval``/``growth``/``backoff``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ampdoctor.rules.result import Diagnosis


@dataclass(frozen=True)
class Link:
    """One view of a finding's evidence: ``label`` in words, ``page`` and its URL ``params`` (pairs, in order; a
    key may repeat), ``rank``: open that rank's trace instead of the finding's own run."""

    label: str
    page: str
    params: tuple[tuple[str, Any], ...] = ()
    rank: int | None = None
    layer: str | None = None  # the layer this link opens (for the culprit list)

    def query(self) -> list[tuple[str, str]]:
        return [(k, str(v)) for k, v in self.params if v is not None]


def span(d: Diagnosis) -> tuple[int, int] | None:
    """The finding's [first, last] step, or None."""
    steps = list(getattr(d, "steps", None) or [])
    if len(steps) != 2:
        return None
    a, b = int(steps[0]), int(steps[1])
    return (a, b) if a <= b else (b, a)


def zoom(d: Diagnosis, pad: float = 0.25, least: int = 10) -> tuple[tuple[str, Any], ...]:
    """URL parameters that zoom to the finding's steps (padded on both sides) and outline them."""
    s = span(d)
    if s is None:
        return ()
    a, b = s
    p = max(least, math.ceil((b - a + 1) * pad))
    return (("x0", max(0, a - p)), ("x1", b + p), ("hl", f"{a}-{b}"))


def _fmt_stat(dtype: Any, over: bool) -> str:
    """The statistic that shows an overflow (or underflow) in the format a site computed in."""
    bf = dtype == "bfloat16"
    return ("bf16_over" if bf else "fp16_over") if over else ("bf16_under" if bf else "fp16_under")


# rule id -> (kind, statistic) of the layer view its culprits open (None: the layer's own page is not the evidence)
LAYER_VIEWS = {
    "forward-overflow": ("act", "fp16_over"),
    "loss-scale-collapse": ("act", "nonfinite"),
    "grad-underflow": ("grad_out", "fp16_under"),
    "weights-nonfinite": ("weight", "nonfinite"),
    "weight-update-lost": ("update", "zeros"),
    "grad-range-anomaly": ("param_grad", "rms_log2"),
    "precision-policy": ("act", "absmax_log2"),
    "val-oscillation": ("act", "absmax_log2"),
    "precision-loss": ("act", "absmax_log2"),
    "fp16-readiness": ("act", "absmax_log2"),
    "fp8-readiness": ("act", "absmax_log2"),
    "rank-nonfinite": ("act", "nonfinite"),
    "outlier-batch": ("act", "absmax_log2"),
    "loss-spike": ("grad_out", "absmax_log2"),
    "healed": ("act", "nonfinite"),
    "division-by-zero": ("act", "nonfinite"),
    "loss-nonfinite": ("act", "absmax_log2"),
}
_KIND_SUFFIX = re.compile(r"^(.*) \((act|grad_out|param_grad|weight|update)\)$")  # "2.fc (grad_out)"


def layer_link(d: Diagnosis, layer: str) -> Link:
    """The view of one layer a finding names: its activations, output gradients or parameter gradients with the
    statistic the rule judged, zoomed to the finding's steps, on the rank the finding is about."""
    ev = getattr(d, "evidence", None) or {}
    kind, stat = LAYER_VIEWS.get(d.rule, ("act", "absmax_log2"))
    named = _KIND_SUFFIX.match(layer)
    if named:  # a layer named with its kind (loss-spike's jumped sites)
        layer, kind = named.group(1), named.group(2)
    if d.rule == "forward-overflow":
        stat = _fmt_stat(ev.get("dtype"), over=True)
    elif d.rule == "outlier-batch" and isinstance(ev.get("operation"), dict):
        stat = "nonfinite"  # the batch made a NaN/Inf (the operation that did is in the evidence): the module's count
    elif d.rule == "loss-scale-collapse":
        grad = ((ev.get("origins") or {}).get("gradient") or {}) if isinstance(ev.get("origins"), dict) else {}
        if layer in grad:
            kind, stat = "grad_out", "nonfinite"
        else:
            stat = "fp16_over"
    elif d.rule == "fp16-readiness":
        if layer not in (ev.get("overflow_modules") or {}):
            kind, stat = "grad_out", "fp16_under"
    elif d.rule == "precision-policy":
        item = (ev.get(layer) or {}) if isinstance(ev.get(layer), dict) else {}
        if "underflow_share" in item:
            stat = "fp16_under"
    params = (("path", layer), ("kind", kind), ("stat", stat), *zoom(d))
    return Link(f"{layer}: {_STAT_WORDS.get(stat, stat)} of its {_KIND_WORDS[kind]}", "/layer", params, _rank(d), layer)


_KIND_WORDS = {
    "act": "activations",
    "grad_out": "output gradients",
    "param_grad": "parameter gradients",
    "weight": "weights",
    "update": "updates",
}
_STAT_WORDS = {
    "fp16_over": "FP16 overflow",
    "bf16_over": "BF16 overflow",
    "fp16_under": "FP16 underflow",
    "bf16_under": "BF16 underflow",
    "nonfinite": "NaN/Inf",
    "zeros": "zero share",
    "absmax_log2": "abs max",
    "rms_log2": "RMS",
}


def _rank(d: Diagnosis) -> int | None:
    ranks = list(getattr(d, "ranks", None) or [])
    return int(ranks[0]) if ranks else None


def _ranks_of(d: Diagnosis) -> tuple[tuple[str, Any], ...]:
    return tuple(("rank", int(r)) for r in getattr(d, "ranks", None) or [])


def _sel(layers: Any) -> tuple[tuple[str, Any], ...]:
    return tuple(("sel", p) for p in list(layers)[:20])


def whatif_params(settings: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """What-if URL parameters of scaler settings (the keys GradScaler takes)."""
    names = {
        "init_scale": "init",
        "growth_interval": "interval",
        "growth_factor": "growth",
        "backoff_factor": "backoff",
    }
    out = []
    for key, name in names.items():
        v = settings.get(key) if isinstance(settings, dict) else None
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append((name, f"{v:g}"))
    return tuple(out)


def links(d: Diagnosis) -> list[Link]:
    """The views that prove finding ``d``, the most telling first."""
    ev: dict[str, Any] = getattr(d, "evidence", None) or {}
    rule = getattr(d, "rule", "")
    layers = [str(p) for p in (getattr(d, "layers", None) or [])]
    rank = _rank(d)
    z = zoom(d)
    out: list[Link] = []
    if rule == "divergence":
        out.append(Link("Loss around the divergence (log scale)", "/", (*z, ("logy", 1)), rank))
    elif rule == "init-scale-too-high":
        out.append(Link("Loss scale and the skipped steps", "/", z, rank))
        sug = ev.get("suggested_settings") or {"init_scale": ev.get("suggested_init_scale")}
        out.append(Link("Try the suggested scaler in What-if", "/whatif", whatif_params(sug), rank))
    elif rule == "forward-overflow":
        stat = _fmt_stat(ev.get("dtype"), over=True)
        if layers:
            out.append(layer_link(d, layers[0]))
        out.append(
            Link(
                "Every layer's activations: overflow",
                "/layers",
                (("kind", "act"), ("stat", stat), *_sel(layers), *z),
                rank,
            )
        )
        out.append(Link("What-if: why the loss scale cannot help", "/whatif", (), rank))
    elif rule == "loss-scale-collapse":
        out.append(Link("Loss scale and the skipped steps", "/", z, rank))
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "grad-underflow":
        out.append(
            Link(
                "Output gradients: FP16 underflow share",
                "/layers",
                (("kind", "grad_out"), ("stat", "fp16_under"), *_sel(layers), *z),
                rank,
            )
        )
        if layers:
            out.append(layer_link(d, layers[0]))
        sug = {"init_scale": ev.get("suggested_scale"), "growth_interval": ev.get("suggested_growth_interval")}
        if any(isinstance(v, (int, float)) for v in sug.values()):
            out.append(Link("Try the suggested scale in What-if", "/whatif", whatif_params(sug), rank))
    elif rule == "weights-nonfinite":
        out.append(Link("Loss from the step the weights went NaN/Inf", "/", z, rank))
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "weight-update-lost":
        out.append(
            Link(
                "Weight updates: share of zeros",
                "/layers",
                (("kind", "update"), ("stat", "zeros"), *_sel(layers)),
                rank,
            )
        )
    elif rule == "grad-range-anomaly":
        out.append(
            Link(
                "Parameter gradients: log2 RMS per layer",
                "/layers",
                (("kind", "param_grad"), ("stat", "rms_log2"), *_sel(layers)),
                rank,
            )
        )
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "precision-policy":
        out.append(Link("Precision map: the modules in question", "/precision", (*_sel(layers), ("only", 1)), rank))
    elif rule == "amp-inactive":
        out.append(Link("Precision map: every module's dtype", "/precision", (), rank))
    elif rule == "input-pipeline-bound":
        out.append(Link("Step time: compute and data wait", "/", (("chart", "time"),), rank))
    elif rule == "late-degradation":
        out.append(Link("Loss from the break (log scale)", "/", (*z, ("logy", 1)), rank))
        interval = ev.get("suggested_growth_interval")
        if isinstance(interval, (int, float)):
            out.append(
                Link(
                    "Try the suggested growth_interval in What-if",
                    "/whatif",
                    whatif_params({"growth_interval": interval, "init_scale": ev.get("suggested_init_scale")}),
                    rank,
                )
            )
    elif rule == "val-oscillation":
        out.append(Link(f"Metric {ev.get('metric', '')}", "/", (("metric", ev.get("metric")), *z), rank))
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "slow-convergence":
        out.append(Link("Loss against the reference", "/compare", (("other", "reference"),), rank))
    elif rule == "precision-loss":
        out.append(Link("Probe error against FP32", "/formats", _sel(layers), rank))
    elif rule == "fp16-readiness":
        out.append(Link("Formats: what FP16 would lose", "/formats", (("fmt", "fp16"), *_sel(layers)), rank))
        over = list(ev.get("overflow_modules") or {})
        if over:
            out.append(
                Link(
                    "Activations: log2 abs max",
                    "/layers",
                    (("kind", "act"), ("stat", "absmax_log2"), *_sel(over)),
                    rank,
                )
            )
    elif rule == "fp8-readiness":
        out.append(Link("Formats: what FP8 E4M3 would lose", "/formats", (("fmt", "e4m3"), *_sel(layers)), rank))
    elif rule == "rank-nonfinite":
        out.append(Link(f"Loss of rank {rank}", "/", z, rank))
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "rank-scale-divergence":
        out.append(Link("Loss scale per rank", "/ranks", (("stat", "loss_scale"), *_ranks_of(d), *z), None))
    elif rule == "rank-straggler":
        what = "data_time" if "data" in str(getattr(d, "title", "")).lower() else "step_time"
        out.append(
            Link(
                "Step time per rank" if what == "step_time" else "Data wait per rank", "/ranks", (("stat", what),), None
            )
        )
    elif rule == "outlier-batch":
        op = o if isinstance(o := ev.get("operation"), dict) else {}
        module = str(op.get("module") or (layers[0] if layers else ""))
        if module:
            out.append(layer_link(d, module))
        out.append(Link("Loss and loss scale at the batch", "/", z, rank))
    elif rule == "loss-spike":
        out.append(Link("Loss around the spike (log scale)", "/", (*z, ("logy", 1)), rank))
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "healed":
        module = str(ev.get("module") or (layers[0] if layers else ""))
        span_ = span(d)
        if module and span_ is not None:  # from the steps whose replays confirmed the fix to the end of the run
            first = min([span_[0], *(int(s) for s in ev.get("confirmed_on") or [])])
            params: tuple[tuple[str, Any], ...] = (
                ("path", module),
                ("kind", "act"),
                ("stat", "nonfinite"),
                ("x0", max(0, first - 5)),
            )
            params += (("x1", span_[1] + 5), ("hl", f"{span_[0]}-{span_[1]}"))
            label = f"{module}: NaN/Inf of its activations before and after it was kept in FP32"
            out.append(Link(label, "/layer", params, rank, module))
    elif rule == "division-by-zero":
        module = str(ev.get("module") or (layers[0] if layers else ""))
        if module:
            out.append(layer_link(d, module))
        if ev.get("input_module"):
            out.append(
                Link(
                    f"{ev['input_module']}: zero share of its activations (the rows it hands over)",
                    "/layer",
                    (("path", ev["input_module"]), ("kind", "act"), ("stat", "zeros"), *z),
                    rank,
                    str(ev["input_module"]),
                )
            )
    elif rule == "loss-nonfinite":
        out.append(Link("Loss: the non-finite steps", "/", z, rank))
        if layers:
            out.append(layer_link(d, layers[0]))
    elif rule == "clip-before-unscale":
        out.append(Link("Gradient norm: the clipped norm follows 1/scale", "/", (*z, ("chart", "norm")), rank))
    elif rule in ("fsdp-reduce-dtype", "fsdp-fp16-scaler"):
        out.append(Link("Precision map: FSDP's policy per unit", "/precision", (*_sel(layers), ("only", 1)), rank))
    elif z:
        out.append(Link("Steps of the finding", "/", z, rank))
    return out


def culprit_links(d: Diagnosis) -> list[Link]:
    """One link per layer the finding names (the view of that layer its rule judged), in the finding's order."""
    if d.rule in ("precision-policy", "fsdp-reduce-dtype", "fsdp-fp16-scaler"):
        return [Link(p, "/precision", (("sel", p), ("only", 1)), _rank(d), p) for p in d.layers]
    if d.rule in ("precision-loss", "fp8-readiness"):
        return [Link(p, "/formats", (("sel", p),), _rank(d), p) for p in d.layers]
    return [layer_link(d, str(p)) for p in (d.layers or [])]
