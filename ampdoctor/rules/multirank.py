"""The diagnosis of a multi-rank run: every rule over each rank's trace (one finding per rule and culprit, naming
the ranks it fired on), then the rank rules (scope "ranks") once over all ranks together."""

from __future__ import annotations

import contextlib
from dataclasses import replace

from ..severity import RANK
from ..trace import Trace, TraceError
from ..trace.run import RankRun
from . import engine
from .engine import RuleOptions, Run, Selected, run_rule
from .result import Diagnosis, worst_first


def reference_for(ref: Trace | RankRun | None, rank: int) -> Trace | None:
    """The reference trace for one rank: the same rank of a reference run, else its lowest rank."""
    if isinstance(ref, RankRun):
        return ref.traces.get(rank) or next(iter(ref))
    return ref


def diagnose_ranks(tr: Trace | RankRun, ref: Trace | RankRun | None, selected: list[Selected]) -> list[Diagnosis]:
    """Findings of a RankRun (or of one Trace against a reference run), worst first."""
    selected = [Selected(*s) for s in selected]
    if isinstance(tr, Trace):
        rank = (tr.meta.get("run", {}) or {}).get("rank", 0)
        ref = reference_for(ref, rank)
        with tr.snapshot(), ref.snapshot() if ref is not None else contextlib.nullcontext():
            return engine.diagnose_trace(tr, ref, selected)
    per_trace = [s for s in selected if s.rule.scope == "trace"]
    across = [s for s in selected if s.rule.scope == "ranks" and s.shown]
    with contextlib.ExitStack() as stack:
        for t in list(tr) + ([] if ref is None else list(ref) if isinstance(ref, RankRun) else [ref]):
            stack.enter_context(t.snapshot())
        found: list[tuple[int, Diagnosis]] = []
        runs: dict[int, Run] = {}
        for rank, t in tr.views().items():  # FSDP: the whole tensors in place of each rank's shards
            r_ref = reference_for(ref, rank)
            run = runs[rank] = Run(t, Run(r_ref) if r_ref is not None else None)
            if run.n_steps == 0:
                continue
            found += [(rank, d) for d in engine.diagnose_trace(t, r_ref, per_trace)]
        if not any(run.n_steps for run in runs.values()):
            raise TraceError(f"{tr.source}: no steps recorded in any rank; nothing to diagnose")
        out = _merge(found)
        out += _across(runs, across)
    return worst_first(out, {s.rule.id: i for i, s in enumerate(selected)})


def _across(runs: dict[int, Run], selected: list[Selected]) -> list[Diagnosis]:
    """The rank rules, once over all ranks (each rank's Run knows the others through ``ranks``)."""
    for run in runs.values():
        run.ranks = runs
    out: list[Diagnosis] = []
    for s in selected:
        found, error = run_rule(s.rule, runs[min(runs)], s.over)
        out += found if error is None else [error]
    return out


def rank_findings(rr: RankRun, rules: RuleOptions | None = None) -> list[Diagnosis]:
    """Only the rank rules over a RankRun (the dashboard adds them to each rank's own findings)."""
    selected = [s for s in engine.resolve_rules(rules) if s.rule.scope == "ranks" and s.shown]
    with contextlib.ExitStack() as stack:
        for t in rr:
            stack.enter_context(t.snapshot())
        views = rr.views()  # FSDP: the whole tensors in place of each rank's shards
        return worst_first(
            _across({rank: Run(t) for rank, t in views.items()}, selected),
            {s.rule.id: i for i, s in enumerate(selected)},
        )


def _merge(found: list[tuple[int, Diagnosis]]) -> list[Diagnosis]:
    """One finding per rule, title and culprit layers: the worst rank's (lowest rank on a tie), naming every
    rank it fired on; its evidence is that rank's, and says so."""
    groups: dict[tuple[str, str, tuple[str, ...]], list[tuple[int, Diagnosis]]] = {}
    for rank, d in found:
        groups.setdefault((d.rule, d.title, tuple(map(str, d.layers))), []).append((rank, d))
    out = []
    for members in groups.values():
        rank, d = max(members, key=lambda rd: (RANK[rd[1].severity], -rd[0]))
        out.append(replace(d, ranks=sorted(r for r, _ in members), evidence={"evidence_from_rank": rank, **d.evidence}))
    return out
