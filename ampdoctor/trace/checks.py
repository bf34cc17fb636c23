"""What a trace file may hold: the checks a reader runs before trusting it. A trace may come from anyone (a shared
run directory, a download), so its tables, column types, ids and JSON are verified, and every problem becomes one
``Invalid`` line that the reader turns into a TraceError. Offline side: no torch."""

from __future__ import annotations

import json
import math
import numbers
import sqlite3
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import numpy.typing as npt

from . import schema


class Invalid(Exception):
    """One line saying what in the file is malformed."""


# -- tables --------------------------------------------------------------------------------------------------------
def _expected_columns() -> dict[str, list[tuple[str, str, int]]]:
    """table -> [(name, declared type, pk)] as schema.DDL lays them out (read off an in-memory database)."""
    mem = sqlite3.connect(":memory:")
    try:
        mem.executescript(schema.DDL)
        tables = [r[0] for r in mem.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        return {t: [(r[1], r[2].upper(), r[5]) for r in mem.execute(f"PRAGMA table_info({t})")] for t in tables}
    finally:
        mem.close()


EXPECTED = _expected_columns()
NUMBER = "typeof({c}) IN ('integer', 'real', 'null')"
NUMBER_OR_NAN = "(typeof({c}) IN ('integer', 'real', 'null') OR {c} IN ('nan', 'inf', '-inf'))"  # writer's NaN
INTEGER = "typeof({c}) = 'integer'"
INTEGER_OR_NULL = "typeof({c}) IN ('integer', 'null')"
TEXT = "typeof({c}) = 'text'"
TEXT_OR_NULL = "typeof({c}) IN ('text', 'null')"
# Types and ranges at once (one condition per column: the checks read every row). In SQLite a number compares
# below any text or blob, so `x BETWEEN 0 AND 9e999` holds for numbers >= 0 only (9e999 is +Inf). A NaN is NULL or
# the writer's 'nan'; +Inf is 9e999 or the writer's 'inf'.
MAX_SECONDS = 1e9  # 31 years: no duration measured in a run is longer
DURATIONS = ("step_time", "data_time", "observer_time")
LEVELS = (schema.LEVEL_SENTINEL, schema.LEVEL_PEAK, schema.LEVEL_FULL, schema.LEVEL_HIST)
STATS_COUNTS = tuple(f for f in schema.STATS_FIELDS if f not in ("absmax", "minabs", "mean", "rms"))
FLAG = "({c} IN (0, 1) OR {c} IS NULL)"
LEVEL = f"({{c}} IN ({', '.join(str(v) for v in LEVELS)}) OR {{c}} IS NULL)"
COUNT = "((typeof({c}) = 'integer' AND {c} >= 0) OR {c} IS NULL)"
WHOLE = "(({c} BETWEEN 0 AND 9e999 AND {c} = CAST({c} AS INTEGER)) OR {c} IS NULL)"  # an exact count as REAL
DURATION = f"({{c}} BETWEEN 0 AND {MAX_SECONDS:.0e} OR {{c}} IS NULL OR {{c}} = 'nan')"
FINITE = "({c} BETWEEN -1.7976931348623157e308 AND 1.7976931348623157e308 OR {c} IS NULL OR {c} = 'nan')"
NON_NEGATIVE = "({c} BETWEEN 0 AND 9e999 OR {c} IS NULL OR {c} IN ('nan', 'inf'))"
NON_NEGATIVE_NUMBER = "({c} BETWEEN 0 AND 9e999 OR {c} IS NULL)"
JSON_NUMBERS = (
    "({c} IS NULL OR (typeof({c}) = 'text' AND json_valid({c}) AND json_type({c}) = 'array' AND NOT EXISTS "
    "(SELECT 1 FROM json_each({c}) WHERE type NOT IN ('integer', 'real', 'null'))))"
)
_TYPE = "json_type({{c}}, '$.{key}')"
JSON_EVENT = (
    "({c} IS NULL OR (typeof({c}) = 'text' AND json_valid({c}) AND json_type({c}) = 'object'"  # EVENT_DATA
    " AND coalesce(" + _TYPE.format(key="value") + ", 'text') = 'text'"
    " AND coalesce(" + _TYPE.format(key="after") + ", 'null') IN ('integer', 'null')"
    " AND coalesce(" + _TYPE.format(key="count") + ", 'integer') = 'integer'"
    " AND coalesce(" + _TYPE.format(key="params") + ", 'array') = 'array'"
    " AND NOT EXISTS (SELECT 1 FROM json_each({c}, '$.params') WHERE type != 'text')))"
)

STEP_COLUMNS = {  # steps column -> (condition, what is wrong otherwise); any other column: NUMBER_OR_NAN
    "lr": (JSON_NUMBERS, "not a JSON list of numbers"),
    "reason": (TEXT_OR_NULL, "not text"),
    "skipped": (FLAG, "not 0 or 1"),
    "nonfinite": (FLAG, "not 0 or 1"),
    "level": (LEVEL, f"not a level ({', '.join(map(str, LEVELS))})"),
    **{c: (COUNT, "not a whole number >= 0") for c in ("samples", "microbatches", "peak_mem")},
    **{c: (DURATION, f"not a duration (0 to {MAX_SECONDS:.0e} s)") for c in DURATIONS},
    "time": (FINITE, "not a finite time"),
    **{c: (NON_NEGATIVE, "not a number >= 0") for c in ("samples_per_s", "loss_scale", "loss_scale_next")},
    **{c: (NON_NEGATIVE, "not a number >= 0") for c in ("grad_norm", "grad_max")},
}


# The same ranges on values already read into numpy (NaN: NULL or the writer's 'nan'), for a large file whose values
# are checked as they are read: column -> (the values it may hold, what is wrong otherwise).
def _whole(v: npt.NDArray[np.float64]) -> npt.NDArray[np.bool_]:
    ok: npt.NDArray[np.bool_] = np.isfinite(v) & (v >= 0) & (v == np.floor(v))
    return ok


_LEVEL_SET = np.array(LEVELS, dtype=np.float64)
if TYPE_CHECKING:  # (typing names past Python 3.9: for the type checker only)
    from typing import TypeAlias

    # a column's range: (the values it may hold -> which of them do, what is wrong otherwise)
    Range: TypeAlias = tuple[Callable[[npt.NDArray[np.float64]], npt.NDArray[np.bool_]], str]
STEP_RANGES: dict[str, Range] = {
    **{c: (lambda v: (v == 0) | (v == 1), STEP_COLUMNS[c][1]) for c in ("skipped", "nonfinite")},
    "level": (lambda v: np.isin(v, _LEVEL_SET), STEP_COLUMNS["level"][1]),
    **{c: (_whole, STEP_COLUMNS[c][1]) for c in ("samples", "microbatches", "peak_mem")},
    **{c: (lambda v: (v >= 0) & (v <= MAX_SECONDS), STEP_COLUMNS[c][1]) for c in DURATIONS},
    "time": (np.isfinite, STEP_COLUMNS["time"][1]),
    **{
        c: (lambda v: v >= 0, STEP_COLUMNS[c][1])
        for c in ("samples_per_s", "loss_scale", "loss_scale_next", "grad_norm", "grad_max")
    },
}
STATS_RANGES: dict[str, Range] = {
    **{c: (_whole, "not a whole number >= 0") for c in ("calls", *STATS_COUNTS)},
    **{c: (lambda v: v >= 0, "not a number >= 0") for c in ("scale", "absmax", "minabs", "rms")},
}


def check_range(table: str, column: str, values: npt.NDArray[np.float64]) -> None:
    """The values of a column read into numpy (NaN: none) are in its range (STEP_RANGES, STATS_RANGES)."""
    rule = (STEP_RANGES if table == "steps" else STATS_RANGES if table == "stats" else {}).get(column)
    if rule is None:
        return
    ok, what = rule
    with np.errstate(invalid="ignore"):
        bad = ~(np.isnan(values) | ok(values))
    if bad.any():
        v = values[np.flatnonzero(bad)[0]].item()
        raise Invalid(f"table {table}: column {column} holds {_show(int(v) if v == int(v) else v)}: {what}")


def _rules(n_sites: int, n_steps: int) -> dict[str, list[tuple[str, str, str]]]:
    """table -> [(column, SQL condition every row must meet, what is wrong otherwise)]. The writer commits a step's
    peaks, statistics and histograms with its steps row, so those name steps that exist; events and metrics may
    name the step still being written."""
    site = f"typeof({{c}}) = 'integer' AND {{c}} BETWEEN 0 AND {n_sites - 1}"
    site_or_null = f"({{c}} IS NULL OR ({site}))"
    recorded = f"typeof({{c}}) = 'integer' AND {{c}} BETWEEN 0 AND {n_steps - 1}"
    step = "typeof({c}) = 'integer' AND {c} >= 0"
    return {
        "meta": [("key", TEXT, "not text"), ("value", TEXT, "not text")],
        "sites": [
            ("path", TEXT, "not text"),
            ("module", TEXT, "not text"),
            ("kind", f"kind IN ({', '.join(repr(k) for k in schema.KINDS)})", "not a site kind"),
            ("module_type", TEXT_OR_NULL, "not text"),
            ("dtype", TEXT_OR_NULL, "not text"),
            ("shape", TEXT_OR_NULL, "not text"),
            ("first_step", COUNT, "not a step"),
        ],
        "steps": [
            (c, *(STEP_COLUMNS.get(c) or (NUMBER_OR_NAN, "not a number"))) for c in schema.STEP_FIELDS if c != "step"
        ],
        "peaks": [
            ("step", recorded, "not a recorded step"),
            ("data", "typeof(data) = 'blob' AND length(data) % 4 = 0", "not float32 values"),
        ],
        "stats": [
            ("step", recorded, "not a recorded step"),
            ("site", site, "not a site id"),
            *[(c, WHOLE, "not a whole number >= 0") for c in ("calls", *STATS_COUNTS)],
            *[(c, NON_NEGATIVE_NUMBER, "not a number >= 0") for c in ("scale", "absmax", "minabs", "rms")],
            ("mean", NUMBER, "not a number"),
        ],
        "hists": [
            ("step", recorded, "not a recorded step"),
            ("site", site, "not a site id"),
            ("lo", f"typeof(lo) = 'integer' AND lo BETWEEN {schema.HIST_LO} AND {schema.HIST_HI}", "not a binade"),
            (
                "counts",
                "typeof(counts) = 'blob' AND length(counts) % 8 = 0 AND length(counts) > 0 "
                f"AND lo + length(counts) / 8 <= {schema.HIST_HI + 1}",
                f"not int64 counts within binades {schema.HIST_LO}..{schema.HIST_HI}",
            ),
        ],
        "events": [
            ("step", step, "not a step"),
            ("kind", TEXT, "not text"),
            ("site", site_or_null, "not a site id"),
            ("phase", TEXT_OR_NULL, "not text"),
            ("message", TEXT_OR_NULL, "not text"),
            ("data", JSON_EVENT, "not a JSON object of the event fields"),
        ],
        "metrics": [
            ("step", step, "not a step"),
            ("name", TEXT, "not text"),
            ("value", NUMBER_OR_NAN, "not a number"),
            ("time", NUMBER, "not a number"),
        ],
        "probes": [
            ("step", recorded, "not a recorded step"),
            ("site", site, "not a site id"),
            *[(c, COUNT, "not a whole number >= 0") for c in ("calls", "k", "numel")],
            ("dtype", TEXT_OR_NULL, "not text"),
            *[(c, NON_NEGATIVE, "not a number >= 0") for c in schema.PROBE_FIELDS],
        ],
    }


def check_tables(conn: sqlite3.Connection, values: bool = True) -> tuple[int, int]:
    """Every table of the format is a plain table (not a view: a recursive one would hang every query) with its
    columns as declared, and the step and site ids are dense; with ``values``, every value of every table has its
    column's type and range (a scan of the whole file: the reader does it for small files, and checks the values
    of a large one as it reads them). Returns (sites, steps)."""
    for table, columns in EXPECTED.items():
        row = conn.execute("SELECT type, sql FROM sqlite_master WHERE name = ? COLLATE NOCASE", (table,)).fetchone()
        if row is None:
            if table in schema.OPTIONAL_TABLES:
                continue
            raise Invalid(f"no table {table}")
        if row[0] != "table" or str(row[1] or "").lstrip().upper().startswith("CREATE VIRTUAL"):
            raise Invalid(f"{table} is a {row[0]}, not a table")
        have = [(r[1], str(r[2]).upper(), r[5]) for r in conn.execute(f"PRAGMA table_info({table})")]
        later = schema.LATER_STEP_FIELDS if table == "steps" else ()
        missing = [c for c in columns if c not in have and c[0] not in later]  # later columns: older traces lack them
        if missing:
            raise Invalid(f"table {table}: column {missing[0][0]} missing or not declared {missing[0][1]}")
    n_sites = _dense(conn, "sites", "id")
    n_steps = _dense(conn, "steps", "step")
    check_values(conn, VALUE_TABLES if values else ("sites",), n_sites, n_steps)
    return n_sites, n_steps


VALUE_TABLES = ("meta", "sites", "steps", "peaks", "stats", "hists", "events", "metrics", "probes")


def check_values(
    conn: sqlite3.Connection, tables: Collection[str], n_sites: int, n_steps: int, after: dict[str, int] | None = None
) -> None:
    """Every value of these tables has its column's type and range (rows with a rowid above ``after[table]`` only,
    where given: the rows added since the last check of a growing trace)."""
    if "events" in tables:
        deep = f"length(data) - length(replace(replace(data, '[', ''), '{{', '')) > {MAX_DEPTH}"
        for (text,) in conn.execute(f"SELECT data FROM events WHERE typeof(data) = 'text' AND {deep}"):
            parse_json(text, "events.data")  # SQLite accepts JSON up to 1000 deep; we do not
    present = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    steps_have = {r[1] for r in conn.execute("PRAGMA table_info(steps)")}
    for table, rules in _rules(n_sites, n_steps).items():
        if table not in tables or (table in schema.OPTIONAL_TABLES and table not in present):
            continue
        if table == "steps":
            rules = [r for r in rules if r[0] in steps_have]
        where = " OR ".join(f"NOT ({cond.format(c=col)})" for col, cond, _ in rules)
        since = f"rowid > {int(after[table])} AND " if after and table in after else ""
        if conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table} WHERE {since}({where}))").fetchone()[0]:
            for col, cond, what in rules:
                bad = conn.execute(
                    f"SELECT {col} FROM {table} WHERE {since}NOT ({cond.format(c=col)}) LIMIT 1"
                ).fetchone()
                if bad is not None:
                    raise Invalid(f"table {table}: column {col} holds {_show(bad[0])}: {what}")


