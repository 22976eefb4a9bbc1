"""Scale-out of the long-tail streaming run: weak scaling at 1, 2, 4 workers (simulated engines).

daskgen's runner on the long-tail workload of ``longtail.py`` (simulated engines, one per worker process)
with a fixed number of prompts *per worker* (weak scaling): throughput in generated tokens per model second
should grow with the workers; efficiency = throughput / (workers × one-worker throughput), and the ideal
bound per run as in ``longtail.py``.  ``scaleout.py --part longtail`` runs the same comparison.

    python benchmarks/scaleout_workers.py                  # ~4 minutes on 2 cores
    python benchmarks/scaleout_workers.py --workers 1,2 --prompts-per-worker 64 --no-record
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, dask_floor, records, simulation
from common.prompts import prompt_rows

TITLE = "Scale-out: the long-tail run at 1, 2, 4 workers"


def part_longtail(a: argparse.Namespace, work: Path, rec: records.Record) -> list[dict[str, Any]]:
    """Weak scaling of the long-tail streaming run; the results by worker count."""
    lt = argparse.Namespace(**vars(a), step_base=simulation.STEP_BASE_S, step_per_seq=simulation.STEP_PER_SEQ_S, seed=0)
    cap = simulation.simulated_capacity(lt.max_batch, lt.step_base, lt.step_per_seq)
    window = simulation.auto_window(lt)
    results = []
    for w in cli.counts(a.workers):
        lt.workers = w
        prompts = prompt_rows(a.prompts_per_worker * w)
        config = simulation.make_config(lt, work / f"lt-{w}.zarr", window)
        res = dask_floor.run_measured(config, prompts)
        res["workers"] = w
        res["model_s"] = res["wall"] / lt.time_scale
        res["ideal"] = res["tokens"] / (w * cap)
        results.append(res)
    base = results[0]["tokens"] / results[0]["model_s"] / results[0]["workers"]
    rows = []
    for r in results:
        tput = r["tokens"] / r["model_s"]
        busy = float(np.mean([s["busy_s"] for s in r["stats"]])) / r["model_s"]
        rows.append(
            [
                r["workers"],
                r["prompts"],
                r["model_s"],
                tput,
                tput / (r["workers"] * base),
                r["ideal"] / r["model_s"],
                busy,
                r["prompts"] / r["wall"],
                r["client_cpu"] / r["partitions"],
            ]
        )
    rec.note(
        f"Part longtail: {a.prompts_per_worker} prompts × {a.n_samples} samples per worker, lognormal lengths "
        f"mean {a.length_mean:g} sigma {a.length_sigma:g} capped at {a.max_new_tokens}, max_batch {a.max_batch}, "
        f"time_scale {a.time_scale}, partitions of {a.partition_size}, window {window} per worker."
    )
    rec.table(
        [
            "workers",
            "prompts",
            "makespan (model s)",
            "tokens / model s",
            "scaling efficiency",
            "ideal / makespan",
            "engine busy fraction",
            "prompts / wall s",
            "client CPU s per partition",
        ],
        rows,
    )
    return results


def add_args(p: argparse.ArgumentParser) -> None:
    """This comparison's flags."""
    p.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated")
    cli.add_flags(p, n_samples=4, partition_size=64)
    p.add_argument("--prompts-per-worker", type=int, default=512, help="prompts per worker (weak scaling)")
    cli.add_flags(p, max_batch=256, length_mean=2048.0, length_sigma=1.0, max_new_tokens=16384, time_scale=0.01)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    return cli.parse_parts(__doc__, argv, add_args)


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"longtail": part_longtail}))
