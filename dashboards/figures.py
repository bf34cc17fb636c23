"""Pure plotly figure builders, shared by the dashboard and the HTML report: arrays in, figure out.

No dash import here. Names (layer paths, run labels) are user data: plotly.js reads its text as a small HTML
dialect (``<a href>``, ``<b>``, ``<br>``, entities), so every name and title goes in through ``text()``.
Every line is downsampled (min/max per bucket, so spikes survive) to at most MAX_POINTS
points and every heat map is binned over steps, so a 10,000-step trace ships a few thousand points per line.
"""

from __future__ import annotations

import html

import numpy as np
import plotly.graph_objects as go

from ampdoctor import formats

MAX_POINTS = 4000  # per line; the issue allows ~10k, min/max buckets keep every spike at half of that
MAX_CELLS = 120_000  # per heat map (rows x binned steps)
COLORS = {
    "loss": "#1f77b4",
    "skip": "#ff7f0e",
    "nonfinite": "#d62728",
    "scale": "#2ca02c",
    "sim": "#9467bd",
    "compute": "#1f77b4",
    "data": "#ff7f0e",
    "a": "#1f77b4",
    "b": "#d62728",
}
_LAYOUT = dict(
    template="plotly_white",
    margin=dict(l=60, r=20, t=40, b=40),
    height=320,
    legend=dict(orientation="h", yanchor="bottom", y=1.02, xanchor="right", x=1),
)


def text(name) -> str:
    """``name`` as plotly shows it literally: ``<``, ``>`` and ``&`` as entities (plotly.js turns them back into
    characters), so a layer called ``<a href=...>`` is a label, not a link."""
    return html.escape(str(name), quote=False)


def _layout(title: str, **kw) -> dict:
    return dict(_LAYOUT, title=text(title), **kw)


# -- reduction -------------------------------------------------------------------------------------------------
def downsample(x, y, max_points: int = MAX_POINTS):
    """At most ``max_points`` points of (x, y): the min and the max of each bucket, in x order (NaN gaps kept)."""
    x, y = np.asarray(x), np.asarray(y, dtype=float)
    n = len(y)
    if n <= max_points:
        return x, y
    nb = max(1, max_points // 2)
    edges = np.linspace(0, n, nb + 1).astype(int)
    keep = []
    for a, b in zip(edges[:-1], edges[1:]):
        seg = y[a:b]
        ok = np.isfinite(seg)
        if not ok.any():
            keep.append(a)
            continue
        lo = a + int(np.argmin(np.where(ok, seg, np.inf)))
        hi = a + int(np.argmax(np.where(ok, seg, -np.inf)))
        keep.extend(sorted({lo, hi}))
    idx = np.array(keep[:max_points])
    return x[idx], y[idx]


def thin(x, max_points: int = MAX_POINTS):
    """Evenly chosen indices of at most ``max_points`` of ``x`` (for markers)."""
    n = len(x)
    if n <= max_points:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, max_points).astype(int))


def bin_columns(values, x, max_cols: int, how: str = "max"):
    """Bin the columns of ``values`` [rows x len(x)] into at most ``max_cols``: (first x of each bin, binned).

    ``how`` = "max" (worst value in the bin, NaN ignored) or "sum".
    """
    values, x = np.asarray(values, dtype=float), np.asarray(x)
    n = values.shape[1] if values.ndim == 2 else 0
    if n <= max_cols:
        return x, values
    starts = np.linspace(0, n, max_cols + 1).astype(int)[:-1]
    starts = np.unique(starts)
    if how == "sum":
        out = np.add.reduceat(np.nan_to_num(values, nan=0.0), starts, axis=1)
    else:
        filled = np.where(np.isnan(values), -np.inf, values)
        out = np.maximum.reduceat(filled, starts, axis=1)
        out[np.isneginf(out)] = np.nan
    return x[starts], out


def _finite(y):
    y = np.asarray(y, dtype=float)
    return np.where(np.isfinite(y), y, np.nan)


