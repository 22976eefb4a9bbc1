"""daskgen's page on the Dask dashboard: a live view of a run (``/daskgen`` next to Dask's ``/status``).

* :mod:`daskgen.dashboard.metrics`: what workers and the client report (Dask events).
* :mod:`daskgen.dashboard.state`: the aggregation of those reports in the scheduler process.
* :mod:`daskgen.dashboard.plugin`: the scheduler plugin that holds it and serves the page.
* :mod:`daskgen.dashboard.page`: the Bokeh document.

``dask scheduler --preload daskgen.dashboard`` installs the plugin on a scheduler that daskgen does
not start (:func:`dask_setup`); ``daskgen run`` installs it on any scheduler it uses.
"""

from __future__ import annotations

from typing import Any

from daskgen.dashboard.plugin import PAGE, PLUGIN_NAME, DashboardPlugin

__all__ = ["PAGE", "PLUGIN_NAME", "DashboardPlugin", "dask_setup", "page_link"]


async def dask_setup(scheduler: Any) -> None:
    """Preload hook (``dask scheduler --preload daskgen.dashboard``): install :class:`DashboardPlugin`."""
    await scheduler.register_scheduler_plugin(DashboardPlugin(), name=PLUGIN_NAME, idempotent=True)


def page_link(dashboard_link: str | None) -> str | None:
    """The ``daskgen`` page's URL from a cluster's or client's dashboard link (``.../status``)."""
    if not dashboard_link:
        return None
    base = dashboard_link.rsplit("/", 1)[0] if dashboard_link.rstrip("/").endswith("status") else dashboard_link
    return f"{base.rstrip('/')}/{PAGE}"
