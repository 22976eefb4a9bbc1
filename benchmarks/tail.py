"""Benchmark (issue: keep engines full on any length distribution): daskgen's default ``window: auto``
against the best fixed window, on three length distributions, and what ``--length-hints`` adds.

For each distribution the same job (simulated engines, 2 workers; samples of one prompt have similar
lengths: ``--length-prompt-share`` of the log-length variance belongs to the prompt) is

* **emulated** with zero pipeline overhead (``common.simulation.emulate_streaming``, an exact event simulation of
  the step model) for fixed windows of 1..64 partitions per worker, and for the ``window: auto``
  occupancy rule (:class:`daskgen.worker.admission.Admission`), in input order and in the order length
  hints give (partitions by the longest response another seed's run got for their prompts,
  :func:`daskgen.client.dispatch.long_first`);
* **measured**: ``runner.run`` with default settings on a LocalCluster, timed from engines ready to the last
  commit (makespan in model seconds = wall / ``time_scale``); then again with ``length_hints`` pointing at
  a real earlier store of the same prompts made with another seed.

Reported: best emulated fixed window / default measured — the issue's goal is >= 0.97 —, measured / emulated
rule (what Dask, the store and the compressed time of this machine add), the same with hints, the tail share
(the last 10 % of prompts' share of the generating time) and the peak of prompts in flight (memory).
``time_scale`` (wall seconds per model second) must leave the simulated engines' own Python time per step
small against a step (0.05: a step of 256 requests is 3.5 ms of wall time).

    python benchmarks/tail.py                      # ~20 minutes on 2 cores
    python benchmarks/tail.py --prompts 512 --no-record
    python benchmarks/tail.py --repeat 3 --no-hints   # the spread of the measured runs (~35 minutes)
    python benchmarks/tail.py --prompts 16384 --emulate-only   # a larger job, emulated only (~2 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records, runs, simulation
from common.prompts import prompt_rows

#: name -> (lognormal mean, sigma); the first is a lognormal with median 400 and sigma 1.6 (mean 400·e^1.28).
DISTRIBUTIONS = {
    "long tail (median 400, sigma 1.6)": (400 * float(np.exp(1.6**2 / 2)), 1.6),
    "long tail (mean 2048, sigma 1.0)": (2048.0, 1.0),
    "light tail (mean 512, sigma 0.3)": (512.0, 0.3),
}
FIXED = (1, 2, 4, 8, 16, 32, 64)


def lengths_of(a: argparse.Namespace, d: argparse.Namespace, work: Path, prompts: list[str], seed: int) -> np.ndarray:
    """Every sample's length (row order, samples of a row together) in a run with ``seed``."""
    tag = f"{d.length_mean:.0f}-{d.length_sigma:g}-{seed}"
    config = simulation.make_config(argparse.Namespace(**{**vars(d), "seed": seed}), work / f"req-{tag}.zarr", "auto")
    requests = runs.run_requests(config, prompts)
    return np.array(asyncio.run(simulation.instant_shard(requests, simulation.engine_args(d)))["lengths"])


def hint_store(d: argparse.Namespace, work: Path, prompts: list[str]) -> Path:
    """An earlier daskgen store of the same prompts (another seed), generated at once (``time_scale`` 0)."""
    from daskgen.client.runner import run

    path = work / f"earlier-{d.length_mean:.0f}-{d.length_sigma:g}.zarr"
    earlier = argparse.Namespace(**{**vars(d), "seed": d.seed + 1, "time_scale": 0.0})
    if not run(simulation.make_config(earlier, path, "auto"), prompts).ok:
        raise SystemExit(f"the run making the length-hints store {path} did not finish")
    return path


