"""Refresh at scale: a model of the time from a publish to every worker serving, and of shared-storage reads,
for 16-256 workers, checked against the measured runs of ``benchmarks/refresh.py --publish full,delta``.

The model, for ``N`` workers, ``W`` per node (``M = ceil(N / W)`` nodes), a shared file system of aggregate read
bandwidth ``B`` and a node link of ``L`` (bytes/s), a version of ``S`` weight bytes (``F`` bytes every file of its
folder) and a delta of ``D`` bytes:

* reads from shared storage per version: full ``N·S`` (each engine reads the published folder); delta ``M·D`` (each
  node's first worker rebuilds it once from the node's rebuild of the version before; the first delta after a
  full version reads that version's folder too: ``M·(F + D)``);
* ``t_read``, the time to read a version's weights: for a full version from the shared file system, every worker
  at once, ``max(N·S / B, min(N, W)·S / L)``; for a delta version from the node's cache, ``S / R`` (``R``: the
  page cache's read rate);
* the serving pause per worker: ``t_mem + t_check``, with ``t_mem`` the engine's own load-from-memory time and
  ``t_check`` the check of what it holds, for an engine that stages a version before pausing (``transformers``:
  ``t_stage = t_read + t_hash`` while the engine generates, ``t_hash`` its fingerprint); ``t_mem + t_check +
  t_read`` for an engine that loads from the files in the pause (``vllm``, ``sglang``);
* publish to every worker serving: ``o + t_fetch + t_stage + pause``, with ``o`` the notice and the drain
  (measured: the time to every worker serving minus fetch, stage and pause), and ``t_fetch`` 0 for a full version
  and ``max(M·D / B, D / L) + t_rebuild`` for a delta version, made while the engines generate.

The measured inputs (``S``, ``F``, ``D``, ``t_mem``, ``R``, the medians of ``t_check``, ``t_hash`` (a version's
stage time minus ``S / R``), ``o`` and ``t_rebuild``) are
read from the cost tables of the records named by ``--measured``; a first table puts the model, with ``B = L = R``
and ``N = W`` = the record's workers (one machine, whose page cache is its shared storage), beside each measured
version: reads and pause.  The scaled tables give the shared reads, the pause and the time to every worker serving
for ``--workers`` at ``--per-node`` workers per node, ``--bandwidth`` and ``--node-link``.

    python benchmarks/refresh_scaling.py --measured benchmarks/results/<refresh record>.md
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

from common import cli, records
from refresh_costs import COST_HEADER

TITLE = "Policy refresh at 16-256 workers: a model of shared reads, pause and refresh time, checked on measured runs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--measured", required=True, help="comma-separated refresh records with cost tables")
    p.add_argument("--workers", default="16,32,64,128,256", help="comma-separated worker counts N")
    p.add_argument("--per-node", type=int, default=8, help="workers per node W")
    p.add_argument("--bandwidth", type=float, default=2e9, help="shared file system read bandwidth B (bytes/s)")
    p.add_argument("--node-link", type=float, default=12.5e9, help="a node's link to it L (bytes/s)")
    return cli.parse(p, argv)


@dataclass(frozen=True)
class Measured:
    """A measured run's inputs to the model and its per-version rows (by ``COST_HEADER`` name)."""

    name: str
    workers: int
    weights: int  # S
    files: int  # F
    delta: float  # D (median of the deltas)
    t_mem: float
    read_rate: float  # R
    t_check: float
    overhead: float  # o
    t_rebuild: float
    rows: list[dict[str, Any]]
    t_hash: float = 0.0
    staged: bool = False  # the engine stages a version before pausing (its records' stage times)


def number(text: str) -> float | None:
    """A record's table cell as a number (``-``: ``None``)."""
    text = text.strip().replace(",", "")
    return None if text in ("-", "") else float(text) if re.fullmatch(r"[-+.\deE]+", text) else None


