"""The trace file: schema (tables + version), writer (background thread), reader (Trace views)."""
from .reader import Trace, load
from .schema import TraceError

__all__ = ["Trace", "TraceError", "load"]
