"""Callbacks that attach ampdoctor inside training frameworks, one module per framework.

Each module imports its framework when it is itself imported (``import ampdoctor`` imports none of them):
``ampdoctor.integrations.transformers`` (pip install "ampdoctor[transformers]") and
``ampdoctor.integrations.lightning`` (pip install "ampdoctor[lightning]").
"""
