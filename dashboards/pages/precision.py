"""Precision map: the recommended allocation against what the run did, module by module."""

from __future__ import annotations

from dash import html

from ampdoctor.precision_label import describe_precision

from .. import data, ids
from .common import table


def layout(ctx, run: str, query: dict):
    tr = ctx.trace(run)
    return html.Div(
        [
            html.H2("Precision map"),
            html.P(describe_precision(tr.config)),
            html.P(
                "Recommended: matrix multiplies and convolutions forward and backward in FP16/BF16; normalisation, "
                "softmax, the loss and the weight update (master weights) in FP32. 'follows input' layers compute "
                "in the dtype they are given."
            ),
            table(data.precision_rows(tr), ids.PRECISION_TABLE),
        ]
    )


def register(app, ctx) -> None:
    """Static page: nothing to update."""
