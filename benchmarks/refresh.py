"""Policy refresh cost: time from a publish to every worker generating on the new version, and tokens lost.

One ``daskgen run --refresh drain`` and one ``--refresh continue`` (``--policies``) of the ``transformers``
engine on a LocalCluster of ``--workers`` workers (one torch thread each), over more prompts than they finish,
so the engines stay busy.  Once the first commit landed and a warm-up interval passed, the run goes on for
``--steady`` intervals of ``--interval`` seconds with no publish (the steady state), then ``--versions``
intervals each opened by publishing the next checkpoint (``save_pretrained`` of the model's weights, each
multiplied by ``1 + --noise × N(0, 1)``, made before the run: ``refresh_check.checkpoints``).  Then the run
is stopped (SIGTERM) and read:

* **notice / loaded**: from the policy record's publish time to each worker's recorded state
  (``daskgen.policy.workers/<worker>.json``, polled every 50 ms) showing the version loading, then running;
  the figure is the slowest worker (every worker generating on the new version);
* **first sample**: from the publish to the commit (``committed_at``) of the first sample with tokens of the
  new version (``policy_version_end``);
* **tokens/s**: response tokens of the prompts committed in each interval (by ``committed_at``) over its
  length; the loss of a refresh is the median steady interval's tokens minus the tokens of the interval it
  opens (in tokens and in seconds of steady generation), and finer bins of ``--bin`` seconds around each
  publish show where the loss falls.

Workers read the record once per ``daskgen.policy.poll-interval`` (``--poll``, 1 s by default), which bounds the
notice.

``--publish full,delta`` runs each policy twice: versions published in full (each worker's engine reads the
checkpoint folder), then as deltas (``publish_policy(..., delta=True)`` after a first full version: the workers of
the node rebuild each version once in their cache).  ``--changed`` makes each checkpoint change that share of the
values only (as an optimizer step leaves most bfloat16 values unchanged; ``benchmarks/delta.py``).  Per version, a
table gives what the refresh cost the workers as they recorded it (``refresh_costs.py``): bytes read from shared
storage, the rebuild, the serving pause next to the engine's own load-from-memory time.

``--engine sglang`` or ``vllm`` runs the in-process engine of that name (in its lane's virtualenv, as
``overhead_engine.py`` does; one worker: each of those engines keeps a 2-core machine busy) and refreshes it
through its own weight-update call.

    python benchmarks/refresh.py                             # the tiny model, ~5 minutes on 2 cores
    python benchmarks/refresh.py --model "$(python -m daskgen.models smollm2)" --interval 30
    <vllm lane venv>/bin/python benchmarks/refresh.py --engine vllm --workers 1 --model <tiny model, 32-wide heads>
    python benchmarks/refresh.py --publish full,delta --changed 0.02 --policies continue
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records
from common.prompts import builtin_prompts
from follow import launch
from overhead_engine import ENGINE_ARGS
from refresh_check import checkpoints
from refresh_costs import (
    CARRIED_HEADER,
    COST_HEADER,
    carried_rows,
    cost_rows,
    fill_baseline,
    memory_load_seconds,
    prefill_rate,
    read_bandwidth,
    weight_bytes,
)

TITLE = "Policy refresh: publish to every worker on the new version, and throughput lost per refresh"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    cli.add_flags(p, workers=2, prompts=20000, max_new_tokens=64, partition_size=4)
    p.add_argument("--model", default=None, help="model folder (default: the tiny model, built in the workdir)")
    p.add_argument("--engine", default="transformers", choices=sorted(ENGINE_ARGS), help="the in-process engine")
    p.add_argument("--max-requests", type=int, default=16, help="sglang/vllm: requests the engine runs at once")
    p.add_argument("--policies", default="drain,continue", help="comma-separated `refresh` policies, one run each")
    p.add_argument("--versions", type=int, default=3, help="checkpoints published per run (K)")
    p.add_argument("--steady", type=int, default=2, help="intervals with no publish before the first one")
    p.add_argument("--interval", type=float, default=20.0, help="seconds between publishes (and interval length)")
    p.add_argument("--bin", type=float, default=2.0, help="seconds per tokens/s bin around each publish")
    p.add_argument("--noise", type=float, default=0.02, help="relative weight perturbation of each checkpoint")
    p.add_argument("--window", default="auto", help="partitions in flight per worker (daskgen run --window)")
    p.add_argument("--publish", default="full", help="comma-separated: full, delta (one run each per policy)")
    p.add_argument("--changed", type=float, default=1.0, help="share of each tensor's values a checkpoint changes")
    p.add_argument("--poll", default="1s", help="daskgen.policy.poll-interval of the workers")
    return cli.parse(p, argv)


# --------------------------------------------------------------------------- the model


def base_model(a: argparse.Namespace, work: Path) -> str:
    """``--model``, else the tiny model built in ``work`` (32-wide heads for vLLM's CPU kernels)."""
    if a.model:
        return str(a.model)
    from daskgen.models import build_tiny_model

    return str(build_tiny_model(work / "tiny", seed=0, **({"head_dim": 32} if a.engine == "vllm" else {})))


# --------------------------------------------------------------------------- one run


class StatePoller(threading.Thread):
    """Reads every worker's policy state each 50 ms; keeps the first record of each (worker, state, version)."""

    def __init__(self, store: Path) -> None:
        super().__init__(daemon=True)
        from daskgen import store as stores

        self.location, self.seen, self.halt = stores.locate(store), {}, threading.Event()
        self.records: dict[tuple[str, str, int], Any] = {}

    def run(self) -> None:
        from daskgen.store.policy import read_worker_policies

        while not self.halt.wait(0.05):
            for w in read_worker_policies(self.location):
                version = w.asked if w.state == "loading" else w.version
                self.seen.setdefault((w.worker, w.state, version), epoch(w.time))
                self.records.setdefault((w.worker, w.state, version), w)


def epoch(iso: str) -> float:
    """Seconds since the epoch of an ISO 8601 time."""
    return dt.datetime.fromisoformat(iso).timestamp()


def engine_args(a: argparse.Namespace) -> dict[str, Any]:
    """The engine's ``engine_args``: one torch thread for transformers, the CPU settings of
    ``overhead_engine.ENGINE_ARGS`` for sglang and vllm."""
    if a.engine == "transformers":
        return {"device": "cpu", "num_threads": 1}
    return ENGINE_ARGS[a.engine](argparse.Namespace(max_requests=a.max_requests, threads=1))


def run_args(a: argparse.Namespace, model: str, prompts: Path, store: Path, policy: str) -> list[str]:
    """The ``daskgen run`` command line of one policy's run."""
    pairs = [f"{key}={value}" for key, value in engine_args(a).items()]
    return [
        *("run", "--prompts", str(prompts), "--store", str(store), "--model", model, "--refresh", policy),
        *("--engine", a.engine, *(x for pair in pairs for x in ("--engine-arg", pair))),
        *("--max-new-tokens", str(a.max_new_tokens), "--max-prompt-tokens", "256", "--temperature", "1"),
        *("--partition-size", str(a.partition_size), "--n-workers", str(a.workers), "--window", str(a.window)),
        "--no-progress",
    ]


def wait_first_commit(store: Path, proc: Any, timeout: float = 900) -> None:
    """Until the run committed once (its engines are loaded and generating)."""
    from daskgen import store as stores
    from daskgen.store.commit_log import read_head

    deadline = time.monotonic() + timeout
    while not ((store / "zarr.json").exists() and read_head(stores.locate(store)) > 0):
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before its first commit:\n{proc.stdout.read()[-4000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no commit within {timeout} s")
        time.sleep(0.1)


def run_policy(
    a: argparse.Namespace, model: str, ckpts: list[Path], work: Path, policy: str, mode: str = "full"
) -> dict[str, Any]:
    """One run under ``policy``: publish each checkpoint at its interval's start (``mode`` delta: each after the
    first as a delta); what the store recorded."""
    import daskgen

    prompts, store = work / "prompts.jsonl", work / f"{policy}-{mode}.zarr"
    settings = {  # the run's only: the record's command line shows what the benchmark was started with
        "DASK_DASKGEN__POLICY__CACHE_DIR": str(work / f"cache-{policy}-{mode}"),
        "DASK_DASKGEN__POLICY__POLL_INTERVAL": a.poll,
    }
    prompts.write_text("".join(json.dumps(r) + "\n" for r in builtin_prompts(a.prompts, 0)))
    proc = launch(run_args(a, model, prompts, store, policy), settings)
    try:
        wait_first_commit(store, proc)
        poller = StatePoller(store)
        poller.start()
        start = time.time() + a.interval  # after a warm-up interval
        bounds = [start + i * a.interval for i in range(a.steady + a.versions + 1)]
        for version, path in enumerate(ckpts, 1):
            time.sleep(max(0.0, bounds[a.steady + version - 1] - time.time()))
            daskgen.publish_policy(store, str(path), version, delta=mode == "delta" and version > 1)
        time.sleep(max(0.0, bounds[-1] - time.time()))
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=600)
        poller.halt.set()
        poller.join()
    finally:
        if proc.poll() is None:
            proc.kill()
    return {
        **{"bounds": bounds, "states": poller.seen, "records": poller.records, **read_run(store)},
        **{"exit": proc.returncode, "out": out},
    }


def read_run(store: Path) -> dict[str, Any]:
    """Per committed prompt: commit time, response tokens, versions; the publish times of the record."""
    from daskgen import store as stores
    from daskgen.store.policy import read_versions

    made = stores.GenerationStore.open(store)
    n, deltas = made.layout.n_prompts, [v for v in read_versions(stores.locate(store)) if v.delta]
    names = ("status", "committed_at", "response_length", "policy_version", "policy_version_end", "version_changed_at")
    got = made.read_region(0, n, names)
    done = np.isfinite(got["committed_at"])
    return {
        "committed_at": got["committed_at"][done],
        "tokens": got["response_length"][done].sum(axis=1),
        "first": got["policy_version"][done],
        "last": got["policy_version_end"][done],
        "changed": got["version_changed_at"][done],
        "published": {v.version: epoch(v.time) for v in read_versions(stores.locate(store))},
        "kinds": {v.version: "full" if v.delta is None else "delta" for v in read_versions(stores.locate(store))},
        "deltas": {v.version: len(stores.locate(store).read_bytes(v.delta) or b"") for v in deltas},
    }


# --------------------------------------------------------------------------- figures


def tokens_between(r: dict[str, Any], t0: float, t1: float) -> int:
    """Response tokens of the prompts committed in ``[t0, t1)``."""
    at = r["committed_at"]
    return int(r["tokens"][(at >= t0) & (at < t1)].sum())


def latency_rows(r: dict[str, Any], workers: list[str]) -> list[list[Any]]:
    """Per published version: notice and loaded (slowest worker), first sample with its tokens, after publish."""
    rows = []
    for version, published in sorted(r["published"].items()):
        loading = [r["states"].get((w, "loading", version)) for w in workers]
        running = [r["states"].get((w, "running", version)) for w in workers]
        stamped = r["committed_at"][(r["last"] >= version).any(axis=1)]
        rows.append(
            [
                version,
                slowest(loading, published),
                slowest(running, published),
                float(stamped.min() - published) if stamped.size else None,
                sum(t is not None for t in running),
            ]
        )
    return rows


def slowest(times: list[float | None], published: float) -> float | None:
    """The latest of ``times`` after ``published`` (``None`` when a worker never recorded it)."""
    return None if not times or None in times else max(t for t in times if t is not None) - published


def throughput_rows(r: dict[str, Any], a: argparse.Namespace) -> tuple[list[list[Any]], float]:
    """Tokens/s per interval (steady, then one per publish) and tokens lost; the median steady tokens/s."""
    b = r["bounds"]
    counts = [tokens_between(r, b[i], b[i + 1]) for i in range(len(b) - 1)]
    steady = float(np.median(counts[: a.steady]))
    rows = []
    for i, count in enumerate(counts):
        lost = steady - count if i >= a.steady else None
        label = f"steady {i + 1}" if i < a.steady else f"after publish {i - a.steady + 1}"
        rows.append([label, count / a.interval, lost, None if lost is None else share(lost, steady / a.interval)])
    return rows, steady / a.interval


def share(value: float, steady_rate: float) -> float | None:
    """``value / steady_rate``; ``None`` (shown as "-") when no tokens were committed in the steady intervals, as
    when partitions commit less often than ``--interval`` on a loaded machine (the record's note says so)."""
    return value / steady_rate if steady_rate > 0 else None


def bin_rows(r: dict[str, Any], a: argparse.Namespace, steady_rate: float) -> list[list[Any]]:
    """Tokens/s in bins of ``--bin`` seconds around the publishes (median over them) / the steady rate."""
    edges = np.arange(-2, int(a.interval // a.bin)) * a.bin
    rows = []
    for lo in edges:
        rates = [tokens_between(r, t + lo, t + lo + a.bin) / a.bin for t in r["published"].values()]
        rows.append(
            [f"{lo:+.0f} to {lo + a.bin:+.0f} s", float(np.median(rates)), share(float(np.median(rates)), steady_rate)]
        )
    return rows


def record_policy(rec: records.Record, a: argparse.Namespace, policy: str, r: dict[str, Any]) -> None:
    """The tables of one policy's run."""
    workers = sorted({w for w, _, _ in r["states"]})
    rec.table(
        [
            "version",
            "notice, slowest worker (s)",
            "loaded on every worker (s)",
            "first sample with its tokens (s)",
            "workers loaded",
        ],
        latency_rows(r, workers),
        f"### `refresh: {policy}`: from the publish (policy record time) to ({len(workers)} workers)",
    )
    rows, rate = throughput_rows(r, a)
    if rate == 0:
        rec.note(
            f"No tokens were committed in the steady interval{'s' if a.steady > 1 else ''} of {a.interval:g} s: its "
            "partitions commit less often than that here, so the shares of the steady rate are not given. Raise "
            "`--interval` (or lower `--partition-size`) for them."
        )
    rec.table(
        ["interval", "tokens/s", "tokens lost vs steady", "seconds of steady generation lost"],
        rows,
        f"Tokens/s by commit time, intervals of {a.interval:g} s; steady (median) {rate:.1f} tokens/s.",
    )
    rec.table(
        ["from the publish", "tokens/s (median over publishes)", "/ steady"],
        bin_rows(r, a, rate),
        "Around each publish, bins by commit time:",
    )
    continued = int((r["changed"] >= 0).sum())
    rec.note(
        f"Samples committed: {r['first'].size:,}; "
        f"continued across a refresh (`version_changed_at` >= 0): {continued:,}; the run's exit code after SIGTERM: "
        f"{r['exit']}."
    )


def part_refresh(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Build the checkpoints once; one run per publish mode and policy; the cost of each refresh."""
    model = base_model(a, work)
    ckpts = checkpoints(model, work / "ckpt", a.versions, a.noise, a.changed)
    baseline, rate = memory_load_seconds(a.engine, ckpts[-1]), prefill_rate(a.engine, Path(model))
    rec.note(
        f"Engine `{a.engine}` ({engine_args(a)}); model {model}; {a.workers} workers (LocalCluster) on a machine of "
        f"{os.cpu_count()} cores shared with other jobs; {a.versions} checkpoints (weights × (1 + "
        f"{a.noise:g} N(0, 1)), {a.changed:g} of each tensor's values changed); publishes every {a.interval:g} s "
        f"after {a.steady} steady intervals, workers polling every {a.poll}; {a.max_new_tokens} new tokens at "
        f"most, temperature 1, partitions of {a.partition_size} prompts, window {a.window}."
    )
    costs = []
    for mode in [m.strip() for m in a.publish.split(",") if m.strip()]:
        for policy in a.policies.split(","):
            run = run_policy(a, model, ckpts, work, policy.strip(), mode)
            rec.note(f"#### Versions published {'in full' if mode == 'full' else 'as deltas'}")
            record_policy(rec, a, policy, run)
            if policy.strip() == "continue":
                record_carried(rec, run, rate)
            costs += cost_rows(mode, policy.strip(), run, version_sizes(run, ckpts), baseline)
    record_costs(rec, a, ckpts[-1], costs, baseline)


def record_carried(rec: records.Record, run: dict[str, Any], rate: float | None) -> None:
    """What each ``continue`` refresh carried onto the new version, beside the engine's prefill rate."""
    shown = "not measured for this engine" if rate is None else f"{rate:,.0f} prompt tokens/s"
    rec.table(
        CARRIED_HEADER,
        carried_rows(run, rate),
        "What each refresh interrupted: requests continued from their tokens so far; the prompt and tokens of those "
        "that had begun to generate, which the engine prefills again on the new weights before they generate on "
        "(each worker's policy state). The "
        f"engine's prefill rate, one forward pass of 512 tokens on one torch thread: {shown}.",
    )


def version_sizes(run: dict[str, Any], ckpts: list[Path]) -> dict[int, int]:
    """Each published version's bytes: a full version's weights, a delta version's delta object."""
    return {v: run["deltas"][v] if kind == "delta" else weight_bytes(ckpts[v - 1]) for v, kind in run["kinds"].items()}


#: How each engine without a separate load-from-memory baseline loads a version in the pause.
LOADS = {
    "sglang": "staged tensors from host memory, `update_weights_from_tensor`",
    "vllm": "`reload_weights` from the copy staged in host memory",
}


def record_costs(
    rec: records.Record, a: argparse.Namespace, ckpt: Path, rows: list[list[Any]], baseline: float | None
) -> None:
    """The per-version cost table, the version's bytes and the page cache's read rate."""
    source = (
        f"`model.load_state_dict` of the version's tensors in memory (one torch thread): {baseline:.3g} s"
        if baseline is not None
        else f"the fastest load of the runs ({LOADS.get(a.engine, 'update_weights')}): {fill_baseline(rows) or 0:.3g} s"
    )
    rec.table(
        COST_HEADER,
        rows,
        f"### What each refresh cost ({a.workers} workers, one node). The engine's own load from memory: {source}. "
        f"Weights per version: {weight_bytes(ckpt):,} bytes, every file of its folder "
        f"{sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file()):,} bytes; page-cache read rate of them: "
        f"{read_bandwidth(ckpt):,.0f} bytes/s. Reads and times as each worker recorded them in its policy state "
        "(`daskgen.policy.workers/`); pause: from the engine holding no request to admitting again.",
    )


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"refresh": part_refresh}))
