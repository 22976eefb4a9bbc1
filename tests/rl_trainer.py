"""A small REINFORCE trainer for test_rl_loop.py: ``python tests/rl_trainer.py STORE BASE CKPTS GATES LOG``.

It follows STORE (``daskgen.follow``, rows, acknowledged by hand) and, for each batch, takes one real torch
optimizer step on the tiny model: the reward of every sample is -1 (it penalises what the policy answered, so
each version's greedy answers move away from the last), the loss the mean log-probability of the response
tokens times that reward.  Every ``PUBLISH_EVERY`` batches it saves the model (``save_pretrained`` into
``CKPTS/v<version>``) and publishes it as version ``batches / PUBLISH_EVERY`` (a batch delivered again after
a kill does not publish twice).  A restarted trainer starts from the newest published checkpoint and from
its cursor.

It paces the run: the run's probe engine holds each row's requests until ``GATES/<row>`` exists, and the
trainer opens the gates of the rows up to ``AHEAD`` past the highest row it was given (never the row named by
``TRAINER_CLOSED``), so samples wait for it a bounded time.  With ``TRAINER_PAUSED`` (the probe's event file,
for a run whose held requests pause part-way) it publishes its first version only while a request waits
part-way, and goes on once the run's worker runs that version: the refresh found that request mid-way.  The log
(JSON lines, synced) records every delivery with the newest published version at that moment, every publish and
every acknowledgement.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import daskgen
from daskgen import store
from daskgen.store.policy import newest, read_worker_policies
from daskgen.testing.probes import read_events, row_of
from tests.follow_consumer import synced_log

BATCH_PROMPTS = 2
PUBLISH_EVERY = 2
AHEAD = 4
LEARNING_RATE = 0.05


def open_gates(gates: Path, upto: int, closed: int) -> None:
    gates.mkdir(parents=True, exist_ok=True)
    for row in range(upto + 1):
        if row != closed:
            (gates / str(row)).touch()


def wait_for(check, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout} s")
        time.sleep(0.02)


def paused_now(events: Path, gates: Path) -> bool:
    """A request of the run waits part-way at a closed gate (paused, not ended since, its gate not opened)."""
    waiting: set[str] = set()
    for event in read_events(events):
        if event.kind == "pause":
            waiting.add(event.request_id)
        elif event.kind == "end":
            waiting.discard(event.request_id)
    return any(not (gates / str(row_of(request_id))).exists() for request_id in waiting)


def step(model, optimizer, rows: list[dict]) -> float:
    """One REINFORCE step (reward -1 for every sample) on the response tokens of ``rows``."""
    optimizer.zero_grad()
    losses = []
    for row in rows:
        prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
        if not response:
            continue
        ids = torch.tensor([prompt + response])
        logits = model(ids).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])
        losses.append(logprobs.mean())  # reward -1: minimise -(-1) * log p
    if not losses:
        return 0.0
    loss = torch.stack(losses).mean()
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def main(out: str, base: str, ckpts: Path, gates: Path, log: Path) -> None:
    closed = int(os.environ.get("TRAINER_CLOSED", "-1"))
    paused = Path(os.environ["TRAINER_PAUSED"]) if "TRAINER_PAUSED" in os.environ else None
    location = store.locate(out)
    latest = newest(location)
    model = AutoModelForCausalLM.from_pretrained(latest.path if latest else base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    open_gates(gates, AHEAD - 1, closed)
    with log.open("a") as fh:
        note = synced_log(fh)
        note(event="start")
        follower = daskgen.follow(out, batch_prompts=BATCH_PROMPTS, cursor="trainer", format="rows", auto_ack=False)
        follower.timeout = 300
        for batch in follower:
            current = newest(location)
            samples = [
                [r["prompt_id"], int(r["sample"]), int(r["policy_version"]), int(r["policy_version_end"])]
                for r in batch.data
            ]
            note(event="delivered", number=batch.number, newest=current.version if current else 0, samples=samples)
            open_gates(gates, int(max(batch.prompts)) + AHEAD, closed)
            loss = step(model, optimizer, batch.data)
            version = (batch.number + 1) // PUBLISH_EVERY
            published = newest(location)
            if (batch.number + 1) % PUBLISH_EVERY == 0 and (published.version if published else 0) < version:
                folder = ckpts / f"v{version}"
                model.save_pretrained(folder)
                tokenizer.save_pretrained(folder)
                if paused and version == 1:
                    wait_for(lambda: paused_now(paused, gates), "request waiting part-way")
                daskgen.publish_policy(out, str(folder), version)
                if paused and version == 1:
                    wait_for(lambda: any(w.version >= 1 for w in read_worker_policies(location)), "worker on version 1")
                note(event="published", version=version, path=str(folder), loss=loss)
            batch.ack()
            note(event="acked", number=batch.number)
        note(event="end", pending=follower.pending_at_end)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]))
