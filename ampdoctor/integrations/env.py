"""The no-code switch: ``AMPDOCTOR=1`` and the ``AMPDOCTOR_*`` variables, read by ``ampdoctor.auto()`` and the
Trainer and Lightning callbacks. The environment overrides what the code says, so a job is reconfigured without
editing it. A value that is not valid is one warning line naming the variable and what it accepts; that variable is
ignored (``AMPDOCTOR`` itself: ampdoctor stays off), training goes on. No torch import here.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..severity import SEVERITIES

ON = ("1", "true", "yes", "on")
OFF = ("0", "false", "no", "off", "")
MODES = ("default", "debug")

# name -> what it sets (the docs' table; tests/integrations/test_int_env.py checks the docs list every one)
VARIABLES = {
    "AMPDOCTOR": "1 / true / on: observe this run; 0 / false / off: do not, even where the code attaches a callback",
    "AMPDOCTOR_TRACE": "the trace file (default: runs/ampdoctor.db, or the framework's output folder)",
    "AMPDOCTOR_MODE": "default or debug",
    "AMPDOCTOR_EVERY": "full statistics every N steps",
    "AMPDOCTOR_HALT_ON": "info, warning or critical: stop training at a finding this severe (none: never)",
    "AMPDOCTOR_LOG_EVERY": "a one-line health summary every N steps",
    "AMPDOCTOR_LIVE": "0 to switch the live diagnosis off",
    "AMPDOCTOR_EXPORT": "exporters: 'tensorboard[:DIR]', 'wandb[:PROJECT]', 'mlflow[:EXPERIMENT]', 'csv[:DIR]', "
    "'parquet[:DIR]' (comma-separated); in the callbacks also 'loggers' (the default) or 'none'",
    "AMPDOCTOR_EXPORT_EVERY": "export the figures every N steps (and every skipped or non-finite step)",
}


@dataclass(frozen=True)
class Env:
    """What the environment asks for. ``switch``: True / False, None when AMPDOCTOR is not set."""

    switch: bool | None = None
    trace: str | None = None
    options: dict = field(default_factory=dict)  # attach() options
    export: str | None = None  # a spec, "loggers" or "none"
    export_every: int | None = None


def _warn(name: str, value: str, accepts: str, then: str = "ignored") -> None:
    warnings.warn(f"ampdoctor: {name}={value!r} is not valid ({accepts}); {then}", RuntimeWarning, stacklevel=4)


def _quiet(name: str, value: str, accepts: str, then: str = "ignored") -> None:
    pass


def _positive(name: str, value: str, warn=_warn) -> int | None:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        warn(name, value, "a positive integer")
        return None
    return n


def read(environ: Mapping[str, str] | None = None, quiet: bool = False) -> Env:
    """The AMPDOCTOR variables of ``environ`` (default ``os.environ``), each checked (``quiet``: without the
    warnings, for a look that is repeated later)."""
    return _read(os.environ if environ is None else environ, _quiet if quiet else _warn)


def _read(env: Mapping[str, str], warn) -> Env:
    raw = env.get("AMPDOCTOR")
    switch = None
    if raw is not None:
        v = raw.strip().lower()
        if v in ON:
            switch = True
        elif v in OFF:
            switch = False
        else:
            warn("AMPDOCTOR", raw, f"one of {', '.join(ON + OFF[:-1])}", "ampdoctor stays off")
            switch = False
    options: dict = {}
    mode = env.get("AMPDOCTOR_MODE")
    if mode is not None:
        if mode.strip().lower() in MODES:
            options["mode"] = mode.strip().lower()
        else:
            warn("AMPDOCTOR_MODE", mode, "default or debug")
    for name, key in (("AMPDOCTOR_EVERY", "every"), ("AMPDOCTOR_LOG_EVERY", "log_every")):
        if env.get(name) is not None:
            n = _positive(name, env[name], warn)
            if n is not None:
                options[key] = n
    halt = env.get("AMPDOCTOR_HALT_ON")
    if halt is not None:
        h = halt.strip().lower()
        if h in SEVERITIES:
            options["halt_on"] = h
        elif h in ("none", ""):
            options["halt_on"] = None
        else:
            warn("AMPDOCTOR_HALT_ON", halt, f"one of {', '.join(SEVERITIES)} or none")
    live = env.get("AMPDOCTOR_LIVE")
    if live is not None:
        v = live.strip().lower()
        if v in ON or v in OFF[:-1]:
            options["live"] = v in ON
        else:
            warn("AMPDOCTOR_LIVE", live, "1 or 0")
    export = env.get("AMPDOCTOR_EXPORT")
    if export is not None:
        export = export.strip()
        if export.lower() in ("loggers", "none", ""):
            export = export.lower() or "none"
        else:
            from ..export.spec import parse

            try:
                parse(export)
            except ValueError:
                warn("AMPDOCTOR_EXPORT", export, VARIABLES["AMPDOCTOR_EXPORT"])
                export = None
    every = (
        _positive("AMPDOCTOR_EXPORT_EVERY", env["AMPDOCTOR_EXPORT_EVERY"], warn)
        if "AMPDOCTOR_EXPORT_EVERY" in env
        else None
    )
    trace = env.get("AMPDOCTOR_TRACE") or None
    return Env(switch, trace, options, export, every)


def export_option(export, every: int | None):
    """``export`` as attach() takes it, ``every`` applied to the string specs (None: nothing to export)."""
    if export is None or export is False or export == "none":
        return None
    if every is None:
        return export
    from ..export import spec as S

    items = list(export) if isinstance(export, (list, tuple)) else [export]
    return [S.Spec(i, every) if isinstance(i, str) else i for i in items]


class NoDoctor:
    """What ``ampdoctor.auto()`` returns when ampdoctor is off: the Doctor's public methods, doing nothing, so the
    script runs unchanged either way."""

    path = None
    n_steps = 0
    active = False
    boundary = None
    scaler_enabled = False
    mode = None
    options = None
    live = None

    @property
    def findings(self) -> list:
        return []

    def log_batch_ids(self, ids) -> None:
        pass

    def fail(self, exc: BaseException) -> None:
        pass

    def log_loss(self, loss) -> None:
        pass

    def log_metric(self, name: str, value, step: int | None = None) -> None:
        pass

    def begin_batch(self, batch=None) -> None:
        pass

    def step(self) -> None:
        pass

    def flush(self, timeout: float = 30.0) -> bool:
        return False

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False

    def __repr__(self) -> str:
        return "NoDoctor(ampdoctor is off: set AMPDOCTOR=1 to observe this run)"


def auto(model, optimizer=None, scaler=None, **options):
    """``attach(model, ...)`` when ``AMPDOCTOR=1``, with the AMPDOCTOR_* variables over ``options``; else a
    NoDoctor that does nothing."""
    env = read()
    if not env.switch:
        return NoDoctor()
    from .. import attach

    merged = {**options, **env.options}
    trace = env.trace or merged.pop("trace", None) or "runs/ampdoctor.db"
    merged.pop("trace", None)
    export = env.export if env.export is not None else merged.pop("export", None)
    merged.pop("export", None)
    if export == "loggers":
        export = None  # a plain loop has no framework loggers
    export = export_option(export, env.export_every)
    if export is not None:
        merged["export"] = export
    return attach(model, optimizer=optimizer, scaler=scaler, trace=trace, **merged)