def one(a: argparse.Namespace, work: Path, name: str, mean: float, sigma: float) -> list[Any]:
    """Emulate and measure one distribution (in input order and with length hints); the table row."""
    from daskgen import store
    from daskgen.client.dispatch import long_first
    from daskgen.config import RunConfig

    d = argparse.Namespace(**{**vars(a), "length_mean": mean, "length_sigma": sigma})
    prompts = prompt_rows(a.prompts)
    lengths = lengths_of(a, d, work, prompts, a.seed)
    per = a.partition_size * a.n_samples
    parts = [lengths[i : i + per] for i in range(0, len(lengths), per)]
    # the order --length-hints gives: partitions by the longest response of another seed's run
    earlier = lengths_of(a, d, work, prompts, a.seed + 1).reshape(a.prompts, a.n_samples).max(axis=1)
    starts = list(range(0, a.prompts, a.partition_size))
    limit = RunConfig().max_prompts_in_memory // 2 // a.partition_size  # what plan.pending_tasks allows
    longest, rest = long_first(starts, earlier.astype(float), a.partition_size, limit)
    hinted = [parts[s // a.partition_size] for s in longest + rest]

    def emulate(partitions: list[np.ndarray], window: int, occupancy: bool = False) -> float:
        return simulation.emulate_streaming(
            partitions, a.workers, window, a.max_batch, a.step_base, a.step_per_seq, occupancy=occupancy
        )["makespan"]

    fixed = {w: emulate(parts, w) for w in FIXED}
    best_w = min(fixed, key=fixed.get)
    start = simulation.auto_window(d)
    rule, rule_hinted = emulate(parts, start, True), emulate(hinted, start, True)

    def measure(tag: str, **extra: Any) -> tuple[float, dict[str, Any]]:
        path = work / f"{tag}-{mean:.0f}-{sigma:g}.zarr"
        config = simulation.make_config(d, path, "auto")
        for key, value in extra.items():
            setattr(config, key, value)
        side = runs.run_streaming(config, prompts, d.time_scale, d.sample_period)
        return side.makespan_model_s, store.read_store_attrs(path).runs[-1]

    if a.emulate_only:
        return [
            name,
            f"{lengths.mean():.0f} / {np.percentile(lengths, 99):.0f}",
            f"{fixed[best_w]:,.0f} (w={best_w})",
            f"{rule:,.0f}",
            fixed[best_w] / rule,
            f"{rule_hinted:,.0f}",
            fixed[best_w] / rule_hinted,
            rule / rule_hinted,
        ]
    measured = [measure(f"default{i}") for i in range(a.repeat)]
    spans = [span for span, _ in measured]
    ratios = [fixed[best_w] / span for span in spans]
    row = [
        name,
        f"{lengths.mean():.0f} / {np.percentile(lengths, 99):.0f}",
        f"{fixed[best_w]:,.0f} (w={best_w})",
        f"{rule:,.0f}",
        " / ".join(f"{span:,.0f}" for span in spans),
        records.spread(ratios),
        records.spread([span / rule for span in spans]),
    ]
    tail = " / ".join(f"{last.get('tail_share'):.3f}" for _, last in measured)
    peak = " / ".join(f"{last.get('peak_prompts_in_flight'):,}" for _, last in measured)
    if a.no_hints:
        return [*row, tail, peak]
    measured_hinted, last_hinted = measure("hinted", length_hints=str(hint_store(d, work, prompts)))
    return [
        *row,
        f"{rule_hinted:,.0f}",
        f"{measured_hinted:,.0f}",
        fixed[best_w] / measured_hinted,
        f"{tail} / hints {last_hinted.get('tail_share'):.3f}",
        f"{peak} / hints {last_hinted.get('peak_prompts_in_flight'):,}",
    ]


def main() -> int:
    p = cli.parser(__doc__)
    cli.add_flags(p, workers=2, prompts=4096, n_samples=4, max_new_tokens=16384, partition_size=64)
    cli.add_flags(p, sample_period=0.05, seed=0)
    simulation.add_engine_flags(p, time_scale=0.05)
    p.add_argument(
        "--length-prompt-share",
        type=float,
        default=0.7,
        help="share of the log-length variance that belongs to the prompt (samples of one prompt alike)",
    )
    p.add_argument("--repeat", type=int, default=1, help="measured runs per distribution (their spread is reported)")
    p.add_argument("--no-hints", action="store_true", help="skip the measured run with --length-hints")
    p.add_argument(
        "--only", default="", help="comma-separated distribution numbers (1-3) to run, in the order of the table"
    )
    p.add_argument(
        "--emulate-only",
        action="store_true",
        help="only the zero-overhead emulation (deterministic, independent of the machine's load); the "
        "ratio columns then compare the best fixed window with the emulated rule",
    )
    a = cli.parse(p)
    items = list(DISTRIBUTIONS.items())
    try:
        a.distributions = [items[int(x) - 1] for x in a.only.split(",") if x.strip()] or items
    except (ValueError, IndexError):
        p.error(f"--only takes distribution numbers 1-{len(items)}, not {a.only!r}")
    cli.quiet_logs()
    rec = records.Record(
        "Tail: window auto (occupancy) vs the best fixed window, three length distributions"
        + (" (emulated only)" if a.emulate_only else "")
    )
    with cli.workdir(a.workdir) as work:
        rows = [one(a, work, name, mean, sigma) for name, (mean, sigma) in a.distributions]
    header = (
        [
            "distribution",
            "mean / p99 length",
            "best fixed window, emulated (model s)",
            "auto rule, emulated",
            "best / auto rule",
            "auto rule + length hints, emulated",
            "best / auto rule with hints",
            "speed-up from hints",
        ]
        if a.emulate_only
        else [
            "distribution",
            "mean / p99 length",
            "best fixed window, emulated (model s)",
            "auto rule, emulated",
            "default, measured" + (f" ({a.repeat} runs)" if a.repeat > 1 else ""),
            "best emulated / measured (goal ≥ 0.97)",
            "measured / auto emulated (overhead)",
            *(
                []
                if a.no_hints
                else [
                    "auto rule + length hints, emulated",
                    "default + --length-hints, measured",
                    "best emulated / measured with hints",
                ]
            ),
            "tail share (last 10% of prompts)",
            "peak prompts in flight",
        ]
    )
    rec.table(
        header,
        rows,
        f"{a.prompts:,} prompts × {a.n_samples} samples, {a.workers} simulated engines (max_batch "
        f"{a.max_batch}, step {a.step_base} + {a.step_per_seq} × running model s), partitions of "
        f"{a.partition_size} prompts, time_scale {a.time_scale}, {a.length_prompt_share:g} of the log-length "
        "variance per prompt; makespans in model seconds. Emulated = zero-overhead event simulation (fixed "
        "windows and the auto rule in input order; with hints: partitions ordered by another seed's longest "
        "response, as --length-hints does); measured = daskgen with default settings on a LocalCluster, "
        "and with --length-hints an earlier store of the same prompts made with another seed.",
    )
    rec.finish(cli.record_folder(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
