"""Your own GRPO trainer beside a daskgen run, safe to kill at any point: every sample is trained on exactly once.

    daskgen run --config rollouts.yaml --model tiny-model &
    python trainer.py rollouts.zarr --model tiny-model --out checkpoints

It follows the run's store (``daskgen.follow``, ``auto_ack=False``): each batch holds whole prompt groups.  Per
batch it takes one policy-gradient step with group-relative advantages (each sample's reward minus its group's
mean, over the group's standard deviation; the importance ratio against the log-probabilities the run stored),
then, in this order:

1. saves a checkpoint: the weights, the optimizer, the step, the number of the batch it trained on and the
   samples it trained on, written into ``OUT/step-N.tmp`` and renamed to ``OUT/step-N`` (the rename is the
   commit: a folder without ``.tmp`` is complete);
2. acknowledges the batch (``batch.ack()``): the store records that the cursor has it;
3. publishes the checkpoint as policy version N (``daskgen.publish_policy``), which the run loads into its engines.

Started again after a crash it loads the newest checkpoint, publishes it if that had not happened yet, and
follows the same cursor: a batch the checkpoint already holds (delivered again because the crash came before
its acknowledgement) is acknowledged without a step.  ``--crash-at POINT --crash-batch N`` kills the trainer
(SIGKILL) at that point of batch N, to try the guide's crash table: ``step`` (after the step, before the
checkpoint), ``checkpoint`` (after the checkpoint, before the acknowledgement), ``ack`` (after it, before the
publication).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import daskgen
from daskgen.errors import PolicyVersionError

CRASH_POINTS = ("step", "checkpoint", "ack")


def reward(row: dict[str, Any]) -> float:
    """1.0 for a response that ended by itself (finish reason ``stop``), 0.0 for one cut at ``max_new_tokens``."""
    return float(row["finish_reason"] == "stop")


def advantages(rows: list[dict[str, Any]]) -> list[float]:
    """Each sample's reward minus its group's mean, over the group's standard deviation (0 when all are equal)."""
    groups: dict[str, list[float]] = {}
    for row in rows:
        groups.setdefault(row["prompt_id"], []).append(reward(row))
    out = []
    for row in rows:
        values = groups[row["prompt_id"]]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        out.append((reward(row) - mean) / std if std > 0 else 0.0)
    return out


def step(model: Any, optimizer: Any, rows: list[dict[str, Any]]) -> float:
    """One optimizer step of the clipped policy-gradient objective over the batch's response tokens; the loss."""
    import torch

    optimizer.zero_grad()
    losses = []
    for row, advantage in zip(rows, advantages(rows), strict=True):
        prompt, response = row["prompt_ids"], row["response_ids"]
        if advantage == 0.0 or not response:
            continue
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # the positions predicting the response
        new = torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        ratio = torch.exp(new - torch.tensor(row["logprobs"], dtype=torch.float32))
        losses.append(-torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.2) * advantage).mean())
    if not losses:
        return 0.0
    loss = torch.stack(losses).mean()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def newest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint folder of the highest step (``step-N`` without ``.tmp``), or None."""
    done = [p for p in out.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def save_checkpoint(out: Path, model: Any, tokenizer: Any, optimizer: Any, state: dict[str, Any]) -> Path:
    """Write the checkpoint of ``state["step"]`` beside, then rename it into place; its folder."""
    import torch

    final = out / f"step-{state['step']}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a half-written one from a crash
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    (tmp / "trainer.json").write_text(json.dumps(state))
    for path in tmp.iterdir():  # durable before the rename commits it
        with path.open("rb") as fh:
            os.fsync(fh.fileno())
    os.replace(tmp, final)
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return final


def publish(store: str, folder: Path, version: int) -> None:
    """Publish ``folder`` as ``version``; a version published before the crash is left as it is."""
    with contextlib.suppress(PolicyVersionError):  # already published: the crash came after the publication
        daskgen.publish_policy(store, str(folder), version)


def crash_here(args: argparse.Namespace, point: str, batch: int) -> None:
    if args.crash_at == point and args.crash_batch == batch:
        print(f"crashing at {point} of batch {batch}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train beside the run until it ends; the final trainer state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="the run's --store")
    parser.add_argument("--model", required=True, help="the run's model folder: the first policy")
    parser.add_argument("--out", type=Path, required=True, help="the checkpoints' folder")
    parser.add_argument("--batch-prompts", type=int, default=2, help="prompt groups per step")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cursor", default="grpo", help="the follower's name (its position in the store)")
    parser.add_argument("--crash-at", choices=CRASH_POINTS, help="SIGKILL the trainer at this point ...")
    parser.add_argument("--crash-batch", type=int, default=1, help="... of the batch with this number")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    latest = newest_checkpoint(args.out)
    start = latest or Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(start)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    state: dict[str, Any] = {"step": 0, "batch": -1, "trained": []}
    if latest is not None:
        optimizer.load_state_dict(torch.load(latest / "optimizer.pt"))
        state = json.loads((latest / "trainer.json").read_text())
        publish(args.store, latest, state["step"])  # the crash may have come before the publication
        print(f"resumed from {latest.name}: batch {state['batch']}, {len(state['trained'])} samples trained")

    follower = daskgen.follow(args.store, batch_prompts=args.batch_prompts, cursor=args.cursor, format="rows",
                              auto_ack=False)  # fmt: skip
    for batch in follower:
        if batch.number <= state["batch"]:  # in the checkpoint already: delivered again, not acknowledged then
            print(f"batch {batch.number}: already trained, acknowledged again")
            batch.ack()
            continue
        rows = batch.data
        loss = step(model, optimizer, rows)
        crash_here(args, "step", batch.number)
        state = {
            "step": state["step"] + 1,
            "batch": batch.number,
            "trained": state["trained"] + [[r["prompt_id"], int(r["sample"])] for r in rows],
        }
        folder = save_checkpoint(args.out, model, tokenizer, optimizer, state)
        crash_here(args, "checkpoint", batch.number)
        batch.ack()
        crash_here(args, "ack", batch.number)
        publish(args.store, folder, state["step"])
        versions = sorted({int(r["policy_version"]) for r in rows})
        print(f"batch {batch.number}: {len(rows)} samples of versions {versions}, loss {loss:.4f}, "
              f"published version {state['step']}")  # fmt: skip
    print(f"{len(state['trained'])} samples trained in {state['step']} steps")
    return state


if __name__ == "__main__":
    main()
