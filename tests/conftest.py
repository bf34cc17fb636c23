import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/runs.py

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one compute thread each (and in the processes they start), set
    # before torch is imported, so that they do not fight over the cores.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")


@pytest.fixture
def trace_path(tmp_path):
    return str(tmp_path / "run.db")
