"""Colours of the finish labels, shared by the HTML report and the dashboard page (no heavy imports)."""

from __future__ import annotations

#: The colour of each finish label, the same in the HTML report and on the dashboard page.
FINISH_COLORS: dict[str, str] = {
    "stop": "#2e7d32",
    "length": "#ef6c00",
    "abort": "#757575",
    "error": "#c62828",
    "not_generated": "#bdbdbd",
}
