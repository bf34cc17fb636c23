"""Writes tests/data/v1-fp16-run.db and .json: a real FP16 + GradScaler run (an MLP with LayerNorm, an initial scale
of 2^24 that skips its first steps) traced by this version's writer (trace format 1), and what reading it gives. Run
once, from the repository root: .venv/bin/python tests/data/make_v1.py. The files are kept, not remade: a later
version must still read them (tests/test_trace_scale.py)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/runs.py

from runs import mlp, train  # noqa: E402

import ampdoctor  # noqa: E402

path = os.path.join(HERE, "v1-fp16-run.db")
train(
    mlp(width=32, depth=2, norm=True),
    40,
    init_scale=2.0**24,
    trace=path,
    attach_options={"every": 5, "hist_every": 10, "live": False},
)
tr = ampdoctor.load(path)
found = ampdoctor.diagnose(tr)
with open(os.path.join(HERE, "v1-fp16-run.json"), "w") as f:
    json.dump(
        {
            "steps": tr.n_steps,
            "sites": len(tr.sites()),
            "format": ampdoctor.trace.schema.VERSION,
            "findings": [[d.rule, d.severity, list(d.layers)] for d in found],
        },
        f,
        indent=1,
    )
print(path, os.path.getsize(path), [d.rule for d in found])
