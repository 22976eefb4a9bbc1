"""The client's side of the ``daskgen`` dashboard page: install the plugin, report the run, keep its record.

:class:`DashboardLink` registers :class:`daskgen.dashboard.DashboardPlugin` on the run's scheduler (a
plugin already there is kept), reports the run once per ``daskgen.dashboard.interval`` without waiting
for the scheduler (:mod:`daskgen.dashboard.metrics`), and at the end fetches the compact per-run record
(engine versus committed tokens, per-worker totals) that the run keeps in its store for
``daskgen report``.  A scheduler where daskgen cannot be imported gets no page; the run goes on.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from daskgen import tunables
from daskgen.dashboard import PLUGIN_NAME, DashboardPlugin, page_link
from daskgen.dashboard.metrics import RUN_TOPIC, run_report

if TYPE_CHECKING:
    from daskgen.client.live import LiveRun

logger = logging.getLogger(__name__)


class DashboardLink:
    """One run's reports to the scheduler's daskgen page.

    Attributes:
        url: the page's address, or ``None`` when the scheduler serves no page (no dashboard, no bokeh,
            no daskgen where the scheduler runs, or ``daskgen.dashboard.enabled`` false).
    """

    def __init__(self, client: Any, run: LiveRun) -> None:
        self.client, self.run = client, run
        self.installed = bool(tunables.get("dashboard.enabled")) and _install(client)
        self.url = page_link(_dashboard_link(client)) if self.installed and _page_served(client) else None
        self.interval = tunables.seconds("dashboard.interval")
        self.last = float("-inf")
        self.sending = False

    def report(self, state: str = "generating", *, force: bool = False) -> None:
        """Send the run's numbers (at most once per interval unless ``force``; never waits for the scheduler)."""
        now = time.monotonic()
        if not self.installed or self.sending or (not force and now - self.last < self.interval):
            return
        self.last, self.sending = now, True
        self.client.loop.add_callback(self._send, self._message(state))

    def _message(self, state: str) -> dict[str, Any]:
        return run_report(self.run, errors=self.run.take_new_failures(), state=state)

    async def _send(self, message: dict[str, Any]) -> None:
        try:
            await self.client.scheduler.log_event(topic=RUN_TOPIC, msg=message)
        except Exception as exc:  # the dashboard is a view: a lost report changes nothing of the run
            logger.debug("dashboard report not delivered: %s", exc)
        finally:
            self.sending = False

    def finish(self) -> dict[str, Any] | None:
        """Send the final report; the run's record (engine vs committed tokens, per worker), or ``None``."""
        if not self.installed:
            return None
        from daskgen.dashboard.plugin import finish_run
        from daskgen.worker.plugin import metrics_report

        try:
            workers = [r for r in self.client.run(metrics_report).values() if r is not None]
            return self.client.run_on_scheduler(finish_run, report=self._message("finished"), workers=workers)
        except Exception as exc:
            logger.warning("could not fetch the run's engine record from the scheduler (%s)", exc)
            return None


def _install(client: Any) -> bool:
    """Register the dashboard plugin on the scheduler; false (with a warning) where that is impossible."""
    try:
        client.register_plugin(DashboardPlugin(), name=PLUGIN_NAME)
    except Exception as exc:  # e.g. a scheduler without daskgen installed
        logger.warning(
            "no daskgen dashboard page: could not install daskgen's dashboard plugin on the scheduler (%s). "
            "Install daskgen where the scheduler runs, or start it with --preload daskgen.dashboard.",
            exc,
        )
        return False
    return True


def _page_served(client: Any) -> bool:
    from daskgen.dashboard.plugin import page_served

    return bool(client.run_on_scheduler(page_served))


def _dashboard_link(client: Any) -> str | None:
    try:
        return client.dashboard_link
    except Exception:  # no dashboard service on the scheduler
        return None