def _empty(title: str, note: str) -> go.Figure:
    fig = go.Figure(layout=_layout(title))
    fig.add_annotation(text=note, showarrow=False, xref="paper", yref="paper", x=0.5, y=0.5)
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def _log2_ticks(lo: float, hi: float) -> dict:
    lo, hi = int(np.floor(lo)), int(np.ceil(hi))
    step = max(1, (hi - lo) // 8)
    vals = list(range(lo, hi + 1, step))
    return dict(tickvals=vals, ticktext=[f"2^{v}" for v in vals])


# -- overview --------------------------------------------------------------------------------------------------
def loss_figure(steps, loss, skipped, nonfinite, title: str = "Loss") -> go.Figure:
    """Loss over steps; skipped steps and non-finite steps marked."""
    steps, loss = np.asarray(steps), np.asarray(loss, dtype=float)
    if not len(steps):
        return _empty(title, "no steps recorded yet")
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="loss"))
    x, y = downsample(steps, _finite(loss))
    fig.add_scatter(x=x, y=y, mode="lines", name="loss", line=dict(color=COLORS["loss"]))
    fin = np.where(np.isfinite(loss), loss, np.nan)
    base = np.nanmax(fin) if np.isfinite(fin).any() else 1.0
    for mask, name, color, symbol in (
        (np.asarray(skipped, bool), "skipped step", COLORS["skip"], "x"),
        (np.asarray(nonfinite, bool), "non-finite", COLORS["nonfinite"], "circle"),
    ):
        idx = np.flatnonzero(mask)
        if len(idx):
            idx = idx[thin(idx)]
            yy = np.where(np.isfinite(loss[idx]), loss[idx], base)
            fig.add_scatter(
                x=steps[idx],
                y=yy,
                mode="markers",
                name=f"{name} ({int(mask.sum())})",
                marker=dict(color=color, symbol=symbol, size=7),
            )
    return fig


def loss_scale_figure(steps, scale, skipped, title: str = "Loss scale (log2)") -> go.Figure:
    """Loss scale in force per step on a log2 axis, with the skipped steps (each halves the scale)."""
    steps, scale = np.asarray(steps), np.asarray(scale, dtype=float)
    ok = np.isfinite(scale) & (scale > 0)
    if not ok.any():
        return _empty(title, "no loss scaler in this run")
    y = np.full(len(scale), np.nan)
    y[ok] = np.log2(scale[ok])
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="loss scale"))
    x, yy = downsample(steps, y)
    fig.add_scatter(
        x=x,
        y=yy,
        mode="lines",
        name="loss scale",
        line=dict(color=COLORS["scale"], shape="hv"),
        hovertemplate="step %{x}<br>scale 2^%{y}<extra></extra>",
    )
    idx = np.flatnonzero(np.asarray(skipped, bool) & ok)
    if len(idx):
        idx = idx[thin(idx)]
        fig.add_scatter(
            x=steps[idx],
            y=y[idx],
            mode="markers",
            name=f"skipped step ({int(np.sum(skipped))})",
            marker=dict(color=COLORS["skip"], symbol="x", size=7),
        )
    fig.update_yaxes(**_log2_ticks(np.nanmin(y), np.nanmax(y)))
    return fig


def step_time_figure(steps, step_time, data_time, title: str = "Step time: compute vs data wait") -> go.Figure:
    steps = np.asarray(steps)
    st, dt = _finite(step_time), _finite(data_time)
    if not len(steps) or not np.isfinite(st).any():
        return _empty(title, "no step times recorded")
    dt = np.where(np.isfinite(dt), dt, 0.0)
    compute = np.clip(st - dt, 0, None)
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="seconds"))
    # mean per bucket (not min/max): the two series are stacked and must stay aligned
    n, nb = len(steps), MAX_POINTS
    if n > nb:
        starts = np.unique(np.linspace(0, n, nb + 1).astype(int)[:-1])
        counts = np.diff(np.append(starts, n))
        x = steps[starts]
        compute = np.add.reduceat(np.nan_to_num(compute), starts) / counts
        dt = np.add.reduceat(dt, starts) / counts
    else:
        x = steps
    fig.add_scatter(x=x, y=compute, mode="lines", stackgroup="t", name="compute", line=dict(color=COLORS["compute"]))
    fig.add_scatter(x=x, y=dt, mode="lines", stackgroup="t", name="data wait", line=dict(color=COLORS["data"]))
    return fig


