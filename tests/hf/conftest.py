import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))   # hf_runs

import hf_runs as R  # noqa: E402

import ampdoctor  # noqa: E402


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hf")


def run(tmp, tag, model_name, **kw):
    """Train and return (trace path, losses); a new file per tag."""
    path = str(tmp / f"{tag}.db")
    losses, *_ = R.train(model_name, path, **kw)
    return path, losses


def serious(path, **kw):
    return [d for d in ampdoctor.diagnose(path, **kw) if d.severity != "info"]
