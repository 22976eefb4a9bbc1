"""Sampling settings: the keys a run (its defaults) and a row (its ``sampling`` column) may set, checked once.

:data:`KEYS` holds the settings a row may set, each with its range, as their declarations give them
(``option(row=...)`` in :mod:`daskgen.run_options`).  The run's values (config and flags) are the defaults;
a row's ``sampling: {...}`` overrides them for that row.
:func:`setting_errors` checks a mapping against the table (at input scan for rows, at config load for
the run, before any engine starts); :class:`RowSamplingCheck` is the per-row check the input scan
calls; :func:`daskgen.worker.samples.row_sampling.row_params` turns a row's settings into the params of its samples.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Mapping
from typing import Any

from daskgen.declare import off_values, row_ranges
from daskgen.ranges import MAX_STOPS, Range, is_integer
from daskgen.run_options import RunOptions

#: Every sampling key a row may set (and the run sets for every row), with its type and valid range.
KEYS: dict[str, Range] = row_ranges(RunOptions)
#: The settings with an off value: any other value asks the engine for per-row sampling.
OFF: dict[str, Any] = off_values(RunOptions)
#: The keys that end a sample early (the ``stop`` feature of the engines).
STOP_KEYS = ("stop", "stop_token_ids")


def setting_errors(settings: Any, max_new_tokens: int, where: str) -> list[str]:
    """Every problem of ``settings`` (a mapping of :data:`KEYS`), each naming ``where``, the key, the value
    found, the range expected and the fix.

    ``max_new_tokens`` is the run's limit (the store's response width), which a row may lower only.
    """
    if not isinstance(settings, Mapping):
        return [
            f'{where}: expected a mapping of sampling settings such as {{"temperature": 0.7}}, found '
            f"{type(settings).__name__} {reprlib.repr(settings)}; give an object of keys {sorted(KEYS)}, or leave "
            "it out (null) for the run's settings"
        ]
    errors = []
    for key, value in settings.items():
        spec = KEYS.get(key)
        if spec is None:
            errors.append(f"{where}: unknown sampling key {key!r}; valid keys are {sorted(KEYS)}. Rename or remove it")
        elif value is not None and not spec.valid(_normalized(key, value)):
            errors.append(
                f"{where}: key {key!r} is {_found(value)}; it must be {spec.text}. Give a value in that range, or "
                "remove the key"
            )
    errors += _limit_errors(settings, max_new_tokens, where)
    return errors


def _found(value: Any) -> str:
    """``value`` as a message shows it: a short repr, with what makes it wrong when that is not plain to see."""
    text = reprlib.repr(value)
    if isinstance(value, bool):
        return f"{text} (a boolean, not a number)"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{text} (not a finite number)"
    if isinstance(value, (list, tuple)) and len(value) > MAX_STOPS:
        return f"{text} ({len(value)} entries)"
    if isinstance(value, (list, tuple)) and len(set(map(repr, value))) < len(value):
        return f"{text} (with repeated entries)"
    if isinstance(value, (list, tuple)) and any(isinstance(v, bool) for v in value):
        return f"{text} (holding a boolean)"
    return text if isinstance(value, (int, float, str, list, tuple)) else f"{type(value).__name__} {text}"


def _limit_errors(settings: Mapping[str, Any], max_new_tokens: int, where: str) -> list[str]:
    """The token limits against each other and against the run's ``max_new_tokens``."""
    limit, floor = settings.get("max_new_tokens"), settings.get("min_new_tokens")
    errors = []
    if is_integer(limit) and limit > max_new_tokens:
        errors.append(
            f"{where}: key 'max_new_tokens' is {limit}, more than the run's max_new_tokens={max_new_tokens} (the "
            "store's response width); lower it, or raise the run's max_new_tokens"
        )
    own = limit if is_integer(limit) and 1 <= limit <= max_new_tokens else None  # a row's valid limit, else the run's
    bound = max_new_tokens if own is None else own
    if is_integer(floor) and floor > bound:
        limit_name = "the run's max_new_tokens" if own is None else "max_new_tokens"
        errors.append(
            f"{where}: key 'min_new_tokens' is {floor}, more than {limit_name}={bound}; it must be at most "
            f"{bound}: lower min_new_tokens, or raise {limit_name}"
        )
    return errors


