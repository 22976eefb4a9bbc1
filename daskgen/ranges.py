"""Value ranges an option declares: the check of a value and how the range reads in a message.

A run option a row may set in its ``sampling`` column carries its :class:`Range` in its declaration
(``option(row=...)``, :mod:`daskgen.run_options`); :mod:`daskgen.input.sampling` checks rows and the
run's settings against it, and the refusal names :attr:`Range.text`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, TypeGuard

#: Most stop strings (and stop token ids) one row or run may give.
MAX_STOPS = 32


@dataclass(frozen=True)
class Range:
    """The values a setting takes.

    Attributes
    ----------
    kind:
        ``"float"``, ``"int"`` or ``"list"``: an integer given for a float setting is that number.
    valid:
        Whether a value (normalized: a float setting's integer as a float) is in the range.
    bounds:
        The range in words, e.g. ``"a number in (0, 1]"``.
    note:
        What a special value means (``"0 = greedy"``); ``"X = off"`` from a declared off value when empty.
    """

    kind: str
    valid: Callable[[Any], bool]
    bounds: str
    note: str = ""

    @property
    def text(self) -> str:
        """The range as a refusal names it: ``"a number in (0, 1] (1 = off)"``."""
        return f"{self.bounds} ({self.note})" if self.note else self.bounds

    def with_off(self, off: Any) -> Range:
        """This range, noting that ``off`` leaves the setting off (unless it already has a note)."""
        return self if self.note or off is None else replace(self, note=f"{off:g} = off")


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_integer(value: Any) -> TypeGuard[int]:
    """An int, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def number(low: float, high: float | None = None, *, low_open: bool = False, note: str = "") -> Range:
    """A finite number ``>= low`` (``> low`` with ``low_open``) and ``<= high``."""

    def valid(v: Any) -> bool:
        return is_number(v) and (v > low if low_open else v >= low) and (high is None or v <= high)

    if high is None:
        bounds = f"a number {'>' if low_open else '>='} {low:g}"
    else:
        bounds = f"a number in {'(' if low_open else '['}{low:g}, {high:g}]"
    return Range("float", valid, bounds, note)


def integer(low: int, high: str | None = None, *, note: str = "") -> Range:
    """An integer ``>= low``; ``high`` names an upper bound checked elsewhere (another setting), for the text."""
    bounds = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
    return Range("int", lambda v: is_integer(v) and v >= low, bounds, note)


def distinct(item: Callable[[Any], bool], items: str) -> Range:
    """A list of at most :data:`MAX_STOPS` distinct entries, each passing ``item`` (``items`` names them)."""

    def valid(v: Any) -> bool:
        return isinstance(v, list) and len(v) <= MAX_STOPS and all(map(item, v)) and len(set(v)) == len(v)

    return Range("list", valid, f"a list of at most {MAX_STOPS} distinct {items}")
