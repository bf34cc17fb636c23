"""The only part of ampdoctor that runs inside training and imports torch."""
from .session import Doctor, attach

__all__ = ["Doctor", "attach"]
