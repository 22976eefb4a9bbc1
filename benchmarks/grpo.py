"""The GRPO example's reward per policy version, over several runs: what ``examples/async-grpo/trainer.py`` learns.

Each run is ``python examples/async-grpo/reward_curve.py --start-run`` on the tiny test model (built in the scratch
folder) with one of ``--seeds`` (the run's seed), ``--versions`` versions trained and published and ``--prompts``
prompts: a ``daskgen run --refresh continue`` beside the guide's GRPO trainer, which publishes a version (the first
in full, then deltas) after every step.  The record gives, per run and per policy version (of the sample's first
token), the samples generated on it and their mean reward (a complete answer within the run's 4 new tokens), the
reward of version 0 against that of the versions >= ``--after``, the steps' staleness and deltas, and the plot of
the first run, drawn by the example (``rewards.png``).

    python benchmarks/grpo.py                          # 4 runs: seeds 0,0,1,2
    python benchmarks/grpo.py --seeds 0 --no-record
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import cli, records
from common.records import REPO

EXAMPLE = REPO / "examples" / "async-grpo" / "reward_curve.py"
TITLE = "GRPO example: reward per policy version on the tiny model (refresh continue, delta versions)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--seeds", default="0,0,1,2", help="comma-separated seeds, one run each")
    p.add_argument("--versions", type=int, default=6, help="versions each run trains and publishes")
    p.add_argument("--after", type=int, default=4, help="the reward of the versions from this one on is compared")
    cli.add_flags(p, prompts=64)
    return cli.parse(p, argv)


def read_csv(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


def one_run(a: argparse.Namespace, model: Path, out: Path, seed: int) -> tuple[list[dict], list[dict], float]:
    """The example's per-version rows and per-step rows, and its wall time."""
    command = [
        *(sys.executable, str(EXAMPLE), str(out / "grpo.zarr"), "--model", str(model), "--start-run"),
        *("--out", str(out), "--seed", str(seed)),
        *("--versions", str(a.versions), "--prompts", str(a.prompts)),
    ]
    # the example and the run it starts import daskgen from $DASKGEN_SRC
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(records.DASKGEN_SRC), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    took = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{EXAMPLE.name} failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    return read_csv(out / "rewards.csv"), read_csv(out / "steps.csv"), took


def mean_of(rows: list[dict], keep: Any) -> float:
    """The mean reward of the samples of the versions ``keep`` accepts (weighted by their samples; NaN: none)."""
    chosen = [r for r in rows if keep(int(r["version"]))]
    samples = sum(int(r["samples"]) for r in chosen)
    return sum(float(r["reward_sum"]) for r in chosen) / samples if samples else float("nan")


def part_grpo(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Every seed, one run each."""
    from daskgen.models import build_tiny_model

    model = build_tiny_model(work / "tiny", seed=0)
    per_version, summary, step_rows = [], [], []
    for i, seed in enumerate(int(s) for s in a.seeds.split(",") if s.strip()):
        versions, steps, took = one_run(a, model, work / f"run{i}", seed)
        per_version += [[i, seed, r["version"], r["samples"], r["mean_reward"]] for r in versions]
        before, after = mean_of(versions, lambda v: v == 0), mean_of(versions, lambda v: v >= a.after)
        staleness = [int(s["max_staleness"]) for s in steps]
        deltas = [int(s["delta_bytes"]) for s in steps if int(s["delta_bytes"])]
        sizes = [min(deltas), max(deltas)] if deltas else ["—", "—"]
        summary.append([i, seed, before, after, after - before, max(staleness), *sizes, took])
        step_rows += [[i, seed, s["step"], s["mean_reward"], s["max_staleness"], s["delta_bytes"]] for s in steps]
        if i == 0:
            picture = rec.plot_path(cli.plot_folder(a), "grpo")
            shutil.copyfile(work / f"run{i}" / "rewards.png", picture)
            rec.plot(picture)
    rec.table(
        ["run", "seed", "reward, version 0", f"reward, versions >= {a.after}", "rise", "max staleness",
         "smallest delta bytes", "largest delta bytes", "wall s"],
        summary,
        f"{a.prompts} prompts x 16 samples, 4 new tokens, {a.versions} versions (a GRPO step of 4 prompt groups "
        "each); the reward is the share of samples that end with end-of-sequence. Staleness: the version trained "
        "on behind the newest published when the step began.",
    )  # fmt: skip
    rec.table(["run", "seed", "policy version", "samples", "mean reward"], per_version, "Per policy version.")
    rec.table(["run", "seed", "step", "batch mean reward", "max staleness", "delta bytes"], step_rows, "Per step.")


PARTS = {"grpo": part_grpo}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
