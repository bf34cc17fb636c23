import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scenarios"))  # fault_runs

import fault_runs as F


@pytest.fixture(scope="session")
def traces(tmp_path_factory):
    """Small real traces shared by the engine and CLI tests: a healthy FP16 run and two faulty ones."""
    d = tmp_path_factory.mktemp("diag")
    out = {"healthy": str(d / "healthy.db"), "init": str(d / "init.db"), "inactive": str(d / "inactive.db")}
    F.fit(F.mlp(), F.regression(30), 30, out["healthy"])
    F.fit(F.mlp(), F.regression(30), 30, out["init"], init_scale=2.0**30)
    F.fit(F.mlp(), F.regression(20), 20, out["inactive"], precision="fp32", scaler=True)
    return out
