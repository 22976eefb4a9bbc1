"""GRPO on CPU beside a daskgen run: the run serves each new policy version in place, the reward rises.

    python -m daskgen.models tiny tiny-model
    python examples/grpo.py --model tiny-model --store grpo.zarr --out grpo-out --start-run

With ``--start-run`` the trainer writes ``--prompts`` prompt rows into ``--out`` and starts, in the background,
``daskgen run --refresh continue --logprobs`` on them (``--n-samples`` samples per prompt, one worker, one
partition of ``--batch-prompts`` prompts in flight); without it, it follows a run started by hand with the same
settings (``--refresh continue --logprobs``, temperature 1, several samples per prompt) on ``--model``.

The reward is verifiable from the tokens alone: 1 when the response is a complete answer, ending with the model's
end-of-sequence token within the run's ``max_new_tokens``, else 0.  Each batch of finished prompt groups
(``daskgen.follow``, acknowledged by hand after the step) makes one GRPO step in plain torch: each sample's
advantage is its reward minus its group's mean, over the group's standard deviation (a group is a prompt's
samples); the loss is the clipped policy-gradient objective on the stored response tokens, with the importance
ratio of the trainer's policy against the log-probabilities the run stored (the behaviour policy: the version,
or under ``continue`` the versions, that generated each token).  After each step the weights (float32 in the
trainer) are saved in bfloat16 and published as the next policy version: the first in full, the others as
deltas (``publish_policy(..., delta=True)``).  After ``--versions`` versions the trainer stops learning and
takes the rest of the run's samples, generated on the newest versions, as they come.

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
import time
from pathlib import Path
from typing import Any

import daskgen
from daskgen import store
from daskgen.store.fingerprint import digest_number
from daskgen.store.policy import read_versions

#: The bounds of the importance ratio in the clipped objective (PPO's and GRPO's usual 0.2).
CLIP = 0.2
#: The gradient's norm is clipped to this before each step: no single batch moves the policy far.
MAX_GRAD_NORM = 1.0


def reward(response_ids: list[int], eos_ids: set[int]) -> float:
    """1.0 when the response is a complete answer: it ends with an end-of-sequence token, else 0.0."""
    return float(bool(response_ids) and response_ids[-1] in eos_ids)


def eos_ids(model: Any) -> set[int]:
    """The model's end-of-sequence token ids (its generation config's and its config's)."""
    found: set[int] = set()
    for source in (model.generation_config, model.config):
        value = getattr(source, "eos_token_id", None)
        found |= {value} if isinstance(value, int) else set(value or ())
    return found


def advantages(rewards: list[float], groups: list[str]) -> list[float]:
    """Group-relative advantages: each reward minus its group's mean, over the group's standard deviation
    (0 for every sample of a group whose rewards are all equal: it teaches nothing)."""
    by_group: dict[str, list[float]] = {}
    for r, g in zip(rewards, groups, strict=True):
        by_group.setdefault(g, []).append(r)
    stats = {}
    for g, values in by_group.items():
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        stats[g] = (mean, std)
    return [(r - stats[g][0]) / stats[g][1] if stats[g][1] > 0 else 0.0 for r, g in zip(rewards, groups, strict=True)]


def response_logprobs(model: Any, rows: list[dict[str, Any]]) -> list[Any]:
    """Per sample, the log-probability ``model`` gives each of its response tokens (one padded forward pass)."""
    import torch

    width = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens = row["prompt_ids"] + row["response_ids"]
        ids[i, : len(tokens)] = torch.tensor(tokens)
        attention[i, : len(tokens)] = 1
    hidden = model.base_model(input_ids=ids, attention_mask=attention).last_hidden_state
    head = model.get_output_embeddings()
    out = []
    for i, row in enumerate(rows):
        start, n = len(row["prompt_ids"]), len(row["response_ids"])
        logits = head(hidden[i, start - 1 : start + n - 1]).float()  # the positions that predict the response
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(row["response_ids"])[:, None])[:, 0])
    return out


def grpo_step(model: Any, optimizer: Any, rows: list[dict[str, Any]], advantage: list[float]) -> tuple[float, float]:
    """One optimizer step of the GRPO objective on the response tokens of ``rows``; the loss and the gradient's
    norm before clipping.

    Per token: the advantage weighted by the importance ratio of ``model`` against the stored log-probabilities
    of the behaviour policy, clipped to ``1 +- CLIP`` (the smaller of the two); every sample weighs the same (its
    tokens' mean).  No KL term: the clipped ratio and the clipped gradient keep each step small."""
    import torch

    chosen = [(r, a) for r, a in zip(rows, advantage, strict=True) if r["response_ids"] and a != 0.0]
    if not chosen:
        return 0.0, 0.0
    optimizer.zero_grad()
    losses = []
    for (row, a), new in zip(chosen, response_logprobs(model, [r for r, _ in chosen]), strict=True):
        ratio = torch.exp(new - torch.tensor(behaviour_logprobs(row)))
        objective = torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a)
        losses.append(-objective.mean())
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return float(loss.detach()), float(norm)


def behaviour_logprobs(row: dict[str, Any]) -> list[float]:
    """The log-probabilities the run stored for the sample's response tokens (``daskgen run --logprobs``)."""
    stored = row.get("logprobs")
    if stored is None or len(stored) != len(row["response_ids"]) or any(v is None for v in stored):
        raise ValueError(
            f"sample {row['prompt_id']} #{row['sample']} has no stored log-probability for every response token "
            f"(found {stored!r:.60}); GRPO's importance ratio needs them: run with --logprobs"
        )
    return [float(v) for v in stored]


