"""Pure plotly figure builders, shared by the dashboard and the HTML report: arrays in, figure out.

No dash import here. Names (layer paths, run labels) are user data: plotly.js reads its text as a small HTML
dialect (``<a href>``, ``<b>``, ``<br>``, entities), so every name and title goes in through ``text()``.

The step charts follow what TensorBoard and W&B users expect: a step axis shared by every chart of a page, the raw
line faint under its smoothed line, a log-y switch, skipped and non-finite steps as shaded bands (never drawn at an
invented value), the steps a finding concerns outlined. Long runs arrive downsampled with their extremes kept
(series.py); heat maps are binned over steps with the worst value of each bin kept.
"""

from __future__ import annotations

import html
import math
from typing import Any

import numpy as np
import plotly.graph_objects as go

from ampdoctor import formats

from .series import MAX_POINTS, StepSeries, downsample, smooth

MAX_CELLS = 120_000  # per heat map (rows x binned steps)
COLORS = {
    "loss": "#1f77b4",
    "skip": "#ff7f0e",
    "nonfinite": "#d62728",
    "zero": "#7f7f7f",
    "scale": "#2ca02c",
    "sim": "#9467bd",
    "compute": "#1f77b4",
    "data": "#ff7f0e",
    "norm": "#8c564b",
    "metric": "#17becf",
    "a": "#1f77b4",
    "b": "#d62728",
    "highlight": "#e377c2",
}
BAND_COLORS = {
    "skipped": "rgba(255,127,14,0.18)",
    "nonfinite": "rgba(214,39,40,0.22)",
    "zero": "rgba(127,127,127,0.25)",
}
GRID = "rgba(128,128,128,0.25)"
# plotly's own cloud upload ("Share chart" / "Edit in Chart Studio") is off everywhere: these are private runs
GRAPH_CONFIG: dict[str, Any] = {
    "displaylogo": False,
    "showSendToCloud": False,
    "showEditInChartStudio": False,
    "showLink": False,
    "plotlyServerURL": "",
    "modeBarButtonsToRemove": ["sendChartToCloud", "sendDataToCloud", "editInChartStudio", "lasso2d", "select2d"],
    "toImageButtonOptions": {"format": "png", "scale": 2},
}
# plotly_white as these figures use it: its layout less the polar, ternary, 3D scene and map settings of subplot kinds
# no figure here has, and the defaults of the trace types they draw (plotlyjs.TRACE_TYPES) only. Every figure
# carries its template in its JSON (copied and validated in Python, then read by plotly.js, once per chart): 7.2 KB
# and ~17 ms per figure for plotly_white's 24 trace types, ~2 KB and a few ms for this one, which draws the same.
TEMPLATE = "ampdoctor"
UNUSED_SUBPLOTS = ("polar", "ternary", "scene", "geo")


def _register_template() -> None:
    import plotly.io as pio

    from .plotlyjs import TRACE_TYPES

    if TEMPLATE in pio.templates:
        return
    white = pio.templates["plotly_white"]
    layout = {k: v for k, v in white.layout.to_plotly_json().items() if k not in UNUSED_SUBPLOTS}
    data = {k: getattr(white.data, k) for k in TRACE_TYPES}
    pio.templates[TEMPLATE] = go.layout.Template(layout=layout, data=data)


_register_template()
_LAYOUT: dict[str, Any] = dict(
    template=TEMPLATE,
    paper_bgcolor="rgba(0,0,0,0)",
    plot_bgcolor="rgba(0,0,0,0)",
    margin=dict(l=70, r=20, t=40, b=50),
    height=300,
    title=dict(x=0.01, xanchor="left", font=dict(size=15)),
    # below the plot: the mode bar sits at the top right, a legend there would hide it
    legend=dict(orientation="h", yanchor="top", y=-0.18, xanchor="left", x=0),
    hovermode="x unified",
)


def text(name: Any) -> str:
    """``name`` as plotly shows it literally: ``<``, ``>`` and ``&`` as entities (plotly.js turns them back into
    characters), so a layer called ``<a href=...>`` is a label, not a link."""
    return html.escape(str(name), quote=False)


def _layout(title: str, uirevision: Any = None, **kw: Any) -> dict[str, Any]:
    out = dict(_LAYOUT, **kw)
    out["title"] = dict(_LAYOUT["title"], text=text(title))
    if uirevision is not None:
        out["uirevision"] = str(uirevision)  # the user's zoom and toggles survive a figure sent again
    out["xaxis"] = dict(gridcolor=GRID, zeroline=False, **(kw.get("xaxis") or {}))
    out["yaxis"] = dict(gridcolor=GRID, zeroline=False, **(kw.get("yaxis") or {}))
    return out


def _finite(y: Any) -> Any:
    y = np.asarray(y, dtype=float)
    return np.where(np.isfinite(y), y, np.nan)


