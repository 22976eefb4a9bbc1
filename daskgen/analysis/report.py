"""A report of a store as one HTML page (self-contained) or one PNG.

Panels: prompts by status, response length by finish reason, throughput over time (done
prompts and response tokens per minute, from the per-prompt ``committed_at`` commit times) and
the run's settings; for the latest run with an engine record, engine versus committed tokens/s and the
per-worker balance (:mod:`daskgen.analysis.report_engines`); the HTML adds length statistics, the run
history and the first errors.
Drawn with matplotlib's Agg backend (no display needed); statistics come from
:mod:`daskgen.analysis.accessor`, so the report also works while a run writes the store.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from daskgen.analysis.palette import FINISH_COLORS
from daskgen.analysis.report_engines import ENGINE_PANELS, draw_balance, draw_engine_throughput, latest_record
from daskgen.errors import ExportError
from daskgen.store.attrs import StoreAttrs
from daskgen.store.generation_store import GenerationStore

__all__ = ["PANELS", "ReportData", "collect", "write_report"]

#: Panel titles, in the order they appear (the tests look for them).
PANELS = (
    "Prompts by status",
    "Response length by finish reason",
    "Prompts per minute",
    "Tokens per minute",
    "Settings",
)
_COLORS = {
    **FINISH_COLORS,
    "pending": "#90a4ae",
    "done": "#2e7d32",
    "failed": "#c62828",
}
_MAX_BARS = 60
#: Bars of the length histogram start at their bin and are separated by thin white lines.
_LENGTH_BAR_STYLE = {"align": "edge", "edgecolor": "white", "linewidth": 0.3}


@dataclass
class ReportData:
    """Everything a report shows, computed once from the store."""

    path: str
    attrs: StoreAttrs
    counts: dict[str, int]
    totals: dict[str, int]
    histogram: Any  # xarray.DataArray (finish_reason, length)
    stats: Any  # pandas.DataFrame
    rate: Any  # pandas.DataFrame
    errors: list[tuple[int, str]]
    engines: tuple[int, dict[str, Any]] | None = None  # (run number, engine record) of the latest recorded run


def collect(path: str | Path) -> ReportData:
    """Read the statistics a report needs (status first: a consistent snapshot during a run)."""
    from daskgen.analysis.accessor import open_store

    ds = open_store(path)
    acc = ds.daskgen
    failed = acc.rows("failed")[:5]
    errors = [(int(i), str(e)) for i, e in zip(failed, ds["error"].isel(prompt=failed).values, strict=True)]
    totals = acc.totals()
    return ReportData(
        str(path),
        acc.attrs,
        {k: totals[k] for k in ("done", "pending", "failed")},
        totals,
        acc.length_histogram(),
        acc.length_stats(),
        acc.throughput(),
        errors,
        latest_record(acc.attrs),
    )


# -- panels ---------------------------------------------------------------------------------------
def draw_counts(ax: Any, data: ReportData) -> None:
    """Bar chart of prompts done / pending / failed."""
    names = list(data.counts)
    values = [data.counts[n] for n in names]
    bars = ax.bar(names, values, color=[_COLORS[n] for n in names])
    ax.bar_label(bars, labels=[f"{v:,}" for v in values], padding=2)
    ax.set_ylim(0, max(max(values), 1) * 1.15)
    ax.set_ylabel("prompts")
    ax.set_title(f"{PANELS[0]} (of {data.totals['total']:,})")


def draw_lengths(ax: Any, data: ReportData) -> None:
    """Stacked histogram of response lengths of done samples, one colour per finish reason."""
    hist = data.histogram
    step = max(1, int(np.ceil(len(hist["length"].values) / _MAX_BARS)))
    bottom = _stack_length_bars(ax, hist, step)
    ax.set_xlabel("response tokens" + (f" (bins of {step})" if step > 1 else ""))
    ax.set_ylabel("samples")
    ax.set_title(PANELS[1])
    if bottom.sum():
        ax.legend(title="finish reason", fontsize=8, title_fontsize=8)
    else:
        _empty(ax, "no done samples yet")


def _stack_length_bars(ax: Any, hist: Any, step: int) -> np.ndarray:
    """Draw one bar layer per finish reason (``step`` lengths per bar) on top of the previous; the stack heights."""
    edges = hist["length"].values[::step]
    bottom = np.zeros(len(edges))
    for label in hist["finish_reason"].values:
        counts = hist.sel(finish_reason=label).values
        if not counts.sum():
            continue
        binned = np.add.reduceat(counts, np.arange(0, len(counts), step))
        color = _COLORS.get(str(label), "#5c6bc0")
        label_text = f"{label} ({int(counts.sum()):,})"
        ax.bar(edges, binned, width=step, bottom=bottom, color=color, label=label_text, **_LENGTH_BAR_STYLE)
        bottom += binned
    return bottom


def draw_rate(ax: Any, data: ReportData, column: str) -> None:
    """Done prompts (or response tokens) per minute over commit time."""
    import matplotlib.dates as mdates

    title = PANELS[2] if column == "prompts" else PANELS[3]
    ax.set_title(title)
    rate = data.rate
    if not len(rate):
        _empty(ax, "nothing committed yet")
        return
    width = rate.attrs.get("bin_seconds", 60.0)
    starts = mdates.date2num(rate["start"].dt.tz_localize(None).to_numpy())
    per_min = rate[f"{column}_per_min"].to_numpy()
    ax.bar(starts, per_min, width=width / 86400, align="edge", color="#1565c0" if column == "prompts" else "#6a1b9a")
    ax.set_ylabel(f"{column} / min")
    ax.yaxis.set_major_formatter(lambda value, _pos: f"{value:,.0f}")
    _label_time_axis(ax, rate, column, starts, width)


def _label_time_axis(ax: Any, rate: Any, column: str, starts: np.ndarray, width: float) -> None:
    """Label, tick and bound the commit-time axis of a rate panel (``starts`` as matplotlib date numbers)."""
    import matplotlib.dates as mdates

    total = int(rate[column].sum())
    day = rate["start"].iloc[0].strftime("%Y-%m-%d")
    ax.set_xlabel(f"commit time (UTC, from {day})\nbins of {width:g} s; {total:,} {column} in all")
    ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=6))
    ax.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M:%S" if len(rate) * width < 86400 else "%m-%d %H:%M"))
    ax.set_xlim(starts[0], starts[-1] + width / 86400)


def _empty(ax: Any, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="#757575")


def settings_rows(data: ReportData) -> list[tuple[str, str]]:
    """(name, value) rows: model, engine, sampling settings, input, tokenizer, versions, runs."""
    attrs = data.attrs
    rows = [("store", data.path), ("created", attrs.created)]
    if attrs.simulated:
        rows.append(("SIMULATED", "engine output is simulated, not model output"))
    identity, source = attrs.identity, attrs.input
    rows += [(k, json.dumps(v) if isinstance(v, (dict, list)) else str(v)) for k, v in identity.items()]
    rows.append(("input", f"{source.get('n_prompts')} prompts, {source.get('fingerprint')}"))
    rows.append(("tokenizer", _tokenizer_summary(attrs.tokenizer)))
    rows.append(("versions", ", ".join(f"{k} {v}" for k, v in attrs.versions.items() if v)))
    rows.append(("runs", str(len(attrs.runs))))
    totals = data.totals
    rows.append(("tokens (done)", f"{totals['prompt_tokens']:,} prompt, {totals['response_tokens']:,} response"))
    return rows


def _tokenizer_summary(tok: dict[str, Any]) -> str:
    """The tokenizer's name, vocabulary size and pad/eos ids on one line."""
    return (
        f"{tok.get('name')} (vocab {tok.get('vocab_size')}, pad {tok.get('pad_token_id')}, "
        f"eos {tok.get('eos_token_id')})"
    )