def publish(model: Any, tokenizer: Any, folder: Path, out: str, version: int) -> int:
    """Save the weights in bfloat16 into ``folder`` and publish them as ``version`` (a delta after the first);
    the bytes the store keeps for it (the delta's, or 0 for a full version, which the workers read in place)."""
    import torch

    state = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
    model.save_pretrained(folder, state_dict=state)
    tokenizer.save_pretrained(folder)
    entry = daskgen.publish_policy(out, str(folder), version, delta=version > 1)
    if entry.delta is None:
        return 0
    return len(store.locate(out).read_bytes(entry.delta) or b"")


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


def check_fingerprints(out: str, samples: list[tuple[int, int]]) -> int:
    """How many samples' ``policy_fingerprint`` differs from their version's published digest (0 for version 0)."""
    digests = {0: 0} | {v.version: digest_number(v.digest) for v in read_versions(store.locate(out))}
    return sum(fingerprint != digests.get(version) for version, fingerprint in samples)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the run's model folder (the trainer starts from it)")
    parser.add_argument("--store", required=True, help="the run's store")
    parser.add_argument("--out", type=Path, required=True, help="folder for checkpoints, CSVs and the plot")
    parser.add_argument("--start-run", action="store_true", help="start the daskgen run in the background")
    parser.add_argument("--versions", type=int, default=6, help="policy versions to train and publish")
    parser.add_argument("--batch-prompts", type=int, default=4, help="prompt groups per GRPO step")
    parser.add_argument("--n-samples", type=int, default=16, help="samples per prompt (the group), with --start-run")
    parser.add_argument("--prompts", type=int, default=64, help="prompt rows, with --start-run")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="the response budget, with --start-run")
    parser.add_argument("--lr", type=float, default=1e-2, help="Adam's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="torch's seed and the run's")
    parser.add_argument("--threads", type=int, default=1, help="the trainer's torch threads (the rest: the run's)")
    parser.add_argument("--poll-interval", default="0.2s", help="how often the run's workers look for a new version")
    parser.add_argument("--cursor", default="grpo", help="the follower's name (its position in the store)")
    return parser.parse_args(argv)


def train(args: argparse.Namespace, model: Any, tokenizer: Any, optimizer: Any, batch: Any, rewards: list[float],
          version: int) -> dict[str, Any]:  # fmt: skip
    """One GRPO step on ``batch`` (its samples' ``rewards``) and the publish of its result as ``version``; the
    step's row of ``steps.csv``."""
    rows = batch.data
    started = time.perf_counter()
    loss, norm = grpo_step(model, optimizer, rows, advantages(rewards, [r["prompt_id"] for r in rows]))
    stepped = time.perf_counter()
    size = publish(model, tokenizer, args.out / f"v{version}", args.store, version)
    step = {
        **{"step": version, "batch": batch.number, "samples": len(rows)},
        **{"mean_reward": round(sum(rewards) / len(rows), 4), "loss": round(loss, 5), "grad_norm": round(norm, 4)},
        "max_staleness": max(version - 1 - int(r["policy_version"]) for r in rows),  # behind the newest published
        **{"published": version, "delta_bytes": size, "step_s": round(stepped - started, 3)},
        "publish_s": round(time.perf_counter() - stepped, 3),
    }
    kind = f"a delta of {size} bytes" if size else "in full"
    print(f"step {version}: batch {batch.number}, mean reward {step['mean_reward']:.3f}, version {version} {kind}")
    return step


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train beside the run; return the per-version rewards, the steps and the fingerprint mismatches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    eos = eos_ids(model)
    run = start_run(args) if args.start_run else None
    per_version: dict[int, list[float]] = {}
    steps: list[dict[str, Any]] = []
    fingerprints: list[tuple[int, int]] = []
    try:
        follower = daskgen.follow(args.store, batch_prompts=args.batch_prompts, cursor=args.cursor, format="rows",
                                  auto_ack=False)  # fmt: skip
        for batch in follower:
            rewards = [reward(r["response_ids"], eos) for r in batch.data]
            for r, value in zip(batch.data, rewards, strict=True):
                per_version.setdefault(int(r["policy_version"]), []).append(value)
                fingerprints.append((int(r["policy_version"]), int(r["policy_fingerprint"])))
            if len(steps) < args.versions:
                steps.append(train(args, model, tokenizer, optimizer, batch, rewards, len(steps) + 1))
            batch.ack()  # after the step and its publish: a restarted trainer never takes this batch again
    except BaseException:
        if run is not None:
            run.terminate()  # the run stops within its grace, keeping what it generated
        raise
    if run is not None and run.wait(timeout=600) != 0:
        raise SystemExit(f"the daskgen run failed (exit {run.returncode}); see {args.out / 'run.log'}")
    table = write_results(args.out, per_version, steps)
    for row in table:
        print(f"version {row['version']}: {row['samples']} samples, mean reward {row['mean_reward']:.3f}")
    mismatched = check_fingerprints(args.store, fingerprints)
    print(f"{len(fingerprints)} samples, {mismatched} with a fingerprint other than their version's published one")
    return {"rewards": table, "steps": steps, "mismatched": mismatched}


if __name__ == "__main__":
    sys.exit(1 if main()["mismatched"] else 0)
