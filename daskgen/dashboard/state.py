"""The dashboard's picture of a run, built from the workers' and the client's reports (no store reads).

:class:`DashboardState` lives in the scheduler process (held by
:class:`daskgen.dashboard.plugin.DashboardPlugin`); :meth:`DashboardState.ingest` takes each message of
:mod:`daskgen.dashboard.metrics`, :meth:`DashboardState.snapshot` gives the page everything it shows
and :meth:`DashboardState.record` the compact summary a run keeps in its store.

Definitions the page and ``daskgen report`` share:

* **engine tokens**: model tokens of samples that finished on an engine (counted as each sample ends);
  **committed tokens**: response tokens of partitions the client committed to the store.  The
  **gap** is engine minus committed: tokens generated but not yet in the store, mostly finished samples
  waiting for the slowest sample of their partition.
* **batch occupancy**: a worker's unfinished requests (running or queued) over its engine's batch slots.
* **load ratio**: the highest over the lowest engine tokens/s among workers with a ready engine.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daskgen.dashboard.metrics import REASON_LABELS, RUN_TOPIC, WORKER_TOPIC
from daskgen.tail import series_tail_share

#: Seconds over which the page's rates are measured.
RATE_WINDOW_S = 10.0
#: Seconds over which the ETA's prompt rate is measured.
ETA_WINDOW_S = 60.0
#: Points of the throughput series kept (older halves are thinned when it is full).
MAX_POINTS = 4000
#: Points of the series a run keeps in its store.
RECORD_POINTS = 200
#: Bars of the length histogram.
LENGTH_BINS = 40
#: Errors the page lists.
RECENT_ERRORS = 12
#: A worker that sent nothing for this many seconds is shown as silent.
SILENT_AFTER_S = 15.0


@dataclass
class WorkerView:
    """The latest report of one worker and its recent token counts (for tokens/s)."""

    report: dict[str, Any]
    history: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, cumulative tokens, images)

    def update(self, report: dict[str, Any]) -> None:
        """Take a newer report."""
        self.report = report
        self.history.append((report["time"], report["tokens"], report.get("images", 0)))

    def tokens_per_s(self, now: float) -> float:
        """Engine tokens/s over the last :data:`RATE_WINDOW_S` (0 with fewer than two reports)."""
        return self.rate_of("tokens", now)

    def rate_of(self, count: str, now: float) -> float:
        """Per second over the last :data:`RATE_WINDOW_S` of a cumulative count (``tokens``: engine tokens,
        ``images``: images preprocessed); 0 with fewer than two reports."""
        column = 1 if count == "tokens" else 2
        points = [(p[0], p[column]) for p in self.history if p[0] >= now - RATE_WINDOW_S - 1e-9]
        if len(points) < 2 and len(self.history) >= 2:
            points = [(p[0], p[column]) for p in list(self.history)[-2:]]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return 0.0
        return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])


class Series:
    """``(time, engine tokens, committed tokens, committed prompts)`` points, thinned when full."""

    def __init__(self, max_points: int = MAX_POINTS) -> None:
        self.max_points = max_points
        self.points: list[tuple[float, float, float, float]] = []

    def add(self, t: float, engine: float, tokens: float, prompts: float) -> None:
        """Append a point (every other point of the older half is dropped when the series is full)."""
        self.points.append((t, engine, tokens, prompts))
        if len(self.points) > self.max_points:
            half = len(self.points) // 2
            self.points = self.points[:half:2] + self.points[half:]

    def columns(self) -> np.ndarray:
        """The points as a ``(4, n)`` array."""
        return np.asarray(self.points, dtype=float).reshape(-1, 4).T


def _rate(t: np.ndarray, v: np.ndarray, window: float) -> np.ndarray:
    """``v``'s rate of change at each ``t``, measured over the ``window`` seconds before it."""
    if len(t) < 2:
        return np.zeros(len(t))
    earlier = np.maximum(t - window, t[0])
    span = t - earlier
    delta = v - np.interp(earlier, t, v)
    return np.divide(delta, span, out=np.zeros(len(t)), where=span > 0)