def read_measured(path: Path) -> Measured:
    """The cost table of a refresh record and the figures of its caption."""
    text = path.read_text()
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| " + " | ".join(COST_HEADER[:3])))
    header = [c.strip() for c in lines[start].strip("|").split("|")]  # the record's own columns (older ones lack some)
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows.append({name: number(c) if number(c) is not None else c for name, c in zip(header, cells, strict=True)})
    caption = lines[start - 2]
    workers = int(re.search(r"What each refresh cost \((\d+) workers", caption).group(1))  # type: ignore[union-attr]
    figures = {
        key: float(re.search(pattern, caption).group(1).replace(",", ""))  # type: ignore[union-attr]
        for key, pattern in (
            ("weights", r"Weights per version: ([\d,]+) bytes"),
            ("files", r"every file of its folder ([\d,]+) bytes"),
            ("rate", r"read rate of them: ([\d,]+) bytes/s"),
        )
    }
    model = re.search(r"model (\S+);", text)
    deltas = [r for r in rows if r["kind"] == "delta"]
    timed = [r for r in rows if isinstance(r["pause s, slowest worker"], float)]
    later = [r for r in deltas if r["shared-storage bytes read, all workers"] < figures["weights"]] or deltas
    staged = re.search(r"Engine `(\w+)`", text)
    stages = [r["stage s, slowest worker"] for r in timed if isinstance(r["stage s, slowest worker"], float)]
    return Measured(
        f"{path.stem} ({Path(model.group(1)).name if model else '?'})",
        workers,
        int(figures["weights"]),
        int(figures["files"]),
        median(r["version bytes"] for r in deltas) if deltas else 0.0,
        float(rows[0]["engine load from memory (s)"]),
        figures["rate"],
        median(r["check s, slowest worker"] for r in timed),
        median(r["loaded on every worker (s)"] - sum(_spent(r)) for r in timed),
        median(r["fetch s, slowest worker"] for r in later) if later else 0.0,
        rows,
        median(max(0.0, t - figures["weights"] / figures["rate"]) for t in stages) if stages else 0.0,
        bool(staged and staged.group(1) == "transformers" and stages),
    )


def _spent(row: dict[str, Any]) -> list[float]:
    """A version's measured fetch, stage (``-``: none) and pause of its slowest worker."""
    stage = row["stage s, slowest worker"]
    return [row["fetch s, slowest worker"], stage if isinstance(stage, float) else 0.0, row["pause s, slowest worker"]]


# --------------------------------------------------------------------------- the model


def shared_reads(kind: str, n: int, per_node: int, weights: int, files: int, delta: float, first: bool) -> float:
    """Bytes read from shared storage for one version by ``n`` workers, ``per_node`` per node."""
    nodes = math.ceil(n / per_node)
    return n * weights if kind == "full" else nodes * (delta + (files if first else 0))


def read_time(m: Measured, kind: str, n: int, per_node: int, bandwidth: float, link: float) -> float:
    """Each worker's read of a version's weights: a full one from shared storage, a delta's rebuild locally."""
    on_node = min(n, per_node)
    return max(n * m.weights / bandwidth, on_node * m.weights / link) if kind == "full" else m.weights / m.read_rate


def stage_time(m: Measured, kind: str, n: int, per_node: int, bandwidth: float, link: float) -> float:
    """Staging a version while the engine generates: its read and fingerprint (0 for an engine without staging)."""
    return read_time(m, kind, n, per_node, bandwidth, link) + m.t_hash if m.staged else 0.0


def pause(m: Measured, kind: str, n: int, per_node: int, bandwidth: float, link: float) -> float:
    """The serving pause per worker: load from memory and check, plus the weights' read unless staged."""
    return m.t_mem + m.t_check + (0.0 if m.staged else read_time(m, kind, n, per_node, bandwidth, link))


