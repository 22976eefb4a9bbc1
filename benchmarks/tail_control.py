"""What target/deadline mode saves on a long-tailed length distribution (issue 10).

Three runs of the same prompts on the same simulated engine (continuous batching, lognormal
response lengths capped at ``--max-new-tokens``), side by side:

* **full**: every prompt to completion;
* **target**: ``--target-done`` = ``--fraction`` of the prompts, then in-flight requests are aborted;
* **deadline**: ``--deadline`` = ``--fraction`` of the full run's wall time (start-up included),
  aborting whatever is still running then.

Reported: wall time, prompts done, tokens generated, and the saving against the full run.
Absolute times are context (the machine is shared); the ratios are the result.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import cli, records, simulation


def _prompts(path: Path, n: int) -> Path:
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"t{i}", "prompt": f"task {i}: " + "x" * (i % 17)}) + "\n")
    return path


def _run(store: Path, prompts: Path, args: argparse.Namespace, **extra: object) -> tuple[float, object]:
    from daskgen.client.runner import run
    from daskgen.config import RunConfig

    cfg = RunConfig(
        prompts=str(prompts),
        model="sim",
        store=str(store),
        engine="simulated",
        engine_args=simulation.lognormal_engine(
            args.time_scale, args.length_mean, args.length_sigma, max_batch=args.max_batch
        ),
        n_samples=args.n_samples,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=256,
        partition_size=args.partition_size,
        window=args.window,
        n_workers=args.workers,
        progress=False,
        seed=1,
        **extra,
    )
    t0 = time.perf_counter()
    summary = run(cfg)
    return time.perf_counter() - t0, summary


def main() -> None:
    parser = cli.parser(__doc__)
    cli.add_flags(parser, prompts=256, n_samples=4, partition_size=4)
    parser.add_argument("--window", type=int, default=4, help="daskgen partitions in flight per worker")
    cli.add_flags(parser, workers=2, max_new_tokens=4096, length_mean=300.0, length_sigma=1.2, max_batch=64)
    cli.add_flags(parser, time_scale=0.2)
    parser.add_argument("--fraction", type=float, default=0.9, help="share of prompts the target/deadline aims at")
    args = cli.parse(parser)
    cli.quiet_logs()
    record = records.Record("Tail control: full run vs target / deadline stop (simulated engine)")
    with cli.workdir(args.workdir) as work:
        prompts = _prompts(work / "prompts.jsonl", args.prompts)
        full_s, full = _run(work / "full.zarr", prompts, args)
        target = max(1, int(args.fraction * args.prompts))
        target_s, tgt = _run(work / "target.zarr", prompts, args, target_done=target)
        at_fraction = args.fraction * full_s
        deadline_s, dl = _run(work / "deadline.zarr", prompts, args, deadline=f"{at_fraction:.1f}s")
    rows = []
    for name, secs, s in (
        ("full", full_s, full),
        (f"target {target} done", target_s, tgt),
        (f"deadline {at_fraction:.1f} s", deadline_s, dl),
    ):
        rows.append([name, secs, s.done, s.pending, s.response_tokens, secs / full_s, s.done / max(full.done, 1)])
    record.table(["run", "wall s", "done", "pending", "tokens generated", "time vs full", "done vs full"], rows)
    record.note(
        f"{args.prompts} prompts x {args.n_samples} samples, lognormal lengths (mean {args.length_mean}, "
        f"sigma {args.length_sigma}, cap {args.max_new_tokens}), max_batch {args.max_batch}, "
        f"{args.workers} workers, window {args.window}, partitions of {args.partition_size}, "
        f"time_scale {args.time_scale}. Wall times include cluster start-up (a few seconds). "
        "Stopped prompts stay pending and finish with a later run (or continue with --keep-partial)."
    )
    record.finish(cli.record_folder(args))


if __name__ == "__main__":
    main()