class DashboardState:
    """Everything the dashboard knows about the current run."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the run (a new run began on this scheduler)."""
        self.run: dict[str, Any] | None = None
        self.workers: dict[str, WorkerView] = {}
        self.series = Series()
        self.pending: list[tuple[float, float, float]] = []  # run reports waiting for later worker reports
        self.latest = 0.0  # time of the newest message
        self.lengths: dict[str, np.ndarray] = {}
        self.errors: deque = deque(maxlen=RECENT_ERRORS)

    # -- ingest ------------------------------------------------------------------------------------
    def ingest(self, topic: str, msg: dict[str, Any]) -> None:
        """Take one message of :data:`WORKER_TOPIC` or :data:`RUN_TOPIC` (others are ignored)."""
        if topic == WORKER_TOPIC:
            self._ingest_worker(msg)
        elif topic == RUN_TOPIC:
            self._ingest_run(msg)

    def _ingest_worker(self, msg: dict[str, Any]) -> None:
        view = self.workers.setdefault(msg["worker"], WorkerView(msg))
        before = view.report if view.history else {}
        if msg.get("error") and (
            msg["error"] != before.get("error") or msg.get("restarts", 0) > before.get("restarts", 0)
        ):
            self.errors.append((msg["time"], msg["worker"], msg["error"]))
        view.update(msg)
        for reason, lengths in (msg.get("lengths") or {}).items():
            counts = np.bincount(np.asarray(lengths, dtype=np.int64))
            known = self.lengths.get(reason, np.zeros(0, dtype=np.int64))
            if len(known) < len(counts):
                known = np.concatenate([known, np.zeros(len(counts) - len(known), dtype=np.int64)])
            known[: len(counts)] += counts
            self.lengths[reason] = known
        self.latest = max(self.latest, msg["time"])
        self._resolve()

    def _ingest_run(self, msg: dict[str, Any]) -> None:
        if self.run is not None and msg["run"] != self.run["run"]:
            self.reset()
        self.run = msg
        for row, message in msg.get("errors") or []:
            self.errors.append((msg["time"], f"row {row}", message))
        self.pending.append((msg["time"], msg["committed_tokens"], msg["committed_prompts"]))
        self.latest = max(self.latest, msg["time"])
        self._resolve(final=msg.get("state") == "finished")

    def _resolve(self, final: bool = False) -> None:
        """Add the run reports to the series once every reporting worker has reported after them.

        Workers report on their own clock ticks; a worker's engine tokens at a run report's time are
        interpolated between its reports before and after it, so the engine and committed totals of a
        point refer to the same moment (their difference is the gap).  At the end of a run, the
        workers' last reports are final and every waiting point is added.
        """
        if not self.pending:
            return
        live = [w.report["time"] for w in self.workers.values() if w.report["time"] > self.latest - SILENT_AFTER_S]
        horizon = math.inf if final or not live else min(live)
        while self.pending and self.pending[0][0] <= horizon:
            t, tokens, prompts = self.pending.pop(0)
            self.series.add(t, self._engine_at(t), tokens, prompts)

    def _engine_at(self, t: float) -> float:
        """Engine tokens of all workers at time ``t`` (interpolated between each worker's reports)."""
        total = 0.0
        for view in self.workers.values():
            times, tokens, _ = zip(*view.history, strict=True)
            total += float(np.interp(t, times, tokens, left=0.0))
        return total

    def engine_tokens(self) -> int:
        """Tokens generated by every engine that reported (departed workers included)."""
        return sum(int(w.report["tokens"]) for w in self.workers.values())

    # -- views -------------------------------------------------------------------------------------
    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """Everything the page shows, computed now."""
        now = time.time() if now is None else now
        workers = self.worker_rows(now)
        return {
            "run": self.run,
            "progress": self.progress(),
            "throughput": self.throughput(),
            "workers": workers,
            "load_ratio": load_ratio(workers),
            "lengths": self.length_histogram(),
            "versions": self.policy_versions(),
            "errors": [{"time": t, "source": s, "message": m} for t, s, m in reversed(self.errors)],
        }

    def progress(self) -> dict[str, Any]:
        """Prompt counts, ETA (seconds), tail share so far and the latest engine/committed totals."""
        run = self.run or {}
        cols = self.series.columns()
        out = {k: run.get(k, 0) for k in ("total", "done", "failed", "pending", "committed_prompts")}
        out["engine_tokens"] = self.engine_tokens()
        out["committed_tokens"] = run.get("committed_tokens", 0)
        out["gap_tokens"] = int(max(0.0, cols[1][-1] - cols[2][-1])) if len(cols[0]) else 0  # as of the last point
        out["state"] = run.get("state", "waiting for a run")
        out["eta_s"] = _eta(cols, out["pending"], run.get("state"))
        started = run.get("started")
        out["tail_share"] = None if started is None else series_tail_share(cols[0], cols[3], started)
        out["elapsed_s"] = (run["time"] - run["started"]) if run.get("started") else None
        return out

    def throughput(self) -> dict[str, list[float]]:
        """Engine and committed tokens/s over time (rates over :data:`RATE_WINDOW_S`), the gap in tokens, and
        the totals so far at each point (engine tokens, committed tokens, committed prompts)."""
        t, engine, committed, prompts = self.series.columns()
        return {
            "time": t.tolist(),
            "engine": _rate(t, engine, RATE_WINDOW_S).tolist(),
            "committed": _rate(t, committed, RATE_WINDOW_S).tolist(),
            "gap": np.maximum(engine - committed, 0).tolist(),
            "engine_tokens": engine.tolist(),
            "committed_tokens": committed.tolist(),
            "committed_prompts": prompts.tolist(),
        }

    def worker_rows(self, now: float) -> list[dict[str, Any]]:
        """One row per worker: state, occupancy, partitions admitted/running, tokens/s, samples, restarts."""
        rows = []
        for address, view in sorted(self.workers.items()):
            r = view.report
            capacity = r.get("capacity") or 0
            silent = now - r["time"] > SILENT_AFTER_S
            rows.append(
                {
                    "worker": address,
                    "state": "silent" if silent else r.get("state", "?"),
                    "occupancy": (r.get("outstanding", 0) / capacity) if capacity else 0.0,
                    "outstanding": r.get("outstanding", 0),
                    "capacity": capacity,
                    "window": r.get("window") or 0,
                    "running": r.get("running", 0),
                    "wanted": r.get("wanted") or 0,
                    "slots": r.get("slots"),
                    "tokens_per_s": 0.0 if silent else view.tokens_per_s(now),
                    "tokens": r["tokens"],
                    "samples": r["samples"],
                    "partitions": r.get("partitions", 0),
                    "restarts": r.get("restarts", 0),
                    "policy_version": r.get("policy_version"),
                    "images": r.get("images", 0),
                    "images_per_s": 0.0 if silent else view.rate_of("images", now),
                    "image_wait_s": r.get("image_wait_s", 0.0),
                }
            )
        return rows

    def policy_versions(self) -> dict[str, list[int]]:
        """Samples finished per policy version of their first token, over every worker that reported (departed
        ones included), and of those how many were continued onto a newer version; in increasing version."""
        totals: dict[int, list[int]] = {}
        for view in self.workers.values():
            for version, samples, continued in view.report.get("versions") or []:
                counts = totals.setdefault(int(version), [0, 0])
                counts[0] += int(samples)
                counts[1] += int(continued)
        versions = sorted(totals)
        return {
            "version": versions,
            "samples": [totals[v][0] for v in versions],
            "continued": [totals[v][1] for v in versions],
        }

    def length_histogram(self) -> dict[str, Any]:
        """Response lengths of finished samples by finish reason (:func:`bin_lengths`)."""
        return bin_lengths(self.lengths, int((self.run or {}).get("max_new_tokens") or 0))

    def record(self) -> dict[str, Any]:
        """What a run keeps in its store: totals per worker, samples per policy version and a thinned throughput
        series."""
        t, engine, committed, prompts = self.series.columns()
        start = (self.run or {}).get("started") or (float(t[0]) if len(t) else 0.0)
        keep: list[int] = np.unique(np.linspace(0, len(t) - 1, min(len(t), RECORD_POINTS)).round()).astype(int).tolist()
        fields = ("tokens", "samples", "partitions", "restarts")
        return {
            "start": start,
            "engine_tokens": self.engine_tokens(),
            "committed_tokens": int((self.run or {}).get("committed_tokens", 0)),
            "workers": {a: {k: int(w.report.get(k, 0)) for k in fields} for a, w in sorted(self.workers.items())},
            "versions": self.policy_versions(),
            "series": {
                "seconds": [round(float(t[i] - start), 2) for i in keep],
                "engine_tokens": [int(engine[i]) for i in keep],
                "committed_tokens": [int(committed[i]) for i in keep],
                "committed_prompts": [int(prompts[i]) for i in keep],
            },
        }


