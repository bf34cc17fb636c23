import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # tests/runs.py


@pytest.fixture
def trace_path(tmp_path):
    return str(tmp_path / "run.db")
