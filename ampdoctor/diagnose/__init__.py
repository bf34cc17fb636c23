"""Rules over a trace: what is wrong with a mixed-precision run, which layer, the evidence, and the fix."""
from .engine import SEVERITIES, Diagnosis, Rule, Run, diagnose
from .registry import RULES

__all__ = ["diagnose", "Diagnosis", "Rule", "Run", "RULES", "SEVERITIES"]
