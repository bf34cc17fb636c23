"""What the framework callbacks share: numbers out of metric dicts, the default trace path."""

from __future__ import annotations

import math
import numbers
import os

DEFAULT_NAME = "ampdoctor.db"


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
