import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # hf_runs


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")
