"""The trace file: schema (tables + version), writer (background thread), reader (Trace views)."""

from .reader import Trace, is_trace, load
from .schema import TraceError

__all__ = ["Trace", "TraceError", "is_trace", "load"]