def empty(title: str, note: str, uirevision: Any = None) -> go.Figure:
    """A figure that says why it has nothing to draw (never empty axes)."""
    fig = go.Figure(layout=_layout(title, uirevision, height=220))
    fig.add_annotation(text=text(note), showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def note(fig: go.Figure, words: str) -> go.Figure:
    """A line of small grey text at the top right of a figure (a preview, a cut, what is not drawn)."""
    fig.add_annotation(
        text=text(words),
        showarrow=False,
        xref="paper",
        yref="paper",
        x=1,
        y=1.0,
        xanchor="right",
        yanchor="bottom",
        font=dict(size=11, color="#888"),
        name="note",
    )
    return fig


def _log2_ticks(lo: float, hi: float) -> dict[str, Any]:
    lo, hi = math.floor(lo), math.ceil(hi)
    step = max(1, (hi - lo) // 8)
    vals = list(range(lo, hi + 1, step))
    return dict(tickvals=vals, ticktext=[f"2^{v}" for v in vals])


# -- the pieces every step chart has ---------------------------------------------------------------------------
def band_trace(name: str, spans: Any, color: str, count: int | None = None) -> go.Scatter | None:
    """Steps [(first, last), ...] as shaded vertical bands over the whole height: one filled trace on a hidden
    0..1 axis (thousands of bands stay one trace; a legend click hides them). ``meta`` marks it as a band."""
    if not spans:
        return None
    xs: list[float | None] = []
    ys: list[float | None] = []
    for a, b in spans:
        xs += [a - 0.5, a - 0.5, b + 0.5, b + 0.5, a - 0.5, None]
        ys += [0, 1, 1, 0, 0, None]
    label = f"{name} ({count if count is not None else sum(b - a + 1 for a, b in spans)})"
    return go.Scatter(
        x=xs,
        y=ys,
        yaxis="y2",
        mode="lines",
        fill="toself",
        fillcolor=color,
        line=dict(width=0),
        hoverinfo="skip",
        name=text(label),
        meta={"band": name, "spans": [[int(a), int(b)] for a, b in spans]},
    )


def _finish(fig: go.Figure, bands: Any, highlight: Any = None, x_range: Any = None) -> go.Figure:
    """Bands on the hidden overlay axis, the finding's steps outlined, the shared zoom applied."""
    for name, spans, color, count in bands:
        tr = band_trace(name, spans, color, count)
        if tr is not None:
            fig.add_trace(tr)
    if highlight is not None:
        a, b = highlight
        fig.add_trace(
            go.Scatter(
                x=[a - 0.5, a - 0.5, b + 0.5, b + 0.5, a - 0.5],
                y=[0, 1, 1, 0, 0],
                yaxis="y2",
                mode="lines",
                line=dict(color=COLORS["highlight"], width=2, dash="dot"),
                hoverinfo="skip",
                name=text(f"finding: steps {a}–{b}" if a != b else f"finding: step {a}"),
                meta={"band": "finding", "spans": [[int(a), int(b)]]},
            )
        )
    fig.update_layout(yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True), showlegend=True)
    if x_range is not None:
        fig.update_xaxes(range=[x_range[0] - 0.5, x_range[1] + 0.5], autorange=False)
    _integer_steps(fig, x_range)
    return fig


def _integer_steps(fig: go.Figure, x_range: Any = None) -> None:
    """Steps are whole numbers: a short range gets a tick per step, never "0.5"."""
    xs = [
        v
        for t in fig.data
        if t.x is not None
        for v in np.asarray(t.x, dtype=object)
        if isinstance(v, (int, float, np.number))
    ]
    lo, hi = x_range if x_range is not None else ((min(xs), max(xs)) if xs else (0, 0))
    if hi - lo <= 12:
        fig.update_xaxes(dtick=1, tick0=0)
    fig.update_xaxes(tickformat=",d")


def _line(
    fig: Any,
    name: Any,
    x: Any,
    y: Any,
    color: str,
    smoothing: Any = 0.0,
    smooth_from: Any = None,
    shape: str = "linear",
    log_hover: bool = False,
    dash: Any = None,
) -> Any:
    """A raw line, faint under its smoothed line when ``smoothing`` > 0 (TensorBoard's convention). The smoothed
    line is computed over ``smooth_from`` = (x, y, steps per point) when given (a downsampled range: the bucket
    means), else over the raw points."""
    x, y = np.asarray(x), np.asarray(y, dtype=float)
    hover = "%{fullData.name}: 2^%{y:.2f}<extra></extra>" if log_hover else "%{fullData.name}: %{y:.4g}<extra></extra>"
    smoothed = smoothing > 0 and len(y) > 2
    fig.add_scatter(
        x=x,
        y=y,
        mode="lines" if len(x) > 60 else "lines+markers",
        name=text(name) if not smoothed else text(f"{name} (raw)"),
        line=dict(color=color, shape=shape, dash=dash, width=1 if smoothed else 1.6),
        opacity=0.3 if smoothed else 1.0,
        connectgaps=False,
        hovertemplate=hover,
        meta={"series": name, "raw": True},
    )
    if smoothed:
        sx, sy, width = smooth_from if smooth_from is not None else (x, y, None)
        fig.add_scatter(
            x=sx,
            y=smooth(sy, smoothing, width),
            mode="lines",
            name=text(name),
            line=dict(color=color, shape=shape, dash=dash, width=2),
            hovertemplate=hover,
            meta={"series": name, "smoothed": smoothing},
        )


def _smooth_source(s: StepSeries, col: str, positive: bool = False) -> Any:
    """What a smoothed line averages: the exact values, or each bucket's mean placed at its middle."""
    if s.exact:
        return None
    y = s.mean[col]
    if positive:
        y = np.where(y > 0, y, np.nan)
    return s.x + (s.width - 1) / 2, y, s.width


def _step_bands(
    s: StepSeries, skipped: Any = True, nonfinite: Any = True, zero: bool = False
) -> list[tuple[str, list[tuple[int, int]], str, int | None]]:
    out: list[tuple[str, list[tuple[int, int]], str, int | None]] = []
    if skipped:
        out.append(("skipped steps", s.skipped, BAND_COLORS["skipped"], s.n_skipped))
    if nonfinite:
        out.append(("non-finite steps", s.nonfinite, BAND_COLORS["nonfinite"], s.n_nonfinite))
    if zero:
        out.append(("loss scale 0", s.scale_zero, BAND_COLORS["zero"], None))
    return out


def _values(s: StepSeries, col: str) -> Any:
    """(x, y) to draw of one column: the envelope of a downsampled range, the values of an exact one."""
    return s.envelope(col)


def _preview_note(fig: Any, s: StepSeries) -> Any:
    if s.preview:
        note(fig, f"preview: {len(s.x):,} of {s.x1 - s.x0 + 1:,} steps while every step is summarised")
    elif not s.exact:
        note(fig, f"{s.x1 - s.x0 + 1:,} steps: min and max of every {int(np.median(s.width)):,} shown; zoom in")
    return fig


def warm() -> None:
    """Build the overview's step charts once from a few made-up steps and drop them. plotly imports its graph-object
    classes and copies its template on first use: ~0.4-0.5 s that a server pays here, while the user's browser loads
    the page, instead of in the first page's answer (measured on a 10^6-step trace: the first answer 0.48-0.67 s,
    a later one 0.12 s)."""
    from .series import from_arrays

    x = np.arange(3)
    s = from_arrays(
        x,
        loss=[1.0, 0.5, 0.25],
        loss_scale=[65536.0] * 3,
        grad_norm=[1.0] * 3,
        step_time=[0.1] * 3,
        data_time=[0.01] * 3,
        skipped=[False, True, False],
    )
    for fig in (loss_figure(s), loss_scale_figure(s), grad_norm_figure(s), step_time_figure(s)):
        fig.to_plotly_json()


# -- overview --------------------------------------------------------------------------------------------------
def _as_series(s: Any, **columns: Any) -> StepSeries:
    """A StepSeries, or one made from a notebook's arrays (steps first, then the columns by name)."""
    from .series import from_arrays

    return s if isinstance(s, StepSeries) else from_arrays(s, **columns)


def loss_figure(
    s: Any, smoothing: Any = 0.6, log_y: Any = False, highlight: Any = None, x_range: Any = None, uirevision: Any = None
) -> Any:
    """Loss over steps: raw (faint) and smoothed, skipped and non-finite steps as bands, log-y on request.
    ``s``: a series.StepSeries (series.from_arrays makes one of a notebook's arrays)."""
    title = "Loss"
    if not s.n:
        return empty(title, "no steps recorded yet", uirevision)
    fig = go.Figure(layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title="loss")))
    x, y = _values(s, "loss")
    if log_y:
        y = np.where(y > 0, y, np.nan)
    if np.isfinite(y).any():
        _line(fig, "loss", x, y, COLORS["loss"], smoothing, _smooth_source(s, "loss", log_y))
    else:
        note(fig, "no finite loss in this range")
    fig.update_yaxes(type="log" if log_y else "linear")
    _finish(fig, _step_bands(s), highlight, x_range)
    return _preview_note(fig, s)


