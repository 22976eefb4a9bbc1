"""Your own GRPO trainer beside a daskgen run, safe to kill at any point: every sample is trained on exactly once.

    daskgen run --config rollouts.yaml --model tiny-model &
    python trainer.py rollouts.zarr --model tiny-model --out checkpoints

It follows the run's store (``daskgen.follow``, ``auto_ack=False``): each batch holds whole prompt groups.  Per
batch it takes one step of the clipped GRPO objective in plain torch: each sample's advantage is its reward minus
its group's mean, over the group's standard deviation (a group is a prompt's samples); per response token, the
advantage weighted by the importance ratio of the trainer's policy against the log-probabilities the run stored
(the behaviour policy: the version, or under ``refresh: continue`` the versions, that generated each token),
clipped to ``1 +- CLIP``; the gradient clipped to norm ``MAX_GRAD_NORM``; Adam on float32 weights.  Then, in
this order:

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

``--versions N`` stops learning after N steps (the rest of the run's samples are acknowledged as they come);
``--publish-dtype bfloat16`` saves the published weights in bfloat16 (the checkpoint keeps the float32 ones the
trainer goes on from in ``weights.pt``); ``--delta`` publishes every version after the first as a delta on the
one before.  ``reward_curve.py`` runs this trainer so beside a run it starts and plots the reward per version.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import daskgen
from daskgen.errors import PolicyVersionError

CRASH_POINTS = ("step", "checkpoint", "ack")
#: The bounds of the importance ratio in the clipped objective (PPO's and GRPO's usual 0.2).
CLIP = 0.2
#: The gradient's norm is clipped to this before each step: no single batch moves the policy far.
MAX_GRAD_NORM = 1.0


def reward(row: dict[str, Any]) -> float:
    """1.0 for a response that ended by itself (finish reason ``stop``: the model's end-of-sequence token), 0.0
    for one cut at ``max_new_tokens``."""
    return float(row["finish_reason"] == "stop")


def advantages(rows: list[dict[str, Any]]) -> list[float]:
    """Each sample's reward minus its group's mean, over the group's standard deviation (0 for every sample of a
    group whose rewards are all equal: it teaches nothing)."""
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


def behaviour_logprobs(row: dict[str, Any]) -> list[float]:
    """The log-probabilities the run stored for the sample's response tokens (``logprobs: true``)."""
    stored = row.get("logprobs")
    if stored is None or len(stored) != len(row["response_ids"]) or any(v is None for v in stored):
        raise ValueError(
            f"sample {row['prompt_id']} #{row['sample']} has no stored log-probability for every response token "
            f"(found {stored!r:.60}); GRPO's importance ratio needs them: run with logprobs: true"
        )
    return [float(v) for v in stored]


def step(model: Any, optimizer: Any, rows: list[dict[str, Any]]) -> tuple[float, float]:
    """One optimizer step of the clipped objective over the batch's response tokens; the loss and the gradient's
    norm before clipping.  Every sample weighs the same (its tokens' mean); no KL term: the clipped ratio and the
    clipped gradient keep each step small."""
    import torch

    chosen = [(r, a) for r, a in zip(rows, advantages(rows), strict=True) if r["response_ids"] and a != 0.0]
    if not chosen:
        return 0.0, 0.0
    optimizer.zero_grad()
    losses = []
    for (row, a), new in zip(chosen, response_logprobs(model, [r for r, _ in chosen]), strict=True):
        ratio = torch.exp(new - torch.tensor(behaviour_logprobs(row)))
        losses.append(-torch.minimum(ratio * a, ratio.clamp(1 - CLIP, 1 + CLIP) * a).mean())
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    return float(loss.detach()), float(norm)


def newest_checkpoint(out: Path) -> Path | None:
    """The complete checkpoint folder of the highest step (``step-N`` without ``.tmp``), or None."""
    done = [p for p in out.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]
    return max(done, key=lambda p: int(p.name[5:]), default=None)


def save_checkpoint(out: Path, model: Any, tokenizer: Any, optimizer: Any, state: dict[str, Any], dtype: str) -> Path:
    """Write the checkpoint of ``state["step"]`` beside, then rename it into place; its folder.  The weights are
    saved in ``dtype``, the float32 ones beside them too when that rounds them."""
    import torch

    final = out / f"step-{state['step']}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # a half-written one from a crash
    weights = {name: t.detach().to(getattr(torch, dtype)) for name, t in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=weights)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    if dtype != "float32":
        torch.save(model.state_dict(), tmp / "weights.pt")
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


