"""The names a kept input column may not take (``keep_columns``): :func:`reserved_names`.

A kept column is stored as a store array and written under its own name by every output format, so it may not
take a name daskgen reads from a row (:data:`daskgen.input.columns.DASKGEN_KEYS`), a store array or dimension
(:class:`daskgen.store.layout.Layout`) or a field the formats write (:func:`daskgen.formats.output_names`).  The
checks that need the names (:mod:`daskgen.input.columns`) are handed them by their callers.
"""

from __future__ import annotations

import functools

from daskgen.formats import output_names
from daskgen.input.columns import DASKGEN_KEYS
from daskgen.store.layout import every_array_layout


@functools.cache
def reserved_names() -> frozenset[str]:
    """Names a kept column may not have: daskgen's row keys, the store's arrays and dimensions, and the fields of
    its exports and ``daskgen.follow`` formats (a kept column appears there under its own name)."""
    layout = every_array_layout()
    dims = {d for spec in layout.array_specs().values() for d in spec.dims}
    return frozenset({*DASKGEN_KEYS, *layout.array_specs(), *dims, *output_names()})
