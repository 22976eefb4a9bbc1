"""trainer.py beside a daskgen run that serves each new policy version in place: the reward per version rises.

    python -m daskgen.models tiny tiny-model
    python reward_curve.py grpo.zarr --model tiny-model --out grpo-out --start-run

With ``--start-run`` it writes ``--prompts`` prompt rows into ``--out`` and starts, in the background,
``daskgen run --refresh continue --logprobs`` on them (``--n-samples`` samples per prompt, one worker, one
partition of ``--batch-prompts`` prompts in flight); without it, it follows a run started by hand with the same
settings (``--refresh continue --logprobs``, temperature 1, several samples per prompt) on ``--model``.

The training is ``trainer.py``'s (its reward, advantages, step, checkpoints and publication), with this
script's defaults: 4 prompt groups per step, learning rate 0.01, the published weights in bfloat16, the first
version in full and the others as deltas, and after ``--versions`` (6) versions no more learning: the rest of
the run's samples, generated on the newest versions, are taken as they come.

At the end it writes ``rewards.csv`` (per policy version: the samples generated on it, their mean reward and
the 95 % interval of that mean), ``steps.csv`` (per step: its batch, mean reward, staleness, loss and the
published delta's size) and ``rewards.png`` (the mean reward per version) into ``--out``, and checks that every
sample's ``policy_fingerprint`` is its version's published digest.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import trainer

from daskgen import store
from daskgen.store.fingerprint import digest_number
from daskgen.store.policy import read_versions


def write_prompts(path: Path, n: int) -> Path:
    """``n`` chat prompts with ids."""
    with path.open("w") as fh:
        for i in range(n):
            text = f"Question {i}: what is {i} plus {i % 7}? Answer with the number only."
            fh.write(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


def start_run(args: argparse.Namespace) -> subprocess.Popen:
    """``daskgen run --refresh continue --logprobs`` on ``--prompts`` fresh prompt rows, in the background."""
    prompts = write_prompts(args.out / "prompts.jsonl", args.prompts)
    command = [
        *(sys.executable, "-m", "daskgen", "run", "--prompts", str(prompts), "--model", args.model),
        *("--store", args.store, "--refresh", "continue", "--logprobs", "--temperature", "1"),
        *("--n-samples", str(args.n_samples), "--max-new-tokens", str(args.max_new_tokens)),
        *("--partition-size", str(args.batch_prompts), "--window", "1", "--n-workers", "1"),
        *("--seed", str(args.seed), "--no-progress"),
    ]
    env = {**os.environ, "DASK_DASKGEN__POLICY__POLL_INTERVAL": args.poll_interval}
    return subprocess.Popen(command, stdout=(args.out / "run.log").open("w"), stderr=subprocess.STDOUT, env=env)


def mean_interval(values: list[float]) -> tuple[float, float, float]:
    """The mean of ``values`` (rewards of 0 or 1) and the bounds of its 95 % interval (normal approximation)."""
    mean = sum(values) / len(values)
    half = 1.96 * math.sqrt(mean * (1 - mean) / len(values)) if len(values) > 1 else 0.0
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def write_results(out: Path, per_version: dict[int, list[float]], steps: list[dict[str, Any]]) -> list[dict]:
    """``rewards.csv``, ``steps.csv`` and ``rewards.png`` in ``out``; the rows of ``rewards.csv``."""
    if not steps:
        raise SystemExit("the follower delivered no batch: nothing was trained (is the run writing the store?)")
    rows = []
    for version in sorted(per_version):
        mean, low, high = mean_interval(per_version[version])
        rows.append({"version": version, "samples": len(per_version[version]),
                     "reward_sum": round(sum(per_version[version]), 6), "mean_reward": round(mean, 4),
                     "low95": round(low, 4), "high95": round(high, 4)})  # fmt: skip
    for name, table in (("rewards.csv", rows), ("steps.csv", steps)):
        with (out / name).open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=100)
    versions = [r["version"] for r in rows]
    ax.fill_between(versions, [r["low95"] for r in rows], [r["high95"] for r in rows], alpha=0.25, label="95 %")
    ax.plot(versions, [r["mean_reward"] for r in rows], marker="o", label="mean reward")
    ax.set_xlabel("policy version (of the sample's first token)")
    ax.set_ylabel("reward (a complete answer)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "rewards.png")
    plt.close(fig)
    return rows


def delta_bytes(out: str) -> dict[int, int]:
    """Per published version, the bytes the store keeps for it (its delta's; 0 for a version published in full,
    which the workers read in place)."""
    location = store.locate(out)
    return {v.version: len(location.read_bytes(v.delta) or b"") if v.delta else 0 for v in read_versions(location)}


def check_fingerprints(out: str, samples: list[tuple[int, int]]) -> int:
    """How many samples' ``policy_fingerprint`` differs from their version's published digest (0 for version 0)."""
    digests = {0: 0} | {v.version: digest_number(v.digest) for v in read_versions(store.locate(out))}
    return sum(fingerprint != digests.get(version) for version, fingerprint in samples)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = trainer.parser(__doc__.split("\n\n")[0])
    parser.add_argument("--start-run", action="store_true", help="start the daskgen run in the background")
    parser.add_argument("--n-samples", type=int, default=16, help="samples per prompt (the group), with --start-run")
    parser.add_argument("--prompts", type=int, default=64, help="prompt rows, with --start-run")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="the response budget, with --start-run")
    parser.add_argument("--seed", type=int, default=0, help="the run's seed, with --start-run")
    parser.add_argument("--poll-interval", default="0.2s", help="how often the run's workers look for a new version")
    parser.set_defaults(batch_prompts=4, lr=1e-2, versions=6, publish_dtype="bfloat16", delta=True, threads=1)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train beside the run; return the per-version rewards, the steps and the fingerprint mismatches."""
    args = parse(argv)
    model, tokenizer, optimizer, state = trainer.load(args)
    run = start_run(args) if args.start_run else None
    per_version: dict[int, list[float]] = {}
    steps: list[dict[str, Any]] = []
    fingerprints: list[tuple[int, int]] = []

    def report(rows: list[dict[str, Any]], stepped: dict[str, Any] | None) -> None:
        rewards = [trainer.reward(r) for r in rows]
        for r, value in zip(rows, rewards, strict=True):
            per_version.setdefault(int(r["policy_version"]), []).append(value)
            fingerprints.append((int(r["policy_version"]), int(r["policy_fingerprint"])))
        if stepped is not None:
            steps.append({**stepped, "samples": len(rows), "mean_reward": round(sum(rewards) / len(rows), 4),
                          "max_staleness": max(stepped["step"] - 1 - int(r["policy_version"]) for r in rows),
                          "published": stepped["step"]})  # fmt: skip

    try:
        trainer.train(args, model, tokenizer, optimizer, state, report)
    except BaseException:
        if run is not None:
            run.terminate()  # the run stops within its grace, keeping what it generated
        raise
    if run is not None and run.wait(timeout=600) != 0:
        raise SystemExit(f"the daskgen run failed (exit {run.returncode}); see {args.out / 'run.log'}")
    sizes = delta_bytes(args.store)
    for row in steps:
        row.update(loss=round(row["loss"], 5), grad_norm=round(row["grad_norm"], 4), delta_bytes=sizes[row["step"]])
    table = write_results(args.out, per_version, steps)
    for row in table:
        print(f"version {row['version']}: {row['samples']} samples, mean reward {row['mean_reward']:.3f}")
    mismatched = check_fingerprints(args.store, fingerprints)
    print(f"{len(fingerprints)} samples, {mismatched} with a fingerprint other than their version's published one")
    return {"rewards": table, "steps": steps, "mismatched": mismatched}


if __name__ == "__main__":
    sys.exit(1 if main()["mismatched"] else 0)