def draw_settings(ax: Any, data: ReportData) -> None:
    """The settings as a compact table: two (name, value) column pairs."""
    ax.axis("off")
    ax.set_title(PANELS[4], loc="left")
    rows = [(k, v if len(v) <= 62 else v[:59] + "...") for k, v in settings_rows(data)]
    half = (len(rows) + 1) // 2
    left, right = rows[:half], rows[half:] + [("", "")] * (2 * half - len(rows))
    cells = [[*a, *b] for a, b in zip(left, right, strict=True)]
    table = ax.table(
        cellText=cells, colWidths=[0.11, 0.39, 0.11, 0.39], loc="upper center", cellLoc="left", edges="horizontal"
    )
    table.auto_set_font_size(False)
    table.set_fontsize(8.5)
    for (_, col), cell in table.get_celld().items():
        cell.set_edgecolor("#dddddd")
        if col in (0, 2):
            cell.get_text().set_fontweight("bold")


# -- output ---------------------------------------------------------------------------------------
def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise ExportError(
            "reports need matplotlib: pip install 'daskgen[analysis]' (or: pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _headline(data: ReportData) -> str:
    identity = data.attrs.identity
    warn = "   [SIMULATED engine: not model output]" if data.attrs.simulated else ""
    return f"daskgen store {Path(data.path).name}: {identity.get('model')} via {identity.get('engine')}{warn}"


def render_png(data: ReportData, out: Path) -> None:
    """All panels in one PNG."""
    plt = _pyplot()
    rows = 4 if data.engines else 3
    fig = plt.figure(figsize=(15, 11 + 3.5 * (rows - 3)), dpi=110, layout="constrained")
    grid = fig.add_gridspec(rows, 3, height_ratios=[1, 1, 1, 0.75][4 - rows :])
    draw_counts(fig.add_subplot(grid[0, 0]), data)
    draw_lengths(fig.add_subplot(grid[0, 1:]), data)
    draw_rate(fig.add_subplot(grid[1, :2]), data, "prompts")
    draw_rate(fig.add_subplot(grid[1, 2]), data, "tokens")
    if data.engines:
        draw_engine_throughput(fig.add_subplot(grid[2, :2]), data.engines)
        draw_balance(fig.add_subplot(grid[2, 2]), data.engines)
    draw_settings(fig.add_subplot(grid[rows - 1, :]), data)
    fig.suptitle(_headline(data), fontsize=13)
    fig.savefig(out, format="png")
    plt.close(fig)


def _panel_png(draw: Any, data: ReportData, *args: Any, size: tuple[float, float] = (9, 4)) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=size, dpi=100, layout="constrained")
    draw(ax, data, *args)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def render_html(data: ReportData, out: Path) -> None:
    """A self-contained HTML page: one embedded PNG per plot, tables for numbers and settings."""
    parts = [f"<h1>{html.escape(_headline(data))}</h1>", *_image_sections(data), *_table_sections(data)]
    out.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>daskgen report</title>"
        f"<style>{_HTML_STYLE}</style></head><body>{''.join(parts)}</body></html>",
        encoding="utf-8",
    )


