"""Reading finished (or growing) stores: the xarray accessor, exports, reports, summaries."""

from __future__ import annotations

from typing import Any

__all__ = ["open_store"]


def __getattr__(name: str) -> Any:
    if name == "open_store":
        from daskgen.analysis.accessor import open_store

        return open_store
    raise AttributeError(f"module 'daskgen.analysis' has no attribute {name!r}")
