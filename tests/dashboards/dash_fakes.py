"""Diagnosis-like findings for rendering tests when ampdoctor.diagnose is not installed."""
from dataclasses import dataclass, field


@dataclass
class FakeDiagnosis:
    rule: str = "scale.overflow_skips"
    severity: str = "critical"
    title: str = "The loss scale starts too high: the first steps overflow and are skipped"
    summary: str = "10 of the first 10 steps were skipped with inf gradients."
    layers: list = field(default_factory=lambda: ["6"])
    steps: tuple = (0, 9)
    evidence: dict = field(default_factory=lambda: {"skipped": 10, "init_scale": 16777216.0, "first_inf": "6"})
    recommendation: str = ("Start from the PyTorch default scale:\n```python\n"
                           "scaler = torch.amp.GradScaler('cuda', init_scale=2.0**16)\n```\n")


def fake_diagnose(trace, reference=None):
    return [FakeDiagnosis(), FakeDiagnosis(rule="info.example", severity="info", title="An informational note",
                                           layers=[], evidence={}, recommendation="Nothing to do.")]