def _dense(conn: sqlite3.Connection, table: str, col: str) -> int:
    """Rows of a table whose integer key must run 0, 1, ... without gaps (its INTEGER PRIMARY KEY: unique)."""
    # three queries: SQLite answers a lone min() or max() of the key by one seek, and count(*) by walking the table's
    # pages without decoding its rows; all three in one query read every row (~0.2 s at 10^6 steps)
    n = conn.execute(f"SELECT count(*) FROM {table}").fetchone()[0]
    lo = conn.execute(f"SELECT min({col}) FROM {table}").fetchone()[0]
    hi = conn.execute(f"SELECT max({col}) FROM {table}").fetchone()[0]
    if n and (lo != 0 or hi != n - 1):
        raise Invalid(f"table {table}: {col} runs {lo}..{hi} over {n} rows, not 0..{n - 1}")
    return int(n)  # (count(*): an int)


def _show(v: object) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


# -- JSON ------------------------------------------------------------------------------------------------------------
MAX_DEPTH = 32  # the writer nests 3 deep; a bound keeps every later walk over a value cheap and recursion-free


def parse_json(text: object, what: str) -> Any:
    """A JSON value from the file, nesting bounded (a 200,000-deep array is refused, not parsed into a crash)."""
    if text is None:
        return None
    if not isinstance(text, str):
        raise Invalid(f"{what} is not JSON text")
    depth = 0
    brackets = text.count("[") + text.count("{")
    for ch in text if brackets > MAX_DEPTH else "":  # brackets inside strings count too: an overestimate
        if ch in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise Invalid(f"{what}: JSON nested deeper than {MAX_DEPTH}")
        elif ch in "]}":
            depth -= 1
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise Invalid(f"{what}: invalid JSON ({str(exc).splitlines()[0][:60]})") from None