# -- layers ----------------------------------------------------------------------------------------------------
def layer_heatmap(lm, order=None, title: str | None = None, max_cells: int = MAX_CELLS) -> go.Figure:
    """Layer x step heat map of a LayerMatrix (data.layer_matrix); rows in ``order``, steps binned (worst kept)."""
    from .data import STATS  # plain data module, no dash

    label = STATS.get(lm.stat, lm.stat)
    title = title or f"{label} — {lm.kind}"
    if not len(lm.labels) or not len(lm.steps):
        return _empty(title, f"no {lm.kind} statistics recorded yet")
    order = np.arange(len(lm.labels)) if order is None else np.asarray(order)
    vals = lm.values[order]
    max_cols = max(20, min(600, max_cells // max(1, len(order))))
    x, binned = bin_columns(vals, lm.steps, max_cols, "max")
    labels = [text(lm.labels[i]) for i in order]  # a click reads the label back: layers.open_clicked
    z = np.where(np.isfinite(binned), binned, np.nan).astype(np.float32)  # float32: ships as 4 bytes a cell
    colorscale = "Viridis" if lm.stat == "absmax_log2" else "Reds"
    zrange = {}
    if lm.stat != "absmax_log2":  # counts and shares start at 0; an all-zero map stays white, not mid-scale
        top = np.nanmax(z) if np.isfinite(z).any() else 0.0
        zrange = dict(zmin=0.0, zmax=float(top) if top > 0 else 1.0)
    fig = go.Figure(layout=_layout(title, xaxis_title="step", height=max(320, min(1400, 60 + 18 * len(labels)))))
    # rows are named by the layer path on a category axis (a click reports it); no per-cell text or ids
    fig.add_heatmap(
        x=x,
        y=labels,
        z=z,
        colorscale=colorscale,
        **zrange,
        colorbar=dict(title=label),
        hoverongaps=False,
        hovertemplate="%{y}<br>step %{x}<br>" + label + " %{z:.4g}<extra></extra>",
    )
    fig.update_yaxes(type="category", autorange="reversed")
    return fig


def exponent_hist_figure(
    steps, counts, scales=None, kind: str = "", title: str | None = None, lo: int = -127, max_cols: int = 600
) -> go.Figure:
    """Exponent histogram over steps (binade x step, log10 counts) with the FP16 and BF16 ranges as bands.

    For scaled gradients (``scales`` given) a line marks where the unscaled values would fall below the smallest
    FP16 subnormal: everything between it and the FP16 band is what the loss scale rescues from underflow.
    """
    title = title or f"Exponent histogram{' — ' + kind if kind else ''}"
    steps, counts = np.asarray(steps), np.asarray(counts, dtype=float)
    if not len(steps) or not counts.sum():
        return _empty(title, "no histogram recorded for this site (histograms are taken every hist_every steps)")
    binades = np.arange(lo, lo + counts.shape[1])
    used = np.flatnonzero(counts.sum(axis=0) > 0)
    f16, b16 = formats.FP16, formats.BF16
    y0 = min(binades[used[0]], f16.subnormal_exp) - 3
    y1 = max(binades[used[-1]], f16.max_exp) + 3
    rows = (binades >= y0) & (binades <= y1)
    x, z = bin_columns(counts[:, rows].T, steps, max_cols, "sum")
    with np.errstate(divide="ignore"):
        z = np.where(z > 0, np.log10(z), np.nan)
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="binade (log2 |x|)", height=420))
    fig.add_heatmap(
        x=x,
        y=binades[rows],
        z=z.tolist(),
        colorscale="Blues",
        colorbar=dict(title="log10 count"),
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
    return fig


def layer_series_figure(series: dict, title: str = "abs max / RMS / gradient norm") -> go.Figure:
    """Lines on a log2 axis: ``series`` maps name -> (steps, values)."""
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="log2 value"))
    any_data = False
    for name, (x, y) in series.items():
        y = _finite(y)
        with np.errstate(divide="ignore", invalid="ignore"):
            ly = np.where(y > 0, np.log2(y), np.nan)
        if not np.isfinite(ly).any():
            continue
        any_data = True
        xx, yy = downsample(np.asarray(x), ly)
        fig.add_scatter(
            x=xx,
            y=yy,
            mode="lines+markers" if len(xx) < 60 else "lines",
            name=text(name),
            hovertemplate="%{fullData.name} 2^%{y:.2f} at step %{x}<extra></extra>",
        )
    return fig if any_data else _empty(title, "no values recorded for this site yet")


# -- what-if / compare -----------------------------------------------------------------------------------------
def whatif_figure(
    steps, recorded, simulated, recorded_skipped, simulated_skipped, title: str = "Loss scale: recorded vs simulated"
) -> go.Figure:
    steps = np.asarray(steps)
    if not len(steps):
        return _empty(title, "no steps recorded yet")
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="loss scale", height=380))
    ys = []
    for name, vals, skips, color, dash in (
        ("recorded", recorded, recorded_skipped, COLORS["scale"], None),
        ("simulated", simulated, simulated_skipped, COLORS["sim"], "dash"),
    ):
        v = _finite(vals)
        with np.errstate(divide="ignore", invalid="ignore"):
            y = np.where(v > 0, np.log2(v), np.nan)
        if not np.isfinite(y).any():
            continue
        ys.append(y)
        x, yy = downsample(steps, y)
        fig.add_scatter(
            x=x,
            y=yy,
            mode="lines",
            name=text(f"{name} scale"),
            line=dict(color=color, dash=dash, shape="hv"),
            hovertemplate="%{fullData.name} 2^%{y} at step %{x}<extra></extra>",
        )
        idx = np.flatnonzero(np.asarray(skips, bool))
        if len(idx):
            idx = idx[thin(idx)]
            fig.add_scatter(
                x=steps[idx],
                y=y[idx],
                mode="markers",
                name=f"{name} skipped ({int(np.sum(skips))})",
                marker=dict(color=color, symbol="x", size=7),
            )
    if ys:
        allv = np.concatenate(ys)
        fig.update_yaxes(**_log2_ticks(np.nanmin(allv), np.nanmax(allv)))
    return fig