_HTML_STYLE = (
    "body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse}th,td{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left}"
    "img{max-width:100%}"
)


def _image_sections(data: ReportData) -> list[str]:
    """One HTML section per plot panel, each with its PNG embedded as base64."""
    esc = html.escape
    images = [
        (PANELS[0], _panel_png(draw_counts, data, size=(6, 3.5))),
        (PANELS[1], _panel_png(draw_lengths, data)),
        (PANELS[2], _panel_png(draw_rate, data, "prompts")),
        (PANELS[3], _panel_png(draw_rate, data, "tokens")),
    ]
    if data.engines:
        images.append((ENGINE_PANELS[0], _panel_png(lambda ax, d: draw_engine_throughput(ax, d.engines), data)))
        images.append((ENGINE_PANELS[1], _panel_png(lambda ax, d: draw_balance(ax, d.engines), data)))
    return [
        f'<section><h2>{esc(title)}</h2><img alt="{esc(title)}" src="data:image/png;base64,{png}"></section>'
        for title, png in images
    ]


def _table_sections(data: ReportData) -> list[str]:
    """HTML sections of numbers: length statistics, settings, the run history and the first errors (if any)."""
    esc = html.escape
    stats = data.stats.to_html(float_format="%.2f")
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in settings_rows(data))
    parts = [
        f"<section><h2>Response length statistics</h2>{stats}</section>",
        f"<section><h2>{PANELS[4]}</h2><table>{rows}</table></section>",
    ]
    runs = data.attrs.runs
    if runs:
        parts.append("<section><h2>Runs</h2><pre>" + esc("\n".join(json.dumps(r) for r in runs)) + "</pre></section>")
    if data.errors:
        items = "".join(f"<li>row {i}: {esc(msg)}</li>" for i, msg in data.errors)
        parts.append(f"<section><h2>First errors</h2><ul>{items}</ul></section>")
    return parts


def write_report(path: str | Path, out: str | Path, *, overwrite: bool = False) -> Path:
    """Write the report of the store at ``path`` to ``out`` (``.html`` or ``.png``, by suffix)."""
    from daskgen.analysis.output import check_output, staged_output

    out = Path(out)
    kind = out.suffix.lower()
    if kind not in (".html", ".htm", ".png"):
        raise ExportError(f"report output {str(out)!r} must end in .html or .png")
    GenerationStore.open(path)  # a clear error when no store is there, before anything is written
    check_output(out, overwrite=overwrite, protect=path)
    _pyplot()
    data = collect(path)
    with staged_output(out, overwrite=overwrite, protect=path) as tmp:
        (render_png if kind == ".png" else render_html)(data, tmp)
    return out
