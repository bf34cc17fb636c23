"""The step's one device-to-host copy. On the CPU the values are read at once (no device to wait for); on an
accelerator the copy is asynchronous: into pinned host memory, behind a CUDA event, read at a later step end when
the event says it is done, so that a clean step never waits for the device (a host sync would stall the launch
queue of a loop that otherwise never syncs). What depends on the values (the verdict, the flight recorder, the
anomaly replay) is decided then, one or two steps late; flights.py keeps what a late decision needs."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

# Tests run the accelerator path on the CPU (stats.HOST_READS = False); this makes such a transfer report "not
# ready" for this many checks, so that the late decisions are exercised there too.
EMULATED_LAG = 0
# A reader of the copied values holds this while it reads a finished transfer's host memory: such a read never
# waits for the device (the tests that count blocking reads leave it out).
READING = [False]


@contextlib.contextmanager
def reading() -> Iterator[None]:
    READING[0] = True
    try:
        yield
    finally:
        READING[0] = False


class Transfer:
    """Values on their way to the host: ``ready()`` without waiting, ``values()`` (waits only if not ready)."""

    def __init__(self, flat: torch.Tensor) -> None:
        self._event = None
        self._lag = 0
        if flat.device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # (unannotated in torch)
            self._event.record()
            self._host = host
        elif flat.device.type == "cpu":  # the accelerator path run on the CPU (tests)
            self._host = flat
            self._lag = EMULATED_LAG
        else:  # another accelerator: a plain copy (it waits), until it gets its own event
            self._host = flat.cpu()

    def ready(self) -> bool:
        if self._event is not None:
            return bool(self._event.query())  # type: ignore[no-untyped-call]  # (unannotated in torch)
        if self._lag > 0:
            self._lag -= 1
            return False
        return True

    def values(self) -> np.ndarray:
        if self._event is not None:
            self._event.synchronize()  # (returns at once when ready() said so)
        with reading():
            return self._host.numpy()


class Ready:
    """Values already on the host (the CPU path)."""

    def __init__(self, values: np.ndarray) -> None:
        self._values = values

    def ready(self) -> bool:
        return True

    def values(self) -> np.ndarray:
        return self._values