def loss_scale_figure(
    s: Any, scale: Any = None, skipped: Any = None, highlight: Any = None, x_range: Any = None, uirevision: Any = None
) -> Any:
    """The loss scale in force on a log2 axis; skipped steps (each halves it) and a scale of 0 as bands. ``s``: a
    series.StepSeries, or the steps with ``scale`` and ``skipped`` as arrays (a notebook's DataFrame columns)."""
    title = "Loss scale"
    if not isinstance(s, StepSeries):
        s = _as_series(s, loss_scale=scale, skipped=skipped, nonfinite=np.zeros(len(s), bool))
    sc_hi = s.hi.get("loss_scale")
    if not s.n or sc_hi is None or (not np.any(np.isfinite(sc_hi) & (sc_hi > 0)) and not s.scale_zero):
        return empty(title, "no loss scaler in this run", uirevision)
    fig = go.Figure(layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title="loss scale")))
    x, y = _values(s, "loss_scale")
    if s.scale_after is not None and len(x):  # the scale the last step's update left, at the right edge
        x, y = np.append(x.astype(float), s.x1 + 0.5), np.append(y, s.scale_after)
    with np.errstate(divide="ignore", invalid="ignore"):
        ly = np.where(y > 0, np.log2(np.where(y > 0, y, 1.0)), np.nan)
    fig.add_scatter(
        x=x,
        y=ly,
        mode="lines",
        name="loss scale",
        line=dict(color=COLORS["scale"], shape="hv"),
        hovertemplate="loss scale 2^%{y}<extra></extra>",
        meta={"series": "loss scale", "log2": True},
    )
    if np.isfinite(ly).any():
        fig.update_yaxes(**_log2_ticks(np.nanmin(ly), np.nanmax(ly)))
    _finish(fig, _step_bands(s, zero=True), highlight, x_range)
    return _preview_note(fig, s)


