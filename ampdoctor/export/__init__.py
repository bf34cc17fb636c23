"""Exporters: a trace's health figures and findings into TensorBoard, Weights & Biases, MLflow, CSV or Parquet.

Live (``attach(..., export="tensorboard:runs/tb")``, the Trainer and Lightning callbacks) and after the fact
(``ampdoctor export TRACE --to ...``) share one path: an ``Exporter`` reads the trace's new rows (a read-only
connection, only the rows since the last read) and writes them to its sinks. Offline side: no torch import.

    from ampdoctor.export import TensorBoard, WandB
    doctor = ampdoctor.attach(model, optimizer=opt, export=[TensorBoard("runs/tb", every=50), WandB()])
"""

from __future__ import annotations

from .exporter import Exporter, LiveExport
from .rows import FIGURES, NAMES, Point, StepRows
from .sinks import CSV, PREFIX, ExportError, MLflow, Parquet, Sink, TensorBoard, WandB
from .spec import KINDS, Spec, default_folder, make_sinks, parse


def start(export, trace: str, findings=None, rules: dict | None = None) -> LiveExport:
    """What ``attach(export=...)`` runs: the sinks made now (errors raise here), then a thread that polls the trace
    while training writes it. ``close()`` it after the trace's writer closed: the last steps and findings follow."""
    live = LiveExport(Exporter(trace, make_sinks(export, trace), findings=findings, rules=rules))
    live.start()
    return live


__all__ = [
    "CSV",
    "FIGURES",
    "KINDS",
    "NAMES",
    "PREFIX",
    "ExportError",
    "Exporter",
    "LiveExport",
    "MLflow",
    "Parquet",
    "Point",
    "Sink",
    "Spec",
    "StepRows",
    "TensorBoard",
    "WandB",
    "default_folder",
    "make_sinks",
    "parse",
    "start",
]