def compare_loss_figure(runs, title: str = "Loss: run vs reference") -> go.Figure:
    """``runs``: list of (name, steps, loss)."""
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="loss"))
    for (name, steps, loss), color in zip(runs, (COLORS["a"], COLORS["b"], COLORS["sim"])):
        x, y = downsample(np.asarray(steps), _finite(loss))
        fig.add_scatter(x=x, y=y, mode="lines", name=text(name), line=dict(color=color))
    return fig


def compare_layers_figure(
    labels, a, b, names=("run", "reference"), stat_label: str = "", title: str | None = None
) -> go.Figure:
    """Per-layer mean statistic of two runs side by side, and their difference."""
    title = title or f"Per-layer {stat_label}: mean over steps"
    if not len(labels):
        return _empty(title, "no layers in common")
    fig = go.Figure(layout=_layout(title, barmode="group", height=max(320, min(1400, 80 + 22 * len(labels)))))
    labels = [text(p) for p in labels]
    fig.add_bar(y=labels, x=_finite(a).tolist(), orientation="h", name=text(names[0]), marker_color=COLORS["a"])
    fig.add_bar(y=labels, x=_finite(b).tolist(), orientation="h", name=text(names[1]), marker_color=COLORS["b"])
    fig.add_scatter(
        y=labels,
        x=(_finite(b) - _finite(a)).tolist(),
        mode="markers",
        name="difference",
        marker=dict(color="black", symbol="diamond", size=8),
    )
    fig.update_yaxes(autorange="reversed")
    return fig


# -- formats ------------------------------------------------------------------------------------------------------
def probe_error_figure(series: dict, bounds: dict, title: str = "Probe: relative error against FP32 (log10)"):
    """Per layer, its norm-wise relative error at each probed step (markers) and its sqrt(k)*u bound (dotted)."""
    fig = go.Figure(layout=_layout(title, xaxis_title="step", yaxis_title="log10 relative error"))
    any_data = False
    for i, (name, (x, y)) in enumerate(series.items()):
        y = np.asarray(y, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            ly = np.where(y > 0, np.log10(y), np.nan)
        if not np.isfinite(ly).any():
            continue
        any_data = True
        color = f"hsl({(i * 47) % 360},65%,45%)"
        xx, yy = downsample(np.asarray(x), ly)
        fig.add_scatter(
            x=xx,
            y=yy,
            mode="lines+markers",
            name=text(name),
            line=dict(color=color),
            hovertemplate="%{fullData.name} 10^%{y:.2f} at step %{x}<extra></extra>",
        )
        if name in bounds and len(xx):
            fig.add_scatter(
                x=[xx[0], xx[-1]],
                y=[np.log10(bounds[name])] * 2,
                mode="lines",
                showlegend=False,
                name=text(name),
                line=dict(color=color, dash="dot"),
                hovertemplate="%{fullData.name} sqrt(k)*u<extra></extra>",
            )
    return fig if any_data else _empty(title, "no probe results: attach(..., probe_every=N) records them")


def formats_figure(labels, lost: dict, title: str = "Share of non-zero values lost per format"):
    """Grouped bars: per site, the share each format would saturate or flush (FP8 with delayed scaling)."""
    if not len(labels):
        return _empty(title, "no exponent histograms recorded yet")
    fig = go.Figure(
        layout=_layout(title, barmode="group", yaxis_title="share lost (%)", height=max(320, 28 * len(labels) + 120))
    )
    labels = [text(p) for p in labels]
    for name, shares in lost.items():
        fig.add_bar(
            x=100 * np.nan_to_num(np.asarray(shares, dtype=float)),
            y=labels,
            name=text(name),
            orientation="h",
            hovertemplate="%{y}: %{x:.2f}% lost in %{fullData.name}<extra></extra>",
        )
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(xaxis_title="share lost (%)", yaxis_title=None)
    return fig