def grad_norm_figure(
    s: StepSeries, smoothing: Any = 0.6, highlight: Any = None, x_range: Any = None, uirevision: Any = None
) -> Any:
    """The whole model's gradient norm (unscaled) on a log axis."""
    title = "Gradient norm"
    y = s.hi.get("grad_norm")
    if not s.n or y is None or not np.isfinite(y).any():
        return empty(title, "no gradient norm recorded", uirevision)
    fig = go.Figure(layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title="norm", type="log")))
    x, yy = _values(s, "grad_norm")
    _line(
        fig,
        "gradient norm",
        x,
        np.where(yy > 0, yy, np.nan),
        COLORS["norm"],
        smoothing,
        _smooth_source(s, "grad_norm", True),
    )
    _finish(fig, _step_bands(s), highlight, x_range)
    return _preview_note(fig, s)


def step_time_figure(s: StepSeries, highlight: Any = None, x_range: Any = None, uirevision: Any = None) -> Any:
    """Step time split into compute and data wait (means per bucket: the two are stacked and must align)."""
    title = "Step time: compute and data wait"
    st, dt = s.mean.get("step_time"), s.mean.get("data_time")
    if not s.n or st is None or not np.isfinite(st).any():
        return empty(title, "no step times recorded", uirevision)
    dt = np.where(np.isfinite(dt), dt, 0.0) if dt is not None else np.zeros_like(st)  # (no data times: no wait)
    compute = np.clip(st - dt, 0, None)
    fig = go.Figure(layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title="seconds")))
    hover = "%{fullData.name}: %{y:.4g} s<extra></extra>"
    fig.add_scatter(
        x=s.x,
        y=compute,
        mode="lines",
        stackgroup="t",
        name="compute",
        line=dict(color=COLORS["compute"]),
        hovertemplate=hover,
        meta={"series": "compute"},
    )
    fig.add_scatter(
        x=s.x,
        y=dt,
        mode="lines",
        stackgroup="t",
        name="data wait",
        line=dict(color=COLORS["data"]),
        hovertemplate=hover,
        meta={"series": "data wait"},
    )
    _finish(fig, _step_bands(s, nonfinite=False), highlight, x_range)
    return _preview_note(fig, s)


def metric_figure(
    name: str, x: Any, y: Any, smoothing: Any = 0.6, highlight: Any = None, x_range: Any = None, uirevision: Any = None
) -> Any:
    """A scalar the run logged (log_metric: a validation loss, an accuracy) over steps."""
    title = f"Metric: {name}"
    x, y = np.asarray(x), _finite(y)
    if not len(x):
        return empty(title, "not logged in this range", uirevision)
    fig = go.Figure(layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title=text(name))))
    _line(fig, name, x, y, COLORS["metric"], smoothing if len(x) > 10 else 0.0)
    return _finish(fig, [], highlight, x_range)


