"""Formats: per layer, what FP16 / BF16 / FP8 (E4M3, E5M2 with delayed scaling) would lose, and the precision-loss
probe's measured error against FP32 over the steps."""

from __future__ import annotations

from dash import html

from .. import data, figures, ids
from .common import graph, table


def layout(ctx, run: str, query: dict):
    series, bounds, verdicts = ctx.cached(run, "probe", data.probe_series)
    labels, lost = ctx.cached(run, "formats-shares", data.formats_shares)
    rows = ctx.cached(run, "formats-rows", data.formats_rows)
    named = [v["path"] for v in verdicts if v["named"]]
    return html.Div(
        [
            html.H2("Formats"),
            html.P(
                "Recomputed in FP32 from the same inputs on probed steps, each layer's half-precision output has the "
                "relative error below; the dotted line is sqrt(k)*u, what rounding explains for a layer summing k "
                "terms. A layer far above it loses precision to cancellation (rule precision-loss)."
            ),
            html.P(
                f"Measured precision loss: {', '.join(named)}"
                if named
                else "No layer measured above its bound."
                if verdicts
                else "No probe results in this trace: attach(..., probe_every=N) records them.",
                id=ids.FORMATS_VERDICT,
            ),
            graph(ids.FORMATS_PROBE, figure=figures.probe_error_figure(series, bounds)),
            html.P(
                "From the exponent histograms: the share of each site's non-zero values that would saturate or "
                "flush to zero in FP16 / BF16 (as recorded: output gradients at the recorded loss scale) and in FP8 "
                "with per-tensor delayed scaling (amax over the last 1024 steps, margin 0; E4M3 448 .. 2^-9, E5M2 "
                "57344 .. 2^-16). Headroom: binades between the largest value and the format's overflow; span: "
                "binades from the smallest to the largest non-zero value (E4M3 holds 17.8, E5M2 31.8)."
            ),
            graph(ids.FORMATS_SHARES, figure=figures.formats_figure(labels, lost)),
            table(rows, ids.FORMATS_TABLE),
        ]
    )


def register(app, ctx) -> None:
    """Static page: nothing to update."""
