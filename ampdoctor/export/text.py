"""A finding as the text an exporter writes (Markdown: TensorBoard's text plugin, W&B and MLflow render it), and its
key for "reported once". Reads a Diagnosis by its fields only: no import of the rules."""

from __future__ import annotations


def key(d) -> tuple:
    """A finding is reported once per rule and culprit (as the live diagnosis does)."""
    return (d.rule, tuple(d.layers[:1]), tuple(d.ranks))


def step_span(d) -> str:
    steps = list(d.steps or [])
    if not steps:
        return ""
    return f"step {steps[0]}" if len(steps) == 1 or steps[-1] == steps[0] else f"steps {steps[0]}-{steps[-1]}"


def headline(d) -> str:
    """One line: severity, rule id, first layer, title."""
    layer = f" [{d.layers[0]}]" if d.layers else ""
    return f"{d.severity.upper()} {d.rule}{layer}: {d.title}"


def fix_text(d) -> str:
    """The fix as Markdown: text parts as paragraphs, code parts fenced (they run as printed)."""
    out = []
    for part in d.fix or []:
        if getattr(part, "kind", "text") == "code":
            out.append(f"```python\n{part.text}\n```")
        else:
            out.append(part.text)
    return "\n\n".join(out) or (d.recommendation or "")


def markdown(d) -> str:
    """The whole finding: headline, summary, where, evidence, fix."""
    where = ", ".join(
        x
        for x in (
            ("layers: " + ", ".join(map(str, d.layers[:8])) + (" ..." if len(d.layers) > 8 else ""))
            if d.layers
            else "",
            step_span(d),
            ("ranks: " + ", ".join(map(str, d.ranks))) if d.ranks else "",
        )
        if x
    )
    evidence = ", ".join(f"{k}={_short(v)}" for k, v in (d.evidence or {}).items())
    parts = [f"**{headline(d)}**", d.summary]
    if where:
        parts.append(where)
    if evidence:
        parts.append(f"evidence: {evidence}")
    fix = fix_text(d)
    if fix:
        parts.append("fix:\n\n" + fix)
    return "\n\n".join(p for p in parts if p)


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    s = str(v)
    return s if len(s) <= 80 else s[:77] + "..."
