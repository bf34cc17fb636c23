"""What the framework callbacks share: numbers out of metric dicts, the default trace path, the environment
switch, and the exporter that writes into the framework's own loggers from the training thread."""

from __future__ import annotations

import logging
import math
import numbers
import os
import warnings
from dataclasses import dataclass

from . import env as E

DEFAULT_NAME = "ampdoctor.db"
log = logging.getLogger("ampdoctor")


def numeric_items(metrics) -> list[tuple[str, float]]:
    """(name, value) of the entries that are one real number (floats, ints, one-element tensors); others skipped."""
    out = []
    for name, value in (metrics or {}).items():
        if hasattr(value, "numel") and hasattr(value, "item"):
            if value.numel() != 1:
                continue
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            out.append((str(name), float(value)))
    return out


def trace_path(trace, folder) -> str:
    """The trace the user asked for, else ``ampdoctor.db`` in the framework's output folder."""
    if trace is not None:
        return trace
    return os.path.join(folder or "runs", DEFAULT_NAME)


class MetricLog:
    """Sends a metric to the Doctor when its value changes: frameworks hand out the same dict of latest values
    again and again between two reports (a new report of exactly the same float is taken for a repeat)."""

    def __init__(self):
        self._last: dict[str, object] = {}

    def send(self, doctor, metrics) -> None:
        for name, value in numeric_items(metrics):
            key = value if not math.isnan(value) else "nan"
            if self._last.get(name, None) != key:
                self._last[name] = key
                doctor.log_metric(name, value)


@dataclass
class Plan:
    """What a callback does this run, code and environment together (the environment wins)."""

    trace: str | None
    options: dict
    export: object  # "loggers", None, or what attach(export=...) takes
    export_every: int | None


def plan(trace, options: dict, export, export_every) -> Plan | None:
    """The callback's settings with the AMPDOCTOR_* variables over them; None when ``AMPDOCTOR`` is off."""
    env = E.read()
    if env.switch is False:
        return None
    export = env.export if env.export is not None else export
    if export is False or export == "none":
        export = None
    return Plan(
        trace=env.trace or trace,
        options={**options, **env.options},
        export=export,
        export_every=env.export_every or export_every,
    )


class LoggerExport:
    """An Exporter over the framework's own loggers, polled on the training thread at the framework's log events
    (their writers are not made for other threads). Any failure warns once and stops it; training goes on."""

    def __init__(self, doctor, sinks: list, every: int):
        from ..export import Exporter

        self.every = every
        self.exporter = Exporter(doctor.path, sinks, findings=lambda: doctor.findings, rules=doctor_rules(doctor))
        self._failed = False

    def poll(self) -> None:
        self._guard(self.exporter.poll)

    def close(self) -> None:
        if not self._failed:
            self._guard(self.exporter.close)

    def _guard(self, fn) -> None:
        if self._failed:
            return
        try:
            fn()
        except Exception as exc:
            self._failed = True
            warnings.warn(
                f"ampdoctor: export to the loggers stopped ({type(exc).__name__}: {exc}); training continues",
                RuntimeWarning,
                stacklevel=3,
            )


def doctor_rules(doctor):
    options = getattr(doctor, "options", None)
    return getattr(options, "rules", None)


def halt_line(finding, how: str) -> str:
    layer = f" in {finding.layers[0]}" if finding.layers else ""
    return f"ampdoctor: halting training ({how}): {finding.severity} {finding.rule}{layer}: {finding.summary}"
