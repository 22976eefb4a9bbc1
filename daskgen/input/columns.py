"""The row's own columns kept through to the trainer (``keep_columns``).

``keep_columns`` lists input columns (``[answer, data_source]``) or is ``"*"``: every column of the first
row but the prompt and daskgen's own keys (:data:`DASKGEN_KEYS`).  Each kept column is stored per prompt as
a string (strings as they are, every other value as JSON text: ``3``, ``true``, ``null``, ``{"a": 1}``) in the
store array ``column_<name>`` (:func:`daskgen.store.layout.column_array`), written with the row's data.  A
listed column missing from a row is an error naming the row and the column (with ``"*"``, every row must
have the first row's columns and no others).  Column names may not be names daskgen's outputs use
(:mod:`daskgen.reserved`: the callers hand those names to the checks here).
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from daskgen.errors import ConfigError
from daskgen.input import adapters, response_format
from daskgen.input.chat_template import ROW_KEYS

#: Row keys daskgen reads itself: never kept by ``"*"``, refused in a list.
DASKGEN_KEYS = ("id", "prompt", "messages", "sampling", *ROW_KEYS, response_format.ROW_KEY, adapters.ROW_KEY)


def normalize(keep: Any, reserved: Collection[str]) -> tuple[str, ...] | str:
    """The ``keep_columns`` setting as a tuple of names, or ``"*"`` (``()`` when unset); a name in ``reserved``
    (:func:`daskgen.reserved.reserved_names`) is refused.

    A string is ``"*"`` or comma-separated names (the command line's ``--keep-columns answer,data_source``).
    """
    if keep is None:
        return ()
    if isinstance(keep, str):
        if keep.strip() == "*":
            return "*"
        keep = [name.strip() for name in keep.split(",") if name.strip()]
    if not isinstance(keep, (list, tuple)) or not all(isinstance(k, str) and k for k in keep):
        raise ConfigError(
            f"setting 'keep_columns' must be a list of column names or '*', found {keep!r}; "
            "e.g. keep_columns: [answer, data_source]."
        )
    check_names(keep, reserved)
    return tuple(dict.fromkeys(keep))


def check_names(names: Any, reserved: Collection[str]) -> None:
    """:class:`ConfigError` for column names daskgen uses itself (``reserved``) or that cannot name a store array."""
    bad = sorted(n for n in names if n in reserved)
    if bad:
        raise ConfigError(
            f"setting 'keep_columns': {bad} are names daskgen uses itself (row keys, store arrays or output "
            "fields); rename those input columns."
        )
    odd = sorted(n for n in names if "/" in n or n.startswith("__"))
    if odd:
        raise ConfigError(f"setting 'keep_columns': {odd} cannot name a store array (no '/', no leading '__').")


def as_text(value: Any) -> str:
    """A column value as stored: a string as it is, any other value as JSON text."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


class ColumnCheck:
    """Checks each row has the kept columns, one row at a time; :attr:`names` are the columns kept.

    With ``"*"`` the first row's columns are kept (daskgen's own keys left out) and every row must have
    exactly those; those columns may not take a ``reserved`` name (:func:`daskgen.reserved.reserved_names`).
    """

    def __init__(self, keep: tuple[str, ...] | str, reserved: Collection[str]) -> None:
        self.every, self.reserved = keep == "*", reserved
        self.names: tuple[str, ...] = () if self.every else tuple(keep)
        self.first: int | None = None

    def row_errors(self, row: dict[str, Any], number: int) -> list[str]:
        """What ``row`` (row ``number``) lacks of the kept columns (or, with ``"*"``, has beyond them)."""
        if self.every and self.first is None:
            self.first, self.names = number, tuple(k for k in row if k not in DASKGEN_KEYS)
            check_names(self.names, self.reserved)
            return []
        errors = [
            f"column {name!r} is missing (keep_columns keeps it); add it to every row or leave it out of keep_columns"
            for name in self.names
            if name not in row
        ]
        if self.every:
            errors += [
                f"column {k!r} is not in the first row (keep_columns '*' keeps row {self.first}'s columns); "
                "give every row the same columns, or list the columns to keep"
                for k in row
                if k not in DASKGEN_KEYS and k not in self.names
            ]
        return errors


def kept_values(row: dict[str, Any], names: tuple[str, ...]) -> dict[str, str]:
    """The stored text of each kept column of ``row``."""
    return {name: as_text(row[name]) for name in names}