def refresh_time(m: Measured, kind: str, n: int, per_node: int, bandwidth: float, link: float) -> float:
    """From the publish to every worker serving the version."""
    nodes = math.ceil(n / per_node)
    fetch = 0.0 if kind == "full" else max(nodes * m.delta / bandwidth, m.delta / link) + m.t_rebuild
    return (
        m.overhead
        + fetch
        + stage_time(m, kind, n, per_node, bandwidth, link)
        + pause(m, kind, n, per_node, bandwidth, link)
    )


# --------------------------------------------------------------------------- records


def check_rows(m: Measured) -> list[list[Any]]:
    """The model at the measured configuration (one machine: ``B = L = R``) beside each measured version."""
    out, seen_delta = [], False
    for r in m.rows:
        kind, first = str(r["kind"]), r["kind"] == "delta" and not seen_delta
        seen_delta |= kind == "delta"
        delta = r["version bytes"] if kind == "delta" else 0
        reads = shared_reads(kind, m.workers, m.workers, m.weights, m.files, delta, first)
        modelled = pause(m, kind, m.workers, m.workers, m.read_rate, m.read_rate)
        out.append(
            [m.name, r["publish"], r["version"], kind, reads, r["shared-storage bytes read, all workers"],
             modelled, r["pause s, slowest worker"], r["pause s, slowest worker"] / modelled]
        )  # fmt: skip
    return out


def scaled_rows(m: Measured, a: argparse.Namespace) -> list[list[Any]]:
    """Per worker count: shared reads, pause and refresh time of a full and a (later) delta version."""
    b, link, w = a.bandwidth, a.node_link, a.per_node
    rows = []
    for n in cli.counts(a.workers):
        full_pause, delta_pause = pause(m, "full", n, w, b, link), pause(m, "delta", n, w, b, link)
        rows.append(
            [m.name, n, math.ceil(n / w),
             shared_reads("full", n, w, m.weights, m.files, m.delta, False),
             shared_reads("delta", n, w, m.weights, m.files, m.delta, False),
             stage_time(m, "full", n, w, b, link), stage_time(m, "delta", n, w, b, link),
             full_pause, delta_pause, refresh_time(m, "full", n, w, b, link), refresh_time(m, "delta", n, w, b, link),
             full_pause / m.t_mem, delta_pause / m.t_mem]
        )  # fmt: skip
    return rows


def part_scaling(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """The check on each measured record, then the model at scale."""
    measured = [read_measured(Path(p.strip())) for p in a.measured.split(",") if p.strip()]
    rec.table(
        ["measured run", "S bytes", "F bytes", "D bytes (median)", "t_mem s", "R bytes/s", "t_check s",
         "o s", "t_rebuild s", "staged", "t_hash s"],
        [[m.name, m.weights, m.files, m.delta, m.t_mem, m.read_rate, m.t_check, m.overhead, m.t_rebuild,
          "yes" if m.staged else "no", m.t_hash] for m in measured],
        "Inputs read from the measured records (medians over their versions).",
    )  # fmt: skip
    rec.table(
        ["measured run", "publish", "version", "kind", "shared reads, model", "shared reads, measured",
         "pause s, model", "pause s, measured", "measured / model"],
        [row for m in measured for row in check_rows(m)],
        "### The model beside the measured runs (their workers on one machine: B = L = R, N = W)",
    )  # fmt: skip
    rec.table(
        ["measured run", "workers N", "nodes", "shared reads per version, full", "per delta version",
         "stage s, full", "stage s, delta", "pause s, full", "pause s, delta", "publish to all serving s, full",
         "delta",
         "pause / load from memory, full", "delta"],
        [row for m in measured for row in scaled_rows(m, a)],
        f"### At scale: {a.per_node} workers per node, shared file system B = {a.bandwidth:,.0f} bytes/s, node link "
        f"L = {a.node_link:,.0f} bytes/s",
    )  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"scaling": part_scaling}))