def publish(store: str, folder: Path, version: int, delta: bool = False) -> None:
    """Publish ``folder`` as ``version`` (a delta on the version before, with ``delta``, after the first); a
    version published before the crash is left as it is."""
    with contextlib.suppress(PolicyVersionError):  # already published: the crash came after the publication
        daskgen.publish_policy(store, str(folder), version, delta=delta and version > 1)


def crash_here(args: argparse.Namespace, point: str, batch: int) -> None:
    if args.crash_at == point and args.crash_batch == batch:
        print(f"crashing at {point} of batch {batch}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def parser(description: str) -> argparse.ArgumentParser:
    """The trainer's options (``reward_curve.py`` adds its own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("store", help="the run's --store")
    p.add_argument("--model", required=True, help="the run's model folder: the first policy")
    p.add_argument("--out", type=Path, required=True, help="the checkpoints' folder")
    p.add_argument("--batch-prompts", type=int, default=2, help="prompt groups per step")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate")
    p.add_argument("--cursor", default="grpo", help="the follower's name (its position in the store)")
    p.add_argument("--versions", type=int, help="stop learning after this many steps (default: never)")
    p.add_argument("--publish-dtype", choices=("float32", "bfloat16"), default="float32", help="the published weights'")
    p.add_argument("--delta", action="store_true", help="publish the versions after the first as deltas")
    p.add_argument("--threads", type=int, help="torch's threads for the trainer (default: torch's choice)")
    p.add_argument("--crash-at", choices=CRASH_POINTS, help="SIGKILL the trainer at this point ...")
    p.add_argument("--crash-batch", type=int, default=1, help="... of the batch with this number")
    return p


def load(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any]]:
    """The model, tokenizer, optimizer and trainer state of the newest checkpoint in ``args.out`` (published, if
    the crash came before that), or of ``args.model`` at step 0."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    latest = newest_checkpoint(args.out)
    start = latest or Path(args.model)
    model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(start)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    state: dict[str, Any] = {"step": 0, "batch": -1, "trained": []}
    if latest is not None:
        if (latest / "weights.pt").exists():  # the float32 weights of a checkpoint published rounded
            model.load_state_dict(torch.load(latest / "weights.pt"))
        optimizer.load_state_dict(torch.load(latest / "optimizer.pt"))
        state = json.loads((latest / "trainer.json").read_text())
        publish(args.store, latest, state["step"], args.delta)  # the crash may have come before the publication
        print(f"resumed from {latest.name}: batch {state['batch']}, {len(state['trained'])} samples trained")
    return model, tokenizer, optimizer, state


#: Called with each new batch's rows and its step (``step``, ``batch``, ``loss``, ``grad_norm``; None when the
#: trainer has stopped learning), after the step's publication.
Report = Callable[[list[dict[str, Any]], "dict[str, Any] | None"], None]


def train(args: argparse.Namespace, model: Any, tokenizer: Any, optimizer: Any, state: dict[str, Any],
          report: Report | None = None) -> dict[str, Any]:  # fmt: skip
    """Follow the run until it ends, a step per batch; the final trainer state."""
    follower = daskgen.follow(args.store, batch_prompts=args.batch_prompts, cursor=args.cursor, format="rows",
                              auto_ack=False)  # fmt: skip
    for batch in follower:
        rows = batch.data
        if batch.number <= state["batch"]:  # in the checkpoint already: delivered again, not acknowledged then
            print(f"batch {batch.number}: already trained, acknowledged again")
            batch.ack()
            continue
        if args.versions is not None and state["step"] >= args.versions:  # done learning: take the rest
            batch.ack()
            if report is not None:
                report(rows, None)
            continue
        loss, norm = step(model, optimizer, rows)
        crash_here(args, "step", batch.number)
        state = {
            "step": state["step"] + 1,
            "batch": batch.number,
            "trained": state["trained"] + [[r["prompt_id"], int(r["sample"])] for r in rows],
        }
        folder = save_checkpoint(args.out, model, tokenizer, optimizer, state, args.publish_dtype)
        crash_here(args, "checkpoint", batch.number)
        batch.ack()
        crash_here(args, "ack", batch.number)
        publish(args.store, folder, state["step"], args.delta)
        versions = sorted({int(r["policy_version"]) for r in rows})
        print(f"batch {batch.number}: {len(rows)} samples of versions {versions}, loss {loss:.4f}, "
              f"published version {state['step']}")  # fmt: skip
        if report is not None:
            report(rows, {"step": state["step"], "batch": batch.number, "loss": loss, "grad_norm": norm})
    print(f"{len(state['trained'])} samples trained in {state['step']} steps")
    return state


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train beside the run until it ends; the final trainer state."""
    args = parser(__doc__.split("\n\n")[0]).parse_args(argv)
    return train(args, *load(args))


if __name__ == "__main__":
    main()
