"""Loss-scale replay: simulate PyTorch's dynamic loss scaler (GradScaler) over the gradients a trace recorded.

Offline side: reads a trace, never imports torch. evidence.py reads what each step says (gradient peaks, overflows,
histograms; the overflow model: ``gather``, once per trace content whatever the settings), scaler.py steps
GradScaler's update rule over it (the Replay, underflow at a scale; machine.py and stepper.py do the stepping),
search.py replays one setting or searches for the best (``suggest``); defaults.py holds torch's GradScaler defaults.
"""

from .defaults import TORCH_DEFAULTS
from .evidence import Evidence, GradientPeaks, gather, gradient_peaks
from .scaler import Replay, gradscaler_code
from .search import Suggestion, replay, suggest

__all__ = [
    "TORCH_DEFAULTS",
    "Evidence",
    "GradientPeaks",
    "Replay",
    "Suggestion",
    "gather",
    "gradient_peaks",
    "gradscaler_code",
    "replay",
    "suggest",
]