# Types of the meta values the writer records; keys not listed are free (a later writer may add some).
NUM, INT, STR, BOOL = "number", "integer", "text", "true/false"
if TYPE_CHECKING:
    # What a value must be (check_value): a type name, alternatives (None: null), [item spec], {key: spec} (an
    # object) or ({key spec: value spec},) (a mapping).
    Spec: TypeAlias = str | tuple["Spec | None", ...] | list["Spec"] | dict[str, "Spec"]
RUN: dict[str, Spec] = {
    "ampdoctor": STR,
    "torch": STR,
    "python": STR,
    "host": STR,
    "pid": INT,
    "rank": INT,
    "started": NUM,
    "model": STR,
    "device": STR,
    "params": INT,
    "cpu_count": (INT, None),
    "threads": INT,
    "every": INT,
    "hist_every": INT,
    "weight_every": INT,
    "device_name": STR,
    "capability": [INT],
    "bf16_supported": BOOL,
}
CONFIG: dict[str, Spec] = {
    "autocast": {"enabled": BOOL, "dtype": (STR, None), "device_type": (STR, None)},
    "param_dtypes": ({STR: INT},),
    "module_param_dtypes": ({STR: STR},),
    "loss_dtype": (STR, None),
    "boundary": STR,
    "optimizer": {"class": STR, "groups": [{"lr": (NUM, None)}]},
    "scaler": {
        "class": STR,
        "enabled": BOOL,
        "init_scale": (NUM, None),
        "growth_factor": (NUM, None),
        "backoff_factor": (NUM, None),
        "growth_interval": (NUM, None),
    },
}
CLOSED: dict[str, Spec] = {"steps": INT, "time": NUM}
META: dict[str, Spec] = {"run": RUN, "config": CONFIG, "closed": CLOSED}
EVENT_DATA: dict[str, Spec] = {"value": STR, "after": (INT, None), "params": [STR], "count": INT}


