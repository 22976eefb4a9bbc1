"""``DashboardPlugin``: the scheduler plugin that aggregates daskgen's reports and serves the ``daskgen`` page.

It takes the events of :mod:`daskgen.dashboard.metrics` as the scheduler logs them
(``SchedulerPlugin.log_event``) into a :class:`~daskgen.dashboard.state.DashboardState`, and adds the
page to the scheduler's dashboard the way ``distributed.dashboard.scheduler.connect`` adds Dask's own:
a Bokeh server application (``distributed.dashboard.core.BokehApplication``) routed by the scheduler's
HTTP application, at ``/daskgen`` next to ``/status``, plus ``/daskgen/state.json`` with the same numbers.
The dashboard's address, port and TLS settings stay as Dask configures them.

It gets onto a scheduler in one of three ways: ``daskgen run`` registers it on the scheduler it uses
(idempotent: a plugin already there is kept), the scheduler process daskgen starts for SLURM/PBS clusters
adds it at start, and ``dask scheduler --preload daskgen.dashboard`` adds it to any scheduler.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from typing import Any

from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.http.utils import RequestHandler

from daskgen.dashboard.metrics import RUN_TOPIC, WORKER_TOPIC
from daskgen.dashboard.state import DashboardState

logger = logging.getLogger(__name__)

#: The plugin's name on the scheduler.
PLUGIN_NAME = "daskgen-dashboard"
#: The page's path on the dashboard (and its entry in the dashboard's navigation bar).
PAGE = "daskgen"


class DashboardPlugin(SchedulerPlugin):
    """Aggregates the workers' and the client's reports; serves the ``daskgen`` dashboard page."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.state = DashboardState()
        self.page: Any = None
        self.scheduler: Any = None

    async def start(self, scheduler: Any) -> None:
        """Serve the page on ``scheduler``'s dashboard (when it has one and bokeh is installed)."""
        self.scheduler = scheduler
        self.page = serve_page(scheduler)

    async def close(self) -> None:
        """Stop serving the page."""
        if self.page is not None:
            withdraw_page(self.scheduler, self.page)
            self.page = None

    def log_event(self, topic: str, msg: Any) -> None:
        """Aggregate daskgen's reports (other topics are ignored)."""
        if topic in (WORKER_TOPIC, RUN_TOPIC) and isinstance(msg, dict):
            self.state.ingest(topic, msg)


def dashboard_of(scheduler: Any) -> DashboardPlugin | None:
    """The scheduler's :class:`DashboardPlugin`, or ``None``."""
    plugin = scheduler.plugins.get(PLUGIN_NAME)
    return plugin if isinstance(plugin, DashboardPlugin) else None


def current_snapshot(scheduler: Any) -> dict[str, Any] | None:
    """What the page shows now (:meth:`DashboardState.snapshot` of the scheduler's plugin), ``None`` without it."""
    plugin = dashboard_of(scheduler)
    return None if plugin is None else plugin.state.snapshot()


def page_served(dask_scheduler: Any) -> bool:
    """Run on the scheduler: true when its dashboard serves the daskgen page."""
    plugin = dashboard_of(dask_scheduler)
    return plugin is not None and plugin.page is not None


def finish_run(dask_scheduler: Any, report: dict[str, Any], workers: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Run on the scheduler (``client.run_on_scheduler``) at the end of a run: take the workers' and the
    client's last reports and return what the run keeps in its store (:meth:`DashboardState.record`),
    or ``None`` without the plugin."""
    plugin = dashboard_of(dask_scheduler)
    if plugin is None:
        return None
    for message in workers:
        plugin.state.ingest(WORKER_TOPIC, message)
    plugin.state.ingest(RUN_TOPIC, report)
    return plugin.state.record()


def serve_page(scheduler: Any) -> Any:
    """Add the page and its JSON route to ``scheduler``'s dashboard; the Bokeh application, or ``None``."""
    server = getattr(scheduler, "http_application", None)
    if server is None or "dashboard" not in getattr(scheduler, "services", {}):
        return None
    try:
        from distributed.dashboard.core import BokehApplication
        from distributed.dashboard.scheduler import template_variables
    except ImportError:  # bokeh missing: Dask shows its own hint on the dashboard
        logger.info("no daskgen dashboard page: bokeh is not installed where the scheduler runs")
        return None
    from tornado.ioloop import IOLoop

    from daskgen.dashboard.page import document

    for existing in server.applications:  # served already (a plugin registered again): the page finds the new one
        if f"/{PAGE}" in getattr(existing, "app_paths", ()):
            return existing

    prefix = dashboard_prefix(server)
    variables = template_variables(scheduler)  # Dask's own (memoized per scheduler, shared with its pages)
    if PAGE not in variables["pages"]:
        variables["pages"].append(PAGE)  # so the navigation bar of every dashboard page links to it
    app = BokehApplication(
        {f"/{PAGE}": functools.partial(document, current_snapshot)},
        scheduler,
        prefix=prefix,
        template_variables=variables,
    )
    server.add_handlers(r".*", [(rf"{prefix}/{PAGE}/state\.json", StateHandler, {"dask_server": scheduler})])
    server.add_application(app)
    app.initialize(IOLoop.current())
    app.start()
    return app


def dashboard_prefix(server: Any) -> str:
    """The path prefix of Dask's own dashboard pages (``dask scheduler --dashboard-prefix``), e.g. ``/dask``,
    or ``""``: the page is served under the same prefix."""
    for app in server.applications:
        if "/status" in getattr(app, "app_paths", ()):
            text = str(getattr(app, "prefix", "") or "").strip("/")
            return f"/{text}" if text else ""
    return ""


def withdraw_page(scheduler: Any, app: Any) -> None:
    """Undo :func:`serve_page` (the JSON route stays and answers 404 without the plugin)."""
    from distributed.dashboard.scheduler import template_variables

    applications = getattr(scheduler.http_application, "applications", [])
    if app in applications:
        applications.remove(app)
    pages = template_variables(scheduler)["pages"]
    if PAGE in pages:
        pages.remove(PAGE)
    app.stop()


class StateHandler(RequestHandler):
    """``GET /daskgen/state.json``: the page's numbers (:meth:`DashboardState.snapshot`) as JSON
    (infinite or undefined numbers as ``null``)."""

    def get(self) -> None:
        plugin = dashboard_of(self.server)
        if plugin is None:
            self.set_status(404)
            self.write({"error": "daskgen's dashboard plugin is not installed on this scheduler"})
            return
        self.set_header("Content-Type", "application/json")
        self.write(json.dumps(_jsonable(plugin.state.snapshot())))


def _jsonable(value: Any) -> Any:
    """``value`` with non-finite floats as ``None`` and tuples as lists (strict JSON)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
