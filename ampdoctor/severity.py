"""A finding's severities, least to most serious: one order for the rules, the CLI's --fail-on, the live log's
halt_on and the views' worst-first lists. Imports nothing, so the torch side's live check stays light."""

from __future__ import annotations

SEVERITIES = ("info", "warning", "critical")
RANK = {s: i for i, s in enumerate(SEVERITIES)}
WORST_FIRST = {s: len(SEVERITIES) - 1 - i for s, i in RANK.items()}  # sort key: critical 0, warning 1, info 2


def at_least(severity: str, threshold: str) -> bool:
    """Whether ``severity`` is ``threshold`` or worse."""
    return RANK[severity] >= RANK[threshold]