def bin_lengths(counts: Mapping[str, np.ndarray], max_new_tokens: int) -> dict[str, Any]:
    """The length histogram's bars: ``counts[reason][n]`` samples of ``n`` tokens, in :data:`LENGTH_BINS` bars
    of equal integer width spanning ``0 .. max(longest, max_new_tokens)``.

    Returns ``{"edges": [...], "counts": {reason: [...]}}`` (bar ``i`` counts lengths in
    ``edges[i] <= n < edges[i + 1]``); reasons without samples are left out.
    """
    longest = max((len(c) - 1 for c in counts.values() if len(c)), default=0)
    top = max(longest, max_new_tokens, 1)
    width = max(1, math.ceil((top + 1) / LENGTH_BINS))
    n_bins = math.ceil((top + 1) / width)
    bars = {}
    for reason in REASON_LABELS:
        c = counts.get(reason)
        if c is not None and c.sum():
            padded = np.zeros(n_bins * width, dtype=np.int64)
            padded[: len(c)] = c
            bars[reason] = padded.reshape(n_bins, width).sum(axis=1).tolist()
    return {"edges": (np.arange(n_bins + 1) * width).tolist(), "counts": bars}


def load_ratio(workers: list[dict[str, Any]]) -> float | None:
    """Highest over lowest tokens/s among ready workers; ``None`` with fewer than two, ``inf`` if one is idle."""
    rates = [w["tokens_per_s"] for w in workers if w["state"] == "ready"]
    if len(rates) < 2 or max(rates) <= 0:
        return None
    return math.inf if min(rates) <= 0 else max(rates) / min(rates)


def _eta(cols: np.ndarray, pending: int, state: str | None) -> float | None:
    """Seconds until every pending prompt is committed at the prompt rate of the last :data:`ETA_WINDOW_S`."""
    t, _, _, prompts = cols
    if state == "finished" or not pending or len(t) < 2:
        return 0.0 if state == "finished" or (len(t) and not pending) else None
    rate = _rate(t, prompts, ETA_WINDOW_S)[-1]
    return pending / rate if rate > 0 else None
