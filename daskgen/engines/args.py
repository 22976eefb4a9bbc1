"""Engine arguments: building an engine's options dataclass and checking the values, one message format.

* :func:`parse_engine_args`: ``engine_args`` into the engine's dataclass, unknown names refused.
* :func:`check_known_args`: unknown names refused with close matches, for engines whose options
  are their backend's (``sglang`` ``ServerArgs``, ``vllm`` ``AsyncEngineArgs``).
* :func:`require`, :func:`is_number`, :func:`check_number`, :func:`check_positive_int`: value
  checks whose ``ConfigError`` reads ``"<engine> engine: <name> must be <expected>, got <value>"``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from daskgen.errors import ConfigError

__all__ = [
    "check_known_args",
    "check_number",
    "check_positive_int",
    "is_number",
    "parse_engine_args",
    "require",
]

_ArgsT = TypeVar("_ArgsT")


def parse_engine_args(engine: str, args_class: type[_ArgsT], args: Mapping[str, Any]) -> _ArgsT:
    """Build the dataclass ``args_class`` from ``args``.

    Unknown keys raise :class:`daskgen.errors.ConfigError` naming them and the valid ones; the
    dataclass's ``__post_init__`` checks the values.
    """
    valid = [f.name for f in dataclasses.fields(args_class)]  # type: ignore[arg-type]
    unknown = sorted(set(args) - set(valid))
    if unknown:
        raise ConfigError(f"engine {engine!r} has no option(s) {unknown}; valid engine_args are {valid}")
    return args_class(**args)


def check_known_args(engine: str, args: Mapping[str, Any], valid: Iterable[str], where: str) -> None:
    """Raise ``ConfigError`` for keys of ``args`` not in ``valid``, suggesting close matches.

    ``where`` says what the valid names are (e.g. ``"sglang ServerArgs fields"``); the message
    lists every valid name.
    """
    names = sorted(valid)
    unknown = sorted(set(args) - set(names))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(key))
    raise ConfigError(
        f"{engine} engine: unknown engine_args {', '.join(hints)}; engine_args must be {where}; "
        f"valid names are: {', '.join(names)}"
    )


def require(engine: str, ok: bool, name: str, expected: str, got: Any) -> None:
    """Raise ``ConfigError("<engine> engine: <name> must be <expected>, got <got>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{engine} engine: {name} must be {expected}, got {got!r}")


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(engine: str, name: str, value: Any, low: float | None, integer: bool) -> None:
    """``value`` must be a number (an integer if ``integer``) >= ``low``, or > 0 when ``low`` is None."""
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and (value > 0 if low is None else value >= low)
    bound = "> 0" if low is None else f">= {low}"
    require(engine, ok, name, f"{'an integer' if integer else 'a number'} {bound}", value)


def check_positive_int(engine: str, name: str, value: Any) -> None:
    """``value`` must be ``None`` or an integer >= 1."""
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    require(engine, ok, name, "a positive integer or null", value)