# -- layers ----------------------------------------------------------------------------------------------------
def layer_heatmap(
    m: Any,
    rows: Any = None,
    title: str | None = None,
    scale: str = "linear",
    highlight: Any = (),
    x_range: Any = None,
    max_cells: int = MAX_CELLS,
    uirevision: Any = None,
) -> go.Figure:
    """Layer x step heat map of a matrix.LayerMatrix: rows in ``rows`` order (every one labelled: the page shows
    a page of rows at a time), steps binned with the worst value kept, non-finite cells drawn black on top, the
    ``highlight`` paths outlined. ``scale``: "linear", "log" (log10 of the values) or "clip" (at the 99th
    percentile, so that one outlier does not pale the rest)."""
    label = m.label
    title = title or f"{label}: {m.kind_label}"
    rows = np.arange(len(m.labels)) if rows is None else np.asarray(rows, dtype=int)
    if not len(rows) or not len(m.steps):
        return empty(title, f"no {m.kind_label} statistics recorded in this range", uirevision)
    vals = m.values[rows]
    bad = m.nonfinite[rows] if m.nonfinite is not None else np.zeros(vals.shape, bool)
    max_cols = max(20, min(600, max_cells // max(1, len(rows))))
    x, binned = bin_columns(vals, m.steps, max_cols, "max")
    _, binned_bad = bin_columns(bad.astype(float), m.steps, max_cols, "max")
    labels = [text(m.labels[i]) for i in rows]
    z = np.where(np.isfinite(binned), binned, np.nan)
    unit = label
    zrange: dict[str, Any] = {}
    finite = z[np.isfinite(z)]
    if scale == "log" and m.stat != "absmax_log2":
        pos = finite[finite > 0]
        floor = float(pos.min()) if len(pos) else 1e-12
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(z > 0, np.log10(np.where(z > 0, z, 1.0)), np.where(z == 0, np.log10(floor) - 1, np.nan))
        unit = f"log10 {label}"
    elif scale == "clip" and len(finite):
        # the colour scale ends at the largest value inside Tukey's far-out fence (Q3 + 3 IQR): outliers beyond it
        # take the top colour instead of paling everything else
        q1, q3 = np.percentile(finite, [25, 75])
        inside = finite[finite <= q3 + 3 * (q3 - q1)]
        lo, hi = float(finite.min()), float(inside.max()) if len(inside) else float(q3)
        zrange = dict(zmin=lo, zmax=hi if hi > lo else lo + 1)
        unit = f"{label} (outliers clipped)"
    if not zrange and m.stat != "absmax_log2" and scale != "log" and len(finite):
        top = float(finite.max())
        zrange = dict(zmin=0.0, zmax=top if top > 0 else 1.0)  # counts and shares start at 0: all-zero stays pale
    height = max(260, min(2400, 90 + 20 * len(labels)))
    fig = go.Figure(layout=_layout(title, uirevision, height=height, hovermode="closest", xaxis=dict(title="step")))
    fig.add_heatmap(
        x=x,
        y=labels,
        z=z.astype(np.float32),
        colorscale="Viridis" if m.stat in ("absmax_log2", "rms_log2") else "Reds",
        **zrange,
        colorbar=dict(
            title=dict(text=text(unit), side="right"),
            thickness=12,
            tickformat=".3~%" if m.share and scale != "log" else None,
        ),
        hoverongaps=False,
        hovertemplate="%{y}<br>step %{x}<br>"
        + text(unit)
        + (" %{z:.4~%}" if m.share and scale != "log" else " %{z:.4g}")
        + "<extra></extra>",
        meta={"stat": m.stat, "kind": m.kind},
    )
    # NaN/Inf cells in black where there is no value to colour (a count of Infs keeps its colour)
    black = (np.nan_to_num(binned_bad) > 0) & ~(np.nan_to_num(binned, nan=0.0) > 0)
    if black.any():
        fig.add_heatmap(
            x=x,
            y=labels,
            z=np.where(black, 1.0, np.nan).astype(np.float32),
            colorscale=[[0, "#000"], [1, "#000"]],
            showscale=False,
            hoverongaps=False,
            name="non-finite",
            hovertemplate="%{y}<br>step %{x}<br>NaN/Inf recorded<extra></extra>",
            meta={"nonfinite": True},
        )
        note(fig, "black: NaN/Inf recorded")
    ticks = dict(type="category", autorange="reversed", tickmode="array", tickvals=labels, ticktext=labels)
    fig.update_yaxes(automargin=True, **ticks)
    first: dict[str, int] = {}  # a label's first row (where the y axis puts it)
    for j, lab in enumerate(labels):
        first.setdefault(lab, j)
    _outline_rows(fig, [first[text(m.labels[i])] for i in rows if m.labels[i] in highlight])
    if x_range is not None:
        fig.update_xaxes(range=[x_range[0] - 0.5, x_range[1] + 0.5], autorange=False)
    return fig


def bin_columns(values: Any, x: Any, max_cols: int, how: str = "max") -> Any:
    """Bin the columns of ``values`` [rows x len(x)] into at most ``max_cols``: (first x of each bin, binned).

    ``how`` = "max" (worst value in the bin, NaN ignored) or "sum".
    """
    values, x = np.asarray(values, dtype=float), np.asarray(x)
    n = values.shape[1] if values.ndim == 2 else 0
    if n <= max_cols:
        return x, values
    starts = np.unique(np.linspace(0, n, max_cols + 1).astype(int)[:-1])
    if how == "sum":
        out = np.add.reduceat(np.nan_to_num(values, nan=0.0), starts, axis=1)
    else:
        filled = np.where(np.isnan(values), -np.inf, values)
        out = np.maximum.reduceat(filled, starts, axis=1)
        out[np.isneginf(out)] = np.nan
    return x[starts], out


def exponent_hist_figure(
    steps: Any,
    counts: Any,
    scales: Any = None,
    kind: str = "",
    title: str | None = None,
    lo: int = -127,
    max_cols: int = 600,
    x_range: Any = None,
    highlight: Any = None,
    uirevision: Any = None,
) -> go.Figure:
    """Exponent histogram over steps (binade x step, log10 counts) with the FP16 and BF16 ranges as bands.

    For scaled gradients (``scales`` given) a line marks where the unscaled values would fall below the smallest
    FP16 subnormal: everything between it and the FP16 band is what the loss scale rescues from underflow.
    """
    title = title or f"Exponent histogram{' of ' + kind if kind else ''}"
    steps, counts = np.asarray(steps), np.asarray(counts, dtype=float)
    if not len(steps) or not counts.sum():
        return empty(title, "no histogram recorded for this site in this range (taken every hist_every steps)")
    binades = np.arange(lo, lo + counts.shape[1])
    used = np.flatnonzero(counts.sum(axis=0) > 0)
    f16, b16 = formats.FP16, formats.BF16
    y0 = min(binades[used[0]], f16.subnormal_exp) - 3
    y1 = max(binades[used[-1]], f16.max_exp) + 3
    rows = (binades >= y0) & (binades <= y1)
    x, z = bin_columns(counts[:, rows].T, steps, max_cols, "sum")
    with np.errstate(divide="ignore"):
        z = np.where(z > 0, np.log10(z), np.nan)
    fig = go.Figure(
        layout=_layout(
            title,
            uirevision,
            height=440,
            hovermode="closest",
            xaxis=dict(title="step"),
            yaxis=dict(title="binade (log2 |x|)"),
            margin=dict(l=70, r=20, t=40, b=110),
        )
    )
    fig.add_heatmap(
        x=x,
        y=binades[rows],
        z=z.astype(np.float32),
        colorscale="Blues",
        # below the plot: the histogram's step axis then spans the same width as the chart above it
        colorbar=dict(
            title=dict(text="log10 count", side="top"),
            thickness=10,
            orientation="h",
            y=-0.32,
            len=0.4,
            x=1,
            xanchor="right",
        ),
        hoverongaps=False,
        hovertemplate="step %{x}<br>2^%{y}<br>10^%{z:.2f} values<extra></extra>",
    )
    bands = (
        (f16.normal_exp, f16.max_exp + 1, "rgba(44,160,44,0.10)", "FP16 normal"),
        (f16.subnormal_exp, f16.normal_exp, "rgba(255,127,14,0.12)", "FP16 subnormal"),
        (max(b16.normal_exp, y0), min(b16.max_exp + 1, y1), "rgba(148,103,189,0.06)", "BF16 normal"),
    )
    for a, b, color, name in bands:
        fig.add_hrect(
            y0=a - 0.5,
            y1=b - 0.5,
            fillcolor=color,
            line_width=0,
            layer="below",
            annotation_text=name,
            annotation_position="top left",
        )
    fig.add_hline(
        y=f16.max_exp + 0.5,
        line=dict(color=COLORS["nonfinite"], dash="dot"),
        annotation_text="FP16 max 65504",
        annotation_position="bottom right",
    )
    if scales is not None:
        s = _finite(scales)
        ok = np.isfinite(s) & (s > 0)
        if ok.any():
            fig.add_scatter(
                x=steps[ok],
                y=f16.subnormal_exp + np.log2(s[ok]),
                mode="lines",
                name="underflow limit without the loss scale",
                line=dict(color=COLORS["scale"], dash="dash", shape="hv"),
            )
    fig.update_yaxes(range=[y0, y1])
    if highlight is not None:
        fig.add_vrect(x0=highlight[0] - 0.5, x1=highlight[1] + 0.5, line=dict(color=COLORS["highlight"], dash="dot"))
    if x_range is not None:
        fig.update_xaxes(range=[x_range[0] - 0.5, x_range[1] + 0.5], autorange=False)
    return fig


def site_stat_figure(
    stat_label: str,
    x: Any,
    y: Any,
    log2: bool = False,
    nonfinite: Any = (),
    limits: Any = (),
    title: str | None = None,
    highlight: Any = None,
    x_range: Any = None,
    extra: Any = None,
    uirevision: Any = None,
    note_text: str | None = None,
    share: bool = False,
) -> go.Figure:
    """One statistic of one site over the steps that recorded it (points joined across the unrecorded steps in
    between), the steps where it held NaN/Inf as bands, format limits (FP16 max) as lines. ``extra``: more
    lines, name -> (x, y), e.g. the model's gradient norm."""
    title = title or stat_label
    x, y = np.asarray(x), _finite(y)
    if not len(x) and not nonfinite:
        return empty(title, "this statistic was not recorded for this site in this range", uirevision)
    if log2:
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(y > 0, np.log2(np.where(y > 0, y, 1.0)), np.nan)
    fig = go.Figure(
        layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title=text(stat_label)), height=320)
    )
    hover = "%{fullData.name}: 2^%{y:.2f}<extra></extra>" if log2 else "%{fullData.name}: %{y:.4g}<extra></extra>"
    if share:
        hover = "%{fullData.name}: %{y:.4~%}<extra></extra>"
        fig.update_yaxes(tickformat=".3~%")
    fig.add_scatter(
        x=x,
        y=y,
        mode="lines+markers" if len(x) <= 200 else "lines",
        connectgaps=True,  # recorded every N steps: the points of one site are joined
        marker=dict(size=4),
        name=text(stat_label),
        line=dict(color=COLORS["loss"]),
        hovertemplate=hover,
        meta={"series": stat_label},
    )
    for name, (ex, ey) in (extra or {}).items():
        ey = _finite(ey)
        if log2:
            with np.errstate(divide="ignore", invalid="ignore"):
                ey = np.where(ey > 0, np.log2(np.where(ey > 0, ey, 1.0)), np.nan)
        fig.add_scatter(
            x=ex,
            y=ey,
            mode="lines",
            name=text(name),
            line=dict(color=COLORS["norm"], width=1),
            opacity=0.6,
            hovertemplate=hover,
            meta={"series": name},
        )
    for name, value in limits:
        fig.add_hline(
            y=value,
            line=dict(color=COLORS["nonfinite"], dash="dot"),
            annotation_text=text(name),
            annotation_position="bottom right",
            name=text(name),
        )
    if log2 and np.isfinite(y).any():
        vals = [v for _, v in limits] + [float(np.nanmin(y)), float(np.nanmax(y))]
        fig.update_yaxes(**_log2_ticks(min(vals), max(vals)))
    _finish(fig, [("NaN/Inf recorded", list(nonfinite), BAND_COLORS["nonfinite"], None)], highlight, x_range)
    if note_text:
        note(fig, note_text)
    return fig