def check_value(v: object, spec: Spec, what: str) -> None:
    """``v`` against ``spec``: a type name, a tuple of alternatives (None: null), [item spec], {key: spec} (an object;
    keys not named are free) or ({key spec: value spec},) (a mapping)."""
    if isinstance(spec, tuple) and not (len(spec) == 1 and isinstance(spec[0], dict)):
        for alt in spec:
            if alt is None and v is None:
                return
            if alt is not None:
                try:
                    check_value(v, alt, what)
                    return
                except Invalid:
                    pass
        raise Invalid(f"{what} is {_show(v)}, not {' or '.join('null' if a is None else _name(a) for a in spec)}")
    if isinstance(spec, tuple):  # ({key spec: value spec},): a mapping
        if not isinstance(v, dict):
            raise Invalid(f"{what} is {_show(v)}, not an object")
        ((_kspec, vspec),) = cast("dict[str, Spec]", spec[0]).items()
        for k, item in v.items():
            check_value(item, vspec, f"{what}[{k!r}]")
        return
    if isinstance(spec, list):
        if not isinstance(v, list):
            raise Invalid(f"{what} is {_show(v)}, not a list")
        for i, item in enumerate(v):
            check_value(item, spec[0], f"{what}[{i}]")
        return
    if isinstance(spec, dict):
        if not isinstance(v, dict):
            raise Invalid(f"{what} is {_show(v)}, not an object")
        for k, sub in spec.items():
            if k in v:
                check_value(v[k], sub, f"{what}.{k}")
        return
    ok = {
        NUM: isinstance(v, numbers.Real) and not isinstance(v, bool),
        INT: isinstance(v, int) and not isinstance(v, bool),
        STR: isinstance(v, str),
        BOOL: isinstance(v, bool),
    }[spec]
    if not ok:
        raise Invalid(f"{what} is {_show(v)}, not {_name(spec)}")


