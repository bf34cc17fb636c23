"""Rules over a trace (issue: diagnosis)."""
