"""docs/rules.md documents every registered rule: a section, a table row, and each threshold by name."""

import os
import re

import pytest

from ampdoctor.rules import RULES

DOC = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "rules.md"), encoding="utf-8").read()


def _section(rid):
    m = re.search(rf"^## {re.escape(rid)}\n(.*?)(?=^## |\Z)", DOC, re.S | re.M)
    return m.group(1) if m else None


@pytest.mark.parametrize("rid", list(RULES))
def test_rule_is_documented(rid):
    body = _section(rid)
    assert body is not None, f"docs/rules.md has no section '## {rid}'"
    for part in ("**Symptom.**", "**Cause.**", "**Evidence.**", "**Fix.**"):
        assert part in body, (rid, part)
    assert f"| `{rid}` |" in DOC
    for name in RULES[rid].thresholds:
        assert f"`{name}`" in body, (rid, name)


def test_no_section_for_an_unknown_rule():
    assert set(re.findall(r"^## (\S+)$", DOC, re.M)) == set(RULES)
