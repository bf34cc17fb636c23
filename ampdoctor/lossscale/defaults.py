"""torch.amp.GradScaler's default settings and the type of a setting dict, shared by the evidence (a run without a
recorded scaler) and the scaler model (what a setting left out means) without either importing the other."""

from __future__ import annotations

# init_scale, growth_factor, backoff_factor (floats) and growth_interval (an int, as GradScaler takes it)
Settings = dict[str, float]

# torch.amp.GradScaler defaults: what a run without a recorded scaler is replayed with
TORCH_DEFAULTS: Settings = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}
