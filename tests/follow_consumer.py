"""A trainer-like consumer for test_follow_processes.py: ``python tests/follow_consumer.py STORE OUT LOG``.

It follows STORE with ``daskgen.follow(format="dataproto")``; for each batch it builds nothing more than
verl's ``DataProto`` (what a trainer step gets), saves it as ``OUT/<batch name>.pkl`` (written beside and
renamed: a batch delivered again after a kill overwrites its own file), logs the delivery, spends a
"training step" (``CONSUMER_STEP_S``), acknowledges, and logs the ack.  ``CONSUMER_ORDER`` and
``CONSUMER_WINDOW`` set the follower's ``order`` and ``window`` (default: commit order).  The log (JSON
lines, synced) lets the test check that no acknowledged sample is ever delivered again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from verl.protocol import DataProto

import daskgen


def synced_log(fh: TextIO) -> Callable[..., None]:
    """A function that appends one JSON line (with this process's id) to ``fh`` and syncs it to disk."""

    def note(**record: object) -> None:
        fh.write(json.dumps({**record, "pid": os.getpid()}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())

    return note


def main(store: str, out: Path, log: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with log.open("a") as fh:
        note = synced_log(fh)
        note(event="start")
        order = os.environ.get("CONSUMER_ORDER", "commit")
        window = int(os.environ["CONSUMER_WINDOW"]) if "CONSUMER_WINDOW" in os.environ else None
        follower = daskgen.follow(
            store, batch_prompts=8, cursor="trainer", format="dataproto", auto_ack=False, order=order, window=window
        )
        follower.timeout = 120
        for batch in follower:
            proto = batch.data
            assert isinstance(proto, DataProto)
            samples = [
                [str(p), int(s)]
                for p, s in zip(proto.non_tensor_batch["prompt_id"], proto.non_tensor_batch["sample"], strict=True)
            ]
            failed = sorted(batch.failed)
            note(event="delivered", number=batch.number, samples=samples, failed=failed, prompts=batch.prompts.tolist())
            tmp = out / f"{batch.name}.pkl.tmp"
            proto.save_to_disk(tmp)
            os.replace(tmp, out / f"{batch.name}.pkl")
            time.sleep(float(os.environ.get("CONSUMER_STEP_S", "0.3")))
            batch.ack()
            note(event="acked", number=batch.number)
        note(event="end", pending=follower.pending_at_end)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
