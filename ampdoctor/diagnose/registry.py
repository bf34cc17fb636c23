"""The one table of rules: stable id -> check function. Disable or re-threshold a rule by id:
``ampdoctor.diagnose(path, rules={"grad-underflow": {"min_share": 0.05}, "amp-inactive": None})``."""
from __future__ import annotations

from . import overflow, scaling
from .engine import Rule

RULES = {r.id: r for r in (
    Rule("init-scale-too-high", scaling.init_scale_too_high, "NaN/skipped steps early: the initial loss scale"),
    Rule("forward-overflow", overflow.forward_overflow, "a module produced Inf/NaN in the forward pass"),
    Rule("loss-scale-collapse", scaling.loss_scale_collapse, "the loss scale falls without recovery"),
)}