# -- what-if / compare / ranks ----------------------------------------------------------------------------------
def whatif_figure(r: dict[str, Any], highlight: Any = None, x_range: Any = None, uirevision: Any = None) -> go.Figure:
    """Recorded against simulated loss scale (log2), the skipped steps of each as bands."""
    title = "Loss scale: recorded and simulated"
    steps = np.asarray(r["steps"])
    if not len(steps):
        return empty(title, "no steps recorded yet", uirevision)
    fig = go.Figure(layout=_layout(title, uirevision, height=360, xaxis=dict(title="step")))
    ys = []
    bands = []
    # zoomed: the range's own steps downsampled (full resolution once it is short enough), not the whole run's
    shown = (steps >= x_range[0]) & (steps <= x_range[1]) if x_range is not None else np.ones(len(steps), bool)
    for name, vals, skips, color, dash, band in (
        ("recorded", r["recorded"], r["recorded_skipped"], COLORS["scale"], None, BAND_COLORS["skipped"]),
        ("simulated", r["simulated"], r["simulated_skipped"], COLORS["sim"], "dash", "rgba(148,103,189,0.2)"),
    ):
        v = _finite(vals)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(v > 0, np.log2(np.where(v > 0, v, 1.0)), np.nan)
        if not np.isfinite(y).any():
            continue
        ys.append(y)
        x, yy = downsample(steps[shown], y[shown])
        fig.add_scatter(
            x=x,
            y=yy,
            mode="lines",
            name=text(f"{name} scale"),
            line=dict(color=color, dash=dash, shape="hv"),
            hovertemplate="%{fullData.name}: 2^%{y}<extra></extra>",
            meta={"series": f"{name} scale"},
        )
        from .series import intervals

        skips = np.asarray(skips, bool)
        bands.append((f"{name}: skipped", intervals(steps, skips), band, int(skips.sum())))
    if ys:
        allv = np.concatenate(ys)
        fig.update_yaxes(title="loss scale", **_log2_ticks(np.nanmin(allv), np.nanmax(allv)))
    return _finish(fig, bands, highlight, x_range)