def _normalized(key: str, value: Any) -> Any:
    """A single stop string is a list of one; ints are numbers too."""
    if key == "stop" and isinstance(value, str):
        return [value]
    if KEYS[key].kind == "float" and is_integer(value):
        return float(value)
    return value


def normalized(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Checked ``settings`` in canonical form (``None`` values dropped, a stop string as a list of one)."""
    return {k: _normalized(k, v) for k, v in settings.items() if v is not None}


def canonical_json(settings: Mapping[str, Any]) -> str:
    """The stored text of a row's settings: sorted JSON ("" for none)."""
    return json.dumps(normalized(settings), sort_keys=True, ensure_ascii=False) if settings else ""


class RowSamplingCheck:
    """The input scan's check of each row's ``sampling`` column; it also records which keys the rows set.

    ``engine_ranges`` (``{key: Range}``, :meth:`~daskgen.engines.base.Engine.ranges_with`) are the narrower
    ranges the run's engine, named ``engine``, takes; a row's value outside one is refused like a value outside
    the table's."""

    def __init__(self, max_new_tokens: int, engine_ranges: Mapping[str, Range] | None = None, engine: str = "") -> None:
        self.max_new_tokens = max_new_tokens
        self.engine_ranges, self.engine = dict(engine_ranges or {}), engine
        self.keys: set[str] = set()

    def __call__(self, row: Any) -> list[str]:
        """Problems of ``row``'s ``sampling`` (messages without the row number, which the scan adds)."""
        if not isinstance(row, dict) or row.get("sampling") is None:
            return []
        settings = row["sampling"]
        where = "column 'sampling'" + (f" (id {row['id']!r})" if row.get("id") is not None else "")
        errors = setting_errors(settings, self.max_new_tokens, where)
        if not errors:
            errors = engine_range_errors(settings, self.engine_ranges, self.engine, where)
        if not errors:
            self.keys.update(k for k, v in settings.items() if v is not None)
        return errors


def engine_range_errors(settings: Mapping[str, Any], ranges: Mapping[str, Range], engine: str, where: str) -> list[str]:
    """Each value of ``settings`` (valid for the table) outside the narrower range engine ``engine`` takes."""
    return [
        f"{where}: key {key!r} is {_found(value)}; engine {engine!r} takes {ranges[key].text}. Give a value in that "
        "range, or use another engine"
        for key, value in settings.items()
        if key in ranges and value is not None and not ranges[key].valid(_normalized(key, value))
    ]


def run_defaults(config: Any) -> dict[str, Any]:
    """The run's sampling settings (every key of :data:`KEYS` but ``seed``, which seeds the run) of a
    :class:`~daskgen.config.RunConfig` or of the config mapping a store's attrs keep."""
    read = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key)
    return {key: read(key) for key in KEYS if key != "seed"}


def run_settings(config: Any) -> dict[str, Any]:
    """The run's settings in canonical form (the defaults of every row)."""
    return normalized(run_defaults(config))


def requested_features(run: Mapping[str, Any], row_keys: frozenset[str]) -> set[str]:
    """The engine features (:data:`daskgen.engines.features.FEATURES`) a run with settings ``run`` asks for,
    when its rows set ``row_keys``."""
    wanted = {"per_row_sampling"} if row_keys or any(run.get(k, off) != off for k, off in OFF.items()) else set()
    return wanted | {k for k in STOP_KEYS if run.get(k) or k in row_keys}


def merged(defaults: Mapping[str, Any], row: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings a row uses: its own over the run's ``defaults`` (canonical already: :func:`run_settings`)."""
    return {**defaults, **normalized(row)} if row else dict(defaults)
