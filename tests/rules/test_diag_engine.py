"""The engine: Diagnosis fields, the registry, overrides by id, ordering, evidence-or-nothing."""

import dataclasses
import json

import pytest

import ampdoctor
from ampdoctor.rules import RULES, Diagnosis, registry
from ampdoctor.rules.result import Rule, finding

FIELDS = ["rule", "severity", "title", "summary", "layers", "steps", "evidence", "recommendation", "ranks", "fix"]


def test_diagnosis_fields_as_in_the_issue():
    assert [f.name for f in dataclasses.fields(Diagnosis)] == FIELDS
    assert ampdoctor.Diagnosis is Diagnosis


def test_every_rule_has_named_thresholds_and_an_id_in_kebab_case():
    for rid, rule in RULES.items():
        assert rid == rule.id and rid == rid.lower() and " " not in rid
        for name, default in rule.thresholds.items():
            assert isinstance(default, (int, float)), (rid, name)


def test_finding_on_a_real_fault(traces):
    found = ampdoctor.diagnose(traces["init"])
    assert [d.rule for d in found] == ["init-scale-too-high"]
    d = found[0]
    assert d.severity == "warning" and d.steps[0] == 0 and d.steps[0] <= d.steps[1]
    assert d.evidence["suggested_init_scale"] < d.evidence["init_scale"]
    assert 'GradScaler("cpu", init_scale=' in d.recommendation
    json.dumps(d.to_dict())  # JSON-safe


def test_accepts_a_trace_object(traces):
    with ampdoctor.load(traces["init"]) as tr:
        assert [d.rule for d in ampdoctor.diagnose(tr)] == ["init-scale-too-high"]


def test_disable_by_id_and_rethreshold(traces):
    assert ampdoctor.diagnose(traces["init"], rules={"init-scale-too-high": None}) == []
    assert ampdoctor.diagnose(traces["init"], rules={"init-scale-too-high": {"min_skips": 100}}) == []
    assert len(ampdoctor.diagnose(traces["init"], rules={"init-scale-too-high": {"min_skips": 3}})) == 1


@pytest.mark.parametrize(
    "rules, error, text",
    [
        ({"no-such-rule": None}, ValueError, "Unknown rule id 'no-such-rule'"),
        ({"grad-underflow": {"min_sahre": 0.1}}, ValueError, "has no threshold 'min_sahre'"),
        ({"grad-underflow": 0.1}, TypeError, "should be a dict of thresholds or None"),
        (["grad-underflow"], TypeError, "Argument rules should be of type dict"),
    ],
)
def test_bad_rule_overrides_fail_loudly(traces, rules, error, text):
    with pytest.raises(error, match=text):
        ampdoctor.diagnose(traces["healthy"], rules=rules)


def test_bad_inputs(tmp_path):
    with pytest.raises(ampdoctor.TraceError, match="no such file"):
        ampdoctor.diagnose(str(tmp_path / "missing.db"))
    with pytest.raises(TypeError, match="Argument trace_or_path should be"):
        ampdoctor.diagnose(42)


def test_worst_first_and_no_evidence_no_finding(traces, monkeypatch):
    def info(run):
        return finding("info", "i", "s", evidence={"x": 1})

    def crit(run):
        return [finding("critical", "c", "s", evidence={"x": 1}), finding("critical", "bare", "s")]

    fake = {"a-info": Rule("a-info", info, ""), "b-crit": Rule("b-crit", crit, "")}
    monkeypatch.setattr(registry, "RULES", fake)
    found = ampdoctor.diagnose(traces["healthy"])
    assert [(d.rule, d.title) for d in found] == [("b-crit", "c"), ("a-info", "i")]


def test_healthy_trace_is_quiet(traces):
    assert ampdoctor.diagnose(traces["healthy"]) == []


def test_default_cadence_still_finds_and_stays_quiet(tmp_path):
    import fault_runs as F

    sparse = {"every": 100, "hist_every": 200, "weight_every": 200}
    ok, bad = str(tmp_path / "ok.db"), str(tmp_path / "bad.db")
    F.fit(F.mlp(), F.regression(30), 30, ok, attach_options=sparse)
    F.fit(F.mlp(), F.regression(30), 30, bad, init_scale=2.0**30, attach_options=sparse)
    assert ampdoctor.diagnose(ok) == []
    assert [d.rule for d in ampdoctor.diagnose(bad)] == ["init-scale-too-high"]


def test_loop_without_optimizer_or_scaler(tmp_path):
    import fault_runs as F
    import torch

    path = str(tmp_path / "manual.db")
    model = F.mlp()
    with ampdoctor.attach(model, trace=path) as doc:
        for x, y in F.regression(10):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.mse(model(x), y)
            loss.backward()
            doc.log_loss(loss)
            doc.step()
    assert ampdoctor.diagnose(path) == []


def test_trace_without_steps_is_an_error_not_a_clean_bill(tmp_path):
    import fault_runs as F

    path = str(tmp_path / "empty.db")
    ampdoctor.attach(F.mlp(), trace=path).close()
    with pytest.raises(ampdoctor.TraceError, match="no steps recorded"):
        ampdoctor.diagnose(path)


def test_suppression_is_declared_and_disabling_hides_only_that_rule(traces, monkeypatch):
    """cause suppresses symptom (declared on the registry entry); partial only when its finding says so. Disabling
    cause hides cause's findings only: it is still computed, so symptom stays hidden; a symptom rule that is hidden
    whatever it finds is not even run for display."""
    from ampdoctor.rules.result import suppressed_by

    ran = []

    def cause(run):
        return finding("critical", "cause", "s", evidence={"x": 1})

    def symptom(run):
        ran.append("symptom")
        return finding("critical", "symptom", "s", evidence={"x": 1})

    def partial(run):
        return [
            finding("warning", "kept", "s", evidence={"keep": True}),
            finding("warning", "hidden", "s", evidence={"keep": False}),
        ]

    fake = {
        "cause": Rule("cause", cause, ""),
        "symptom": Rule("symptom", symptom, "", suppressed_by=suppressed_by("cause")),
        "partial": Rule(
            "partial", partial, "", suppressed_by=suppressed_by("cause", when=lambda own, c: not own.evidence["keep"])
        ),
    }
    monkeypatch.setattr(registry, "RULES", fake)
    assert [d.title for d in ampdoctor.diagnose(traces["healthy"])] == ["cause", "kept"]
    assert ran == []  # hidden whatever it would find: not computed for display
    assert [d.title for d in ampdoctor.diagnose(traces["healthy"], rules={"cause": None})] == ["kept"]
    from ampdoctor.rules.engine import Run

    run = Run(ampdoctor.load(traces["healthy"]), rules={"cause": None})
    assert [d.title for d in run.findings_of("symptom")] == ["symptom"]  # computed when asked: it is there, hidden