def compare_loss_figure(runs: Any, smoothing: Any = 0.6, x_range: Any = None, uirevision: Any = None) -> go.Figure:
    """``runs``: list of (name, StepSeries). A run without a finite loss is named in a note, its non-finite steps
    drawn as bands: it is never silently missing."""
    title = "Loss: run and reference"
    fig = go.Figure(layout=_layout(title, uirevision, xaxis=dict(title="step"), yaxis=dict(title="loss")))
    missing, bands = [], []
    for (name, s), color in zip(runs, (COLORS["a"], COLORS["b"], COLORS["sim"])):
        x, y = s.envelope("loss") if s.n else (np.array([]), np.array([]))
        if np.isfinite(y).any():
            _line(fig, name, x, y, color, smoothing)
        else:
            missing.append(f"{name}: no finite loss ({s.n_nonfinite} non-finite of {s.n} steps)")
        bands.append((f"{name}: non-finite", s.nonfinite, BAND_COLORS["nonfinite"], s.n_nonfinite))
    _finish(fig, bands, None, x_range)
    if missing:
        note(fig, "; ".join(missing))
    return fig


def compare_layers_figure(
    labels: Any, a: Any, b: Any, names: Any = ("run", "reference"), stat_label: str = "", title: Any = None
) -> go.Figure:
    """Per-layer mean statistic of two runs side by side, and their difference."""
    title = title or f"Per-layer {stat_label}: mean over steps"
    if not len(labels):
        return empty(title, "no layers in common")
    fig = go.Figure(
        layout=_layout(title, barmode="group", height=max(320, min(2400, 100 + 22 * len(labels))), hovermode="y")
    )
    labels = [text(p) for p in labels]
    fig.add_bar(y=labels, x=_finite(a).tolist(), orientation="h", name=text(names[0]), marker_color=COLORS["a"])
    fig.add_bar(y=labels, x=_finite(b).tolist(), orientation="h", name=text(names[1]), marker_color=COLORS["b"])
    fig.add_scatter(
        y=labels,
        x=(_finite(b) - _finite(a)).tolist(),
        mode="markers",
        name="difference",
        marker=dict(color="#444", symbol="diamond", size=8),
    )
    fig.update_yaxes(autorange="reversed", automargin=True, tickmode="array", tickvals=labels)
    return fig


