"""A trainer's side of a daskgen run: take the finished samples of a store as verl ``DataProto`` batches.

    daskgen run --config examples/distill.yaml --model "$(python -m daskgen.models smollm2)" &
    python examples/follow_trainer.py distill.zarr

Started beside the run (even before it creates the store), it gets each batch of finished prompts as
soon as they are committed; started after it, it gets what is there.  Each batch comes once per cursor:
it is acknowledged after the "training step", so a trainer killed mid-step gets that batch again when it
restarts (the cursor lives in the store).  It prints the first batch sample by sample, with the ground
truth the run kept (``keep_columns: [answer, ...]``), the row's own settings and why the sample stopped,
then one line per batch with a toy reward (is the answer in the response?).  ``format="dataproto"`` needs
verl (``pip install 'daskgen[verl]'`` then ``pip install --no-deps verl``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import daskgen


def reward(response: str, answer: str) -> float:
    """1.0 when the ground-truth ``answer`` is in the ``response`` text, else 0.0 (stands in for a verifier)."""
    return float(answer.strip().lower() in response.lower())


def responses(data: Any, tokenizer: Any) -> list[str]:
    """The decoded response of each sample of a ``DataProto`` batch."""
    lengths = data.non_tensor_batch["response_length"]
    ids = data.batch["responses"]
    return [tokenizer.decode(ids[i, : int(n)].tolist(), skip_special_tokens=True) for i, n in enumerate(lengths)]


def show_samples(data: Any, texts: list[str]) -> None:
    """Print each sample of a batch: its id, ground truth, reward, the row's settings, stop and top tokens."""
    extra = data.non_tensor_batch
    for i, text in enumerate(texts):
        settings = json.loads(extra["sampling"][i]) if "sampling" in extra else {}
        used = {k: settings[k] for k in ("temperature", "max_new_tokens", "stop") if k in settings}
        stop = int(extra["stop_reason"][i]) if "stop_reason" in extra else None
        print(f"{extra['prompt_id'][i]} #{extra['sample'][i]}  answer={extra['answer'][i]!r}  ", end="")
        print(f"reward={reward(text, str(extra['answer'][i]))}  settings={used}  stop_reason={stop}")
        print(f"    response: {text!r}")
    if "top_logprob_ids" in data.batch.keys():  # noqa: SIM118 - a TensorDict refuses `in`
        first = data.batch["top_logprob_ids"][0, 0].tolist()
        print(f"top-{len(first)} token ids at the first response position of the first sample: {first}")


def main(argv: list[str] | None = None) -> int:
    """Follow the store; return the number of samples taken."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="the run's --store")
    parser.add_argument("--batch-prompts", type=int, default=4, help="finished prompts per batch")
    parser.add_argument("--cursor", default="trainer", help="the follower's name (its position in the store)")
    parser.add_argument("--no-wait", action="store_true", help="take what is committed now, then stop")
    args = parser.parse_args(argv)
    tokenizer = None
    taken = 0
    follower = daskgen.follow(
        args.store, batch_prompts=args.batch_prompts, format="dataproto", cursor=args.cursor,
        wait=not args.no_wait, auto_ack=False,
    )  # fmt: skip
    for batch in follower:
        data = batch.data
        tokenizer = tokenizer or daskgen.open_store(args.store).daskgen.tokenizer()
        texts = responses(data, tokenizer)
        if batch.number == 0:
            show_samples(data, texts)
        rewards = [reward(t, str(a)) for t, a in zip(texts, data.non_tensor_batch["answer"], strict=True)]
        mean = sum(rewards) / max(len(rewards), 1)
        print(f"batch {batch.number}: {len(batch)} prompts, {len(data)} samples, mean reward {mean:.2f}")
        batch.ack()  # after the training step: this batch is never delivered to this cursor again
        taken += len(data)
    print(f"{taken} samples taken")
    return taken


if __name__ == "__main__":
    main()