def _name(spec: Spec) -> str:
    return spec if isinstance(spec, str) else "a list" if isinstance(spec, list) else "an object"


def meta_value(key: str, text: str) -> Any:
    """One meta entry, parsed and checked; in ``config``, a scaler setting out of range is moved aside as unknown
    (``scaler_setting_problem``)."""
    v = parse_json(text, f"meta {key!r}")
    if key in META:
        check_value(v, META[key], f"meta {key}")
    if key == "config" and isinstance(v.get("scaler"), dict):
        _set_aside_invalid(v["scaler"])
    return v


# -- GradScaler settings ---------------------------------------------------------------------------------------------
INT64_MAX = 2**63 - 1  # torch's update rule takes growth_interval as an int64
SCALER_SETTINGS = {  # setting -> what it must be: what torch's update rule needs to mean anything
    "init_scale": "a positive finite number",
    "growth_factor": "a number > 1.0",  # torch asserts > 1 when the scaler is built; infinite grows nothing
    "backoff_factor": "a number in (0, 1)",  # torch asserts < 1; 0 or below would zero or flip the scale
    "growth_interval": "a positive int",  # 0 or below: torch never grows the scale (its counter never meets it)
}


def scaler_setting_problem(key: str, value: object) -> str | None:
    """What is wrong with ``value`` as the GradScaler setting ``key`` ("a number > 1.0"), or None when it is one
    the loss-scale replay can run with. One definition for the trace reader and the replay's arguments."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return SCALER_SETTINGS[key]
    if key == "growth_interval":
        if not isinstance(value, numbers.Integral) or int(value) < 1:
            return SCALER_SETTINGS[key]
        return "at most 2^63-1 (an int64)" if int(value) > INT64_MAX else None
    try:
        v = float(value)
    except OverflowError:  # an integer beyond any float (a JSON literal of 400 digits)
        return SCALER_SETTINGS[key]
    ok = {"init_scale": 0 < v < math.inf, "growth_factor": 1 < v < math.inf, "backoff_factor": 0 < v < 1}[key]
    return None if ok else SCALER_SETTINGS[key]


def _set_aside_invalid(scaler: dict[str, Any]) -> None:
    """Settings that cannot be GradScaler's go from ``scaler`` to ``scaler["invalid"]`` ({setting: value}): the
    readers of the trace then take them as unknown (torch's default where they need one) and say so."""
    invalid = {
        k: scaler.pop(k)
        for k in SCALER_SETTINGS
        if k in scaler and scaler[k] is not None and scaler_setting_problem(k, scaler[k])
    }
    if invalid:
        scaler["invalid"] = invalid


def invalid_settings_note(config: dict[str, Any]) -> str | None:
    """One line naming the scaler settings the reader set aside as unknown, or None."""
    invalid = (config.get("scaler") or {}).get("invalid") or {}
    if not invalid:
        return None
    parts = [f"{k} {v!r} (should be {scaler_setting_problem(k, v)})" for k, v in invalid.items()]
    return (
        f"GradScaler setting out of range in the trace: {', '.join(parts)}; taken as unknown, torch's default "
        "used where one is needed"
    )
