import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # script.py


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """One directory per test module: the reproductions share their traced runs between tests."""
    return tmp_path_factory.mktemp("reported")
