"""The ``daskgen`` dashboard page: a Bokeh document drawn from :meth:`DashboardState.snapshot`, updated every second.

From top to bottom: the run's numbers (prompts done / pending / failed with a progress bar, ETA, tail
share so far, engine and committed tokens/s and the gap, the workers' load ratio); engine versus
committed tokens/s over time and the gap in tokens; per worker, engine tokens/s (chart) and a table with
batch occupancy, partitions admitted and running, tokens/s, samples, restarts and policy version; response lengths
of finished samples by finish reason and samples per policy version (of their first token; those continued onto
a newer version by a ``continue`` refresh drawn over them); the latest errors.  Numbers carry ``data-daskgen``
attributes, so scripts and tests read what the page shows.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable
from typing import Any

from daskgen.analysis.palette import FINISH_COLORS
from daskgen.dashboard.metrics import REASON_LABELS
from daskgen.dashboard.state import RATE_WINDOW_S

#: Colours by finish reason (as in ``daskgen report``) and of the two throughputs.
ENGINE_COLOR, COMMITTED_COLOR, GAP_COLOR = "#1565c0", "#2e7d32", "#ef6c00"
#: What the page shows, from the scheduler: the plugin's current snapshot, ``None`` without the plugin.
SnapshotSource = Callable[[Any], "dict[str, Any] | None"]
#: Milliseconds between updates of an open page.
UPDATE_MS = 1000
#: Names of the page's data sources in its Bokeh document (scripts and tests find them with
#: ``Bokeh.documents[0].get_model_by_name``): the throughput series (rates, gap and totals so far),
#: the per-worker rows, the length histogram's bars, the samples per policy version.
THROUGHPUT_SOURCE, WORKERS_SOURCE, LENGTHS_SOURCE = "daskgen-throughput", "daskgen-workers", "daskgen-lengths"
VERSIONS_SOURCE = "daskgen-versions"
#: Colours of the samples per policy version and of those continued across a refresh.
VERSION_COLOR, CONTINUED_COLOR = "#5e35b1", "#f9a825"

_STYLE = """<style>
.dg{font-family:sans-serif;color:#222}.dg h2{margin:4px 0 8px;font-size:18px}
.dg-cards{display:flex;flex-wrap:wrap;gap:8px}.dg-card{border:1px solid #ddd;border-radius:6px;padding:6px 12px;
min-width:96px;background:#fafafa}.dg-card .k{font-size:11px;color:#666;text-transform:uppercase}
.dg-card .v{font-size:22px;font-weight:600}.dg-bar{display:flex;height:14px;border-radius:4px;overflow:hidden;
background:#cfd8dc;margin:8px 0}
.dg-err td{padding:2px 8px;border-bottom:1px solid #eee;font-size:12px;vertical-align:top}
.dg-tab{border-collapse:collapse;font-size:13px}.dg-tab th{text-align:left;font-weight:600;color:#555;
border-bottom:2px solid #ddd;padding:4px 10px}.dg-tab td{border-bottom:1px solid #eee;padding:4px 10px}
.dg-meter{display:inline-block;width:60px;height:9px;background:#e3e8eb;border-radius:3px;margin-right:6px;
vertical-align:middle}.dg-meter span{display:block;height:9px;background:#1565c0;border-radius:3px}
.dg-flag{color:#b71c1c;font-size:12px}
</style>"""


def document(snapshot_of: SnapshotSource, scheduler: Any, extra: dict[str, Any], doc: Any) -> None:
    """Build the page for one browser session (after ``snapshot_of``, the signature of Dask's dashboard
    applications: the plugin serves ``functools.partial(document, snapshot_of)``)."""
    from distributed.dashboard.components.scheduler import BOKEH_THEME, env

    page = Page(scheduler, snapshot_of)
    doc.title = "Dask: daskgen"
    doc.add_root(page.root)
    doc.add_periodic_callback(page.update, UPDATE_MS)
    doc.template = env.get_template("simple.html")
    doc.template_variables.update(extra)
    doc.theme = BOKEH_THEME
    page.update()


class Page:
    """The page's Bokeh models and how a snapshot updates them."""

    def __init__(self, scheduler: Any, snapshot_of: SnapshotSource) -> None:
        from bokeh.layouts import column, row
        from bokeh.models import ColumnDataSource
        from bokeh.models.widgets import Div

        self.scheduler, self.snapshot_of = scheduler, snapshot_of
        self.header = Div(sizing_mode="stretch_width")
        self.errors = Div(sizing_mode="stretch_width")
        self.table = Div(sizing_mode="stretch_width")
        series = ("time", "engine", "committed", "gap", "engine_tokens", "committed_tokens", "committed_prompts")
        self.rates = ColumnDataSource({k: [] for k in series}, name=THROUGHPUT_SOURCE)
        self.workers = ColumnDataSource(_worker_columns([]), name=WORKERS_SOURCE)
        lengths: dict[str, list[Any]] = {"left": [], "right": [], **{r: [] for r in REASON_LABELS}}
        self.lengths = ColumnDataSource(lengths, name=LENGTHS_SOURCE)
        self.versions = ColumnDataSource(_version_columns({}), name=VERSIONS_SOURCE)
        self.worker_figure = _worker_figure(self.workers)
        self.version_figure = _version_figure(self.versions)
        self.root = column(
            self.header,
            row(_throughput_figure(self.rates), _gap_figure(self.rates), sizing_mode="stretch_width"),
            row(self.worker_figure, self.table, sizing_mode="stretch_width"),
            row(_length_figure(self.lengths), self.version_figure, sizing_mode="stretch_width"),
            self.errors,
            sizing_mode="stretch_width",
        )

    def update(self) -> None:
        """Redraw from the plugin's current snapshot."""
        snap = self.snapshot_of(self.scheduler)
        if snap is None:
            self.header.text = "<p>daskgen's dashboard plugin is not installed on this scheduler.</p>"
            return
        self.header.text = _STYLE + header_html(snap)
        rates = snap["throughput"]
        self.rates.data = {**rates, "time": [t * 1000 for t in rates["time"]]}  # datetime axes take ms
        self.workers.data = columns = _worker_columns(snap["workers"])
        if list(self.worker_figure.y_range.factors) != columns["label"]:
            self.worker_figure.y_range.factors = columns["label"]
        self.table.text = _STYLE + workers_html(snap["workers"])
        self.lengths.data = _length_columns(snap["lengths"])
        self.versions.data = versions = _version_columns(snap["versions"])
        if list(self.version_figure.x_range.factors) != versions["label"]:
            self.version_figure.x_range.factors = versions["label"]
        self.errors.text = _STYLE + errors_html(snap["errors"])


# -- HTML parts -------------------------------------------------------------------------------------
def header_html(snap: dict[str, Any]) -> str:
    """The title, the number cards and the progress bar."""
    p, run = snap["progress"], snap["run"] or {}
    engine, committed, span = _card_rates(snap)
    cards = [
        ("state", "state", p["state"]),
        ("done", "done", f"{p['done']:,}"),
        ("pending", "pending", f"{p['pending']:,}"),
        ("failed", "failed", f"{p['failed']:,}"),
        ("eta", "ETA", _duration(p["eta_s"])),
        ("tail", "tail share", "—" if p["tail_share"] is None else f"{100 * p['tail_share']:.0f}%"),
        ("engine-tps", f"engine tok/s ({span})", f"{engine:,.0f}"),
        ("committed-tps", f"committed tok/s ({span})", f"{committed:,.0f}"),
        ("gap", "uncommitted tokens", f"{p['gap_tokens']:,}"),
        ("load-ratio", "max/min load", _ratio(snap["load_ratio"])),
    ]
    body = "".join(
        f'<div class="dg-card"><div class="k">{k}</div>'
        f'<div class="v" data-daskgen="{key}">{html.escape(str(v))}</div></div>'
        for key, k, v in cards
    )
    store = html.escape(str(run.get("store", "no run reported yet")))
    elapsed = _duration(p["elapsed_s"])
    title = f"<h2>daskgen: {store}</h2><div>{p['total']:,} prompts; generating for {elapsed}</div>"
    return f'<div class="dg">{title}<div class="dg-cards">{body}</div>{_bar(p)}</div>'


def _card_rates(snap: dict[str, Any]) -> tuple[float, float, str]:
    """Engine and committed tokens/s for the cards: the last seconds while running, the run's mean when over."""
    p, rates = snap["progress"], snap["throughput"]
    if p["state"] == "finished" and p["elapsed_s"]:
        return p["engine_tokens"] / p["elapsed_s"], p["committed_tokens"] / p["elapsed_s"], "run"
    last = (rates["engine"][-1], rates["committed"][-1]) if rates["engine"] else (0.0, 0.0)
    return last[0], last[1], f"{RATE_WINDOW_S:g} s"


def _bar(p: dict[str, Any]) -> str:
    total = max(1, p["total"])
    parts = [("done", "#2e7d32"), ("failed", "#c62828")]
    segs = "".join(f'<div style="width:{100 * p[k] / total:.2f}%;background:{c}" title="{k}"></div>' for k, c in parts)
    return f'<div class="dg-bar">{segs}</div>'


def errors_html(errors: list[dict[str, Any]]) -> str:
    """The latest errors, newest first."""
    if not errors:
        return '<div class="dg"><h2>Recent errors</h2><p data-daskgen="errors">none</p></div>'
    rows = "".join(
        f"<tr><td>{time.strftime('%H:%M:%S', time.localtime(e['time']))}</td><td>{html.escape(e['source'])}</td>"
        f"<td>{html.escape(e['message'])}</td></tr>"
        for e in errors
    )
    return f'<div class="dg"><h2>Recent errors</h2><table class="dg-err" data-daskgen="errors">{rows}</table></div>'


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    return f"{h}h{rest // 60:02d}m" if h else f"{rest // 60}m{rest % 60:02d}s"


def _ratio(value: float | None) -> str:
    if value is None:
        return "—"
    return "∞ (an idle worker)" if math.isinf(value) else f"{value:.2f}"


# -- figures ----------------------------------------------------------------------------------------
def _figure(title: str, **kwargs: Any) -> Any:
    from bokeh.models.annotations import Title
    from bokeh.plotting import figure

    heading = Title(text=title, text_font_size="13px")
    return figure(title=heading, height=260, sizing_mode="stretch_width", toolbar_location="above", **kwargs)


def _throughput_figure(source: Any) -> Any:
    from bokeh.models import HoverTool

    fig = _figure("Tokens/s: generated by the engines vs committed to the store", x_axis_type="datetime")
    fig.line("time", "engine", source=source, color=ENGINE_COLOR, line_width=2, legend_label="engines")
    fig.line("time", "committed", source=source, color=COMMITTED_COLOR, line_width=2, legend_label="committed")
    fig.legend.location = "top_left"
    fig.yaxis.axis_label = "tokens/s"
    tips = [
        ("engines", "@engine{0,0}"),
        ("committed", "@committed{0,0}"),
        ("tokens committed", "@committed_tokens{0,0}"),
    ]
    fig.add_tools(HoverTool(tooltips=tips))
    return fig


def _gap_figure(source: Any) -> Any:
    fig = _figure("Generated but not yet committed (tokens)", x_axis_type="datetime")
    fig.varea(x="time", y1=0, y2="gap", source=source, color=GAP_COLOR, alpha=0.5)
    fig.line("time", "gap", source=source, color=GAP_COLOR)
    fig.yaxis.axis_label = "tokens"
    return fig


def _worker_columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    data: dict[str, list[Any]] = {k: [r[k] for r in rows] for k in ("worker", "tokens_per_s", "tokens", "samples")}
    data["label"] = [_short(r["worker"]) for r in rows]
    data["occupancy_pct"] = [100 * r["occupancy"] for r in rows]
    return data


def _short(address: str) -> str:
    return address.split("://")[-1]


def _worker_figure(source: Any) -> Any:
    from bokeh.models import FactorRange, HoverTool

    fig = _figure("Engine tokens/s per worker", y_range=FactorRange())
    fig.hbar(y="label", right="tokens_per_s", height=0.7, source=source, color=ENGINE_COLOR)
    tips = [("worker", "@worker"), ("tokens/s", "@tokens_per_s{0,0}"), ("batch occupancy", "@occupancy_pct{0}%"),
            ("samples", "@samples{0,0}"), ("engine tokens", "@tokens{0,0}")]  # fmt: skip
    fig.add_tools(HoverTool(tooltips=tips))
    fig.x_range.start = 0
    fig.xaxis.axis_label = "tokens/s"
    return fig


def _images(r: dict[str, Any], i: int) -> str:
    """A worker's image cells: images preprocessed and per second, seconds its partitions waited for them."""
    return (
        f'<td data-daskgen="images-{i}">{r["images"]:,} ({r["images_per_s"]:.1f}/s)</td>'
        f'<td data-daskgen="image-wait-{i}">{r["image_wait_s"]:.1f} s</td>'
    )


def workers_html(rows: list[dict[str, Any]]) -> str:
    """The per-worker table: engine state, batch occupancy, partitions admitted and running, tokens/s, restarts,
    policy version; in runs with images, images preprocessed (per second) and the seconds partitions waited."""
    images = any(r.get("images") for r in rows)
    head = "".join(
        f"<th>{h}</th>"
        for h in ("worker", "engine", "batch occupancy", "partitions admitted / running", "tokens/s", "samples",
                  "restarts", "policy version", *(("images preprocessed (/s)", "waited for images") if images else ()))
    )  # fmt: skip
    body = "".join(
        f'<tr data-daskgen-worker="{html.escape(r["worker"])}"><td>{html.escape(_short(r["worker"]))}</td>'
        f"<td>{html.escape(r['state'])}</td>"
        f"<td>{_meter(r['occupancy'])} {r['outstanding']:,} / {r['capacity']:,}</td>"
        f"<td>{r['window']} / {r['running']}{_slots_flag(r)}</td><td>{r['tokens_per_s']:,.0f}</td>"
        f'<td data-daskgen="samples-{i}">{r["samples"]:,}</td><td>{r["restarts"]}</td>'
        f'<td data-daskgen="version-{i}">{_version(r.get("policy_version"))}</td>{_images(r, i) if images else ""}</tr>'
        for i, r in enumerate(rows)
    )
    return f'<div class="dg"><h2>Workers</h2><table class="dg-tab" data-daskgen="workers">{head}{body}</table></div>'


def _version(version: int | None) -> str:
    return "—" if version is None else str(version)


def _slots_flag(row: dict[str, Any]) -> str:
    """A flag when the worker's thread slots cap its window below what its engine wants, else ``""``."""
    slots, wanted = row.get("slots"), row.get("wanted") or 0
    if slots is None or wanted <= slots:
        return ""
    return (
        f' <b class="dg-flag" data-daskgen="slots-short" title="dask worker --nthreads {wanted}">'
        f"{slots} thread slots / {wanted} wanted</b>"
    )


def _meter(fraction: float) -> str:
    """A small bar of ``fraction`` of the batch slots (full at the admission target of 2)."""
    width = max(0.0, min(1.0, fraction / 2))
    return f'<span class="dg-meter"><span style="width:{100 * width:.0f}%"></span></span><b>{100 * fraction:.0f}%</b>'


def _length_columns(hist: dict[str, Any]) -> dict[str, list[Any]]:
    edges = hist["edges"]
    n = max(0, len(edges) - 1)
    data: dict[str, list[Any]] = {"left": edges[:-1], "right": edges[1:]}
    for reason in REASON_LABELS:
        data[reason] = hist["counts"].get(reason, [0] * n)
    return data


def _length_figure(source: Any) -> Any:
    fig = _figure("Response length of finished samples by finish reason")
    from bokeh.transform import stack

    for i, reason in enumerate(REASON_LABELS):
        below = stack(*REASON_LABELS[:i]) if i else 0
        fig.quad(
            left="left",
            right="right",
            bottom=below,
            top=stack(*REASON_LABELS[: i + 1]),
            source=source,
            color=FINISH_COLORS[reason],
            line_color="white",
            legend_label=reason,
        )
    fig.xaxis.axis_label = "response tokens"
    fig.yaxis.axis_label = "samples"
    fig.y_range.start = 0
    fig.legend.location = "top_right"
    return fig


def _version_columns(versions: dict[str, list[int]]) -> dict[str, list[Any]]:
    data: dict[str, list[Any]] = {k: list(versions.get(k, [])) for k in ("version", "samples", "continued")}
    data["label"] = [str(v) for v in data["version"]]
    return data


def _version_figure(source: Any) -> Any:
    from bokeh.models import FactorRange, HoverTool

    fig = _figure("Samples per policy version (of their first token)", x_range=FactorRange())
    fig.vbar(x="label", top="samples", width=0.7, source=source, color=VERSION_COLOR, legend_label="samples")
    fig.vbar(x="label", top="continued", width=0.4, source=source, color=CONTINUED_COLOR, legend_label="continued")
    tips = [("version", "@label"), ("samples", "@samples{0,0}"), ("continued on a newer version", "@continued{0,0}")]
    fig.add_tools(HoverTool(tooltips=tips))
    fig.xaxis.axis_label = "policy version (0: the run's model)"
    fig.yaxis.axis_label = "samples"
    fig.y_range.start = 0
    fig.legend.location = "top_right"
    return fig