def ranks_figure(
    series: Any,
    title: str,
    y_title: str,
    log2: bool = False,
    highlight: Any = None,
    x_range: Any = None,
    ranks: Any = (),
) -> Any:
    """``series``: list of (rank, StepSeries or (steps, values)); one line per rank, the ``ranks`` a finding
    names drawn thick."""
    palette = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
    fig = go.Figure(layout=_layout(title, None, xaxis=dict(title="step"), yaxis=dict(title=text(y_title))))
    for i, (rank, x, y) in enumerate(series):
        y = _finite(y)
        if log2:
            with np.errstate(divide="ignore", invalid="ignore"):
                y = np.where(y > 0, np.log2(np.where(y > 0, y, 1.0)), np.nan)
        fig.add_scatter(
            x=x,
            y=y,
            mode="lines",
            name=f"rank {rank}",
            line=dict(
                color=palette[i % len(palette)], shape="hv" if log2 else "linear", width=3 if rank in ranks else 1.4
            ),
            meta={"series": f"rank {rank}", "rank": int(rank)},
        )
    if log2:
        fig.update_yaxes(title=f"{y_title} (log2)")
    return _finish(fig, [], highlight, x_range)


# -- formats ------------------------------------------------------------------------------------------------------
def probe_error_figure(
    series: dict[str, tuple[np.ndarray, np.ndarray]],
    bounds: dict[str, Any],
    highlight: Any = (),
    title: str = "Probe: relative error against FP32",
) -> Any:
    """Per layer, its norm-wise relative error at each probed step (log10) and its sqrt(k)*u bound (dotted); the
    ``highlight`` layers drawn thick."""
    fig = go.Figure(
        layout=_layout(title, None, xaxis=dict(title="step"), yaxis=dict(title="log10 relative error"), height=340)
    )
    any_data = False
    for i, (name, (x, y)) in enumerate(series.items()):
        y = np.asarray(y, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            ly = np.where(y > 0, np.log10(np.where(y > 0, y, 1.0)), np.nan)
        if not np.isfinite(ly).any():
            continue
        any_data = True
        color = f"hsl({(i * 47) % 360},65%,45%)"
        wide = name in highlight
        xx, yy = downsample(np.asarray(x), ly)
        fig.add_scatter(
            x=xx,
            y=yy,
            mode="lines+markers",
            name=text(name),
            line=dict(color=color, width=3 if wide else 1.4),
            hovertemplate="%{fullData.name}: 10^%{y:.2f}<extra></extra>",
            meta={"series": name, "highlight": wide},
        )
        if name in bounds and len(xx):
            fig.add_scatter(
                x=[xx[0], xx[-1]],
                y=[np.log10(bounds[name])] * 2,
                mode="lines",
                showlegend=False,
                name=text(name),
                line=dict(color=color, dash="dot"),
                hovertemplate="%{fullData.name}: sqrt(k)*u<extra></extra>",
            )
    return fig if any_data else empty(title, "no probe results: attach(..., probe_every=N) records them")


def formats_figure(
    labels: Any, lost: dict[str, Any], by: str | None = None, title: str | None = None, highlight: Any = ()
) -> Any:
    """Grouped bars: per site, the share of its non-zero values each format would saturate or flush, the sites
    ranked by the format ``by``; when no site loses anything in any format, a sentence instead of empty axes."""
    by = by or next(iter(lost), "")
    title = title or f"Share of non-zero values lost per format (worst in {by} first)"
    if not len(labels):
        return empty(title, "no exponent histograms recorded yet")
    if not any(np.nan_to_num(np.asarray(v, dtype=float)).any() for v in lost.values()):
        return empty(title, f"no site would lose values in {', '.join(lost)}: every recorded value fits")
    labels = [text(p) for p in labels]
    fig = go.Figure(
        layout=_layout(
            title,
            None,
            barmode="group",
            hovermode="y",
            height=max(320, min(2400, 26 * len(labels) + 140)),
            xaxis=dict(title="share lost (%)", rangemode="tozero"),
        )
    )
    for name, shares in lost.items():
        fig.add_bar(
            x=100 * np.nan_to_num(np.asarray(shares, dtype=float)),
            y=labels,
            name=text(name),
            orientation="h",
            hovertemplate="%{y}: %{x:.3g}% lost in %{fullData.name}<extra></extra>",
        )
    fig.update_yaxes(autorange="reversed", automargin=True, tickmode="array", tickvals=labels)
    shown = {text(h) for h in highlight}
    _outline_rows(fig, [i for i, lab in enumerate(labels) if lab in shown])
    return fig


def _outline_rows(fig: go.Figure, rows: list[int]) -> None:
    """A highlight frame around each of ``rows`` (positions on a categorical y axis), across the plot's width; set
    in one assignment (``add_shape`` validates every shape already there again: quadratic in the rows)."""
    if not rows:
        return
    line = dict(color=COLORS["highlight"], width=2)
    frames = [
        dict(type="rect", xref="paper", x0=0, x1=1, yref="y", y0=k - 0.5, y1=k + 0.5, line=line, name="highlight")
        for k in rows
    ]
    fig.layout.shapes = (*fig.layout.shapes, *frames)


__all__ = ["GRAPH_CONFIG", "MAX_POINTS", "downsample"]
