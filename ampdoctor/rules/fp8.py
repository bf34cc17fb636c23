"""fp8-readiness (info): which layers would lose information if trained in FP8 with per-tensor delayed scaling (the
Transformer Engine recipe), and which recipe settings would keep them; from the exponent histograms (ampdoctor.whatif).

The HYBRID recipe casts forward tensors (activations, weights) to E4M3 and output gradients to E5M2. A site "loses
information" when, at the median of its judged histogram steps (whatif.judged: clean, with a delayed scale resting on
at least MIN_HELD amax values), at least MIN_LOST of its non-zero values certainly saturate or flush to zero (the lo
end of whatif's interval: no guess about the binade a boundary cuts).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TypedDict

import numpy as np

from .. import whatif as W
from ..trace import Trace
from ..trace.view import View
from . import advice as A
from .fix import Part, code, text
from .result import Diagnosis, finding
from .runview import IntArray, RunView

# 1% of a tensor's non-zero values clipped or zeroed: beyond the loss FP8's 3-bit (E4M3) rounding already brings
# (relative error up to 6%), and well above the ~1e-5 a Gaussian tensor's tail below amax * 2^-18 holds.
MIN_LOST = 0.01
# Judged histogram steps a verdict needs: a median of one or two is a sample, not a site's behaviour.
MIN_STEPS = 3
KIND_FORMAT = {"act": "e4m3", "weight": "e4m3", "grad_out": "e5m2"}
HISTORIES = (1, 16, 128, W.HISTORY)
MARGINS = (0, 1, 2, 3, 4)


class Recipe(TypedDict):
    """A delayed-scaling recipe for one site and the share it would lose there."""

    format: str
    history: int
    margin: int
    lost: float


class SiteLoss(TypedDict):
    """A site that loses under the default recipe (``assess``): its shares lost, and the best recipe for it."""

    path: str
    kind: str
    format: str
    lost: float
    saturated: float
    flushed: float
    best: Recipe
    kept: bool


def _lost(out: W.Columns, sites: IntArray, name: str) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
    """site -> the median over its judged rows of the share certainly lost in ``name`` (saturated + flushed), and of
    the saturated and the flushed shares apart (sites without a judged row are left out)."""
    keep = W.judged_mask(out)
    return (
        W.site_medians(out[f"{name}_sat_lo"] + out[f"{name}_flush_lo"], sites, keep),
        W.site_medians(out[f"{name}_sat_lo"], sites, keep),
        W.site_medians(out[f"{name}_flush_lo"], sites, keep),
    )


def assess(tr: Trace | View, kinds: Sequence[str] = ("act", "grad_out"), min_lost: float = MIN_LOST) -> list[SiteLoss]:
    """The sites that lose at least ``min_lost`` under the default recipe, with their best (format, history,
    margin) and the share lost there. Every site of a kind at once (its histogram rows as read, one what-if over all
    of them); the recipe search only over the sites that lose."""
    out: list[SiteLoss] = []
    for kind in kinds:
        inp = W.Inputs.of(tr, kind)
        h, base = inp.whatif()
        if not len(h):
            continue
        name = KIND_FORMAT[kind]
        judged = dict(zip(*np.unique(h.site[W.judged_mask(base)], return_counts=True)))
        lost, sat, flush = _lost(base, h.site, name)
        pick = [
            j for j, sid in enumerate(inp.ids.tolist()) if judged.get(sid, 0) >= MIN_STEPS and lost[sid] >= min_lost
        ]
        losing = list(inp.sites.iloc[pick].itertuples())  # (rows only of the few that lose)
        if not losing:
            continue
        sub = inp.rows([int(s.id) for s in sorted(losing, key=lambda s: s.id)])
        search: dict[tuple[int, int], dict[str, dict[int, float]]] = {}
        for hist, m in itertools.product(HISTORIES, MARGINS):
            rows = W.whatif_rows(inp, sub, hist, m)
            search[(hist, m)] = {fmt: _lost(rows, sub.site, fmt)[0] for fmt in ("e4m3", "e5m2")}
        for s in losing:
            sid = int(s.id)
            best: tuple[tuple[float, bool, int, int], Recipe] | None = None
            for hist, m in itertools.product(HISTORIES, MARGINS):
                for fmt in ("e4m3", "e5m2"):
                    v = float(search[(hist, m)][fmt].get(sid, float("nan")))
                    key = (v, fmt != name, m, -hist)  # least lost; then the recipe's own format, small margin
                    if best is None or key < best[0]:
                        best = (key, {"format": fmt, "history": hist, "margin": m, "lost": v})
            assert best is not None  # (HISTORIES and MARGINS are not empty)
            out.append(
                {
                    "path": s.path,
                    "kind": kind,
                    "format": name,
                    "lost": float(lost[sid]),
                    "saturated": float(sat[sid]),
                    "flushed": float(flush[sid]),
                    "best": best[1],
                    "kept": best[1]["lost"] < min_lost,
                }
            )
    return sorted(out, key=lambda r: -r["lost"])


def _recipe(hist: int, margin: int, fmt: str) -> str:
    return (
        "from transformer_engine.common.recipe import DelayedScaling, Format\n"
        f'recipe = DelayedScaling(fp8_format=Format.{fmt}, amax_history_len={hist}, amax_compute_algo="max", '
        f"margin={margin})"
    )


def fp8_readiness(run: RunView, *, min_lost: float = MIN_LOST) -> Diagnosis | None:
    rows = assess(run.view, min_lost=min_lost)
    if not rows:
        return None
    kept = [r for r in rows if r["kept"] and r["best"]["format"] == r["format"]]
    swap = [r for r in rows if r["kept"] and r["best"]["format"] != r["format"]]
    lost = [r for r in rows if not r["kept"]]
    ev = {
        "min_lost": min_lost,
        "default_recipe": {"history": W.HISTORY, "margin": W.MARGIN, "format": "HYBRID"},
        "layers": {
            f"{r['path']} ({r['kind']})": {k: r[k] for k in ("format", "lost", "saturated", "flushed", "best")}
            for r in rows
        },
    }
    worst = rows[0]
    summary = (
        f"With per-tensor delayed scaling (amax over {W.HISTORY} steps, margin {W.MARGIN}), "
        f"{len(rows)} site(s) would lose at least {A.pct(min_lost)} of their non-zero values in FP8; worst "
        f"{worst['path']} ({worst['kind']}, {worst['format'].upper()}): {A.pct(worst['lost'])} "
        f"({A.pct(worst['saturated'])} saturated, {A.pct(worst['flushed'])} flushed to zero)."
    )
    fix: list[Part] = []
    if kept:
        # the settings that keep the most of them, as one recipe (histories and margins are per recipe, not layer)
        choice = max(
            {(r["best"]["history"], r["best"]["margin"]) for r in kept},
            key=lambda hm: sum(1 for r in kept if (r["best"]["history"], r["best"]["margin"]) == hm),
        )
        names = ", ".join(f"{r['path']} ({r['kind']})" for r in kept)
        fix += [
            text(
                f"These recipe settings keep {names} (lost share at most "
                f"{A.pct(max(r['best']['lost'] for r in kept))}):"
            ),
            code(_recipe(choice[0], choice[1], "HYBRID")),
        ]
    if swap:
        fix.append(
            text(
                "These need E5M2's range, not E4M3's precision: "
                + "; ".join(
                    f"{r['path']} ({r['kind']}): {A.pct(r['best']['lost'])} lost in E5M2 with history "
                    f"{r['best']['history']}, margin {r['best']['margin']}"
                    for r in swap
                )
                + ". Transformer Engine casts forward tensors to E4M3 only: keep these layers out of "
                "te.fp8_autocast (plain torch.nn modules in BF16)."
            )
        )
    if lost:
        fix.append(
            text(
                "No recipe keeps "
                + ", ".join(f"{r['path']} ({r['kind']}, best {A.pct(r['best']['lost'])})" for r in lost)
                + ": keep these layers in BF16/FP16 (outside te.fp8_autocast)."
            )
        )
    layers = list(dict.fromkeys(r["path"] for r in rows))
    return finding(
        "info", "FP8 readiness: layers that would lose information", summary, layers=layers, evidence=ev, fix=fix
    )
