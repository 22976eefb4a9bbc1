"""Benchmark 1 (real model on CPU): static ``model.generate`` batches vs daskgen's streaming runner.

A real model (default SmolLM2-135M-Instruct, converted once by ``daskgen.models.smollm2_instruct``)
answers the same chat prompts, greedily, with lengths set by the model's own EOS (capped at
``--max-new-tokens``):

* **static** — ``model.generate`` on left-padded batches of ``--batch-size`` prompts, one batch after the
  other, in this process: each batch runs until its longest answer is done.
* **daskgen** — ``runner.run`` on a LocalCluster with one worker running the ``transformers`` engine
  (transformers' continuous batching, at most ``--batch-size`` requests per step, the same dtype and
  thread count), writing a real store; timed from engine ready to the last commit (model load excluded
  on both sides).
* **sync** (optional, ``--sides static,sync,daskgen``) — batches of ``--batch-size`` requests submitted at
  once to the *same* transformers engine on one Dask worker, each waiting for its longest answer: the
  barrier alone, on the engine daskgen uses.

All sides see the same prompt token ids (daskgen's own chat-template rendering).  Greedy decoding keeps
the work comparable; batched float32 kernels may still flip a near-tie, so token totals are reported.

    python benchmarks/longtail_real.py                   # ~4 minutes on 2 cores (1 torch thread per side)
    python benchmarks/longtail_real.py --model /path/to/tiny --prompts 8 --max-new-tokens 16 --no-record
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records, runs, workers
from common.prompts import builtin_prompts

from daskgen.config import RunConfig


def load_prompt_rows(a: argparse.Namespace) -> list[dict[str, Any]]:
    """Rows from ``--prompts-file`` (JSONL) or the built-in mix."""
    if a.prompts_file is None:
        return builtin_prompts(a.prompts, a.seed)
    rows = [json.loads(line) for line in Path(a.prompts_file).read_text().splitlines() if line.strip()]
    return rows[: a.prompts]


def make_config(a: argparse.Namespace, model: str, store: Path) -> RunConfig:
    """daskgen run settings (one worker, greedy, transformers engine capped at ``batch_size`` per step)."""
    window = max(1, -(-2 * a.batch_size // a.partition_size))
    return RunConfig(
        model=model,
        engine="transformers",
        store=str(store),
        n_samples=1,
        engine_args={
            "device": "cpu",
            "dtype": "float32",
            "max_requests_per_batch": a.batch_size,
            "num_threads": a.threads,
        },
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=256,
        temperature=0.0,
        seed=a.seed,
        partition_size=a.partition_size,
        n_workers=1,
        window=window,
        progress=False,
    )


def run_static(model_path: str, token_ids: list[list[int]], a: argparse.Namespace) -> dict[str, Any]:
    """``model.generate`` on static left-padded batches; returns time, tokens and lengths."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    tok = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos])
    pad = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos_ids))
    lengths: list[int] = []
    batch_s: list[float] = []
    t0 = time.perf_counter()
    for start in range(0, len(token_ids), a.batch_size):
        batch = token_ids[start : start + a.batch_size]
        width = max(len(x) for x in batch)
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch])
        tb = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=a.max_new_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(eos_ids),
            )
        batch_s.append(time.perf_counter() - tb)
        for row in out[:, width:].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            lengths.append(min(n, a.max_new_tokens))
    return {"seconds": time.perf_counter() - t0, "tokens": sum(lengths), "lengths": lengths, "batch_s": batch_s}


def run_daskgen(config: RunConfig, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """daskgen's ``runner.run`` with the transformers engine; timed from engine ready to the last commit."""
    from daskgen import store
    from daskgen.client.runner import run

    with runs.instrument_run() as marks:
        summary = run(config, rows)
    if not summary.ok:
        raise SystemExit(f"daskgen run did not finish: {summary.line()}")
    lengths = store.GenerationStore.open(config.store).read_region(0, len(rows), ("response_length",))[
        "response_length"
    ][:, 0]
    return {
        "seconds": marks["generate_s"],
        "tokens": summary.response_tokens,
        "lengths": [int(x) for x in lengths],
        "start_s": marks["start_s"],
        "done": summary.done,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    cli.add_flags(p, max_new_tokens=192, partition_size=4, seed=0)
    p.add_argument("--model", default=None, help="local HF model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=32, help="number of prompts")
    p.add_argument("--prompts-file", default=None, help="JSONL with messages/prompt rows instead of the built-in mix")
    p.add_argument(
        "--batch-size",
        type=int,
        default=16,
        help="static batch size = the engine's max_requests_per_batch (same peak concurrency)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads, both sides (more than 1 on a shared machine can be many times slower)",
    )
    p.add_argument(
        "--sides",
        default="static,daskgen",
        help="comma-separated, first is the reference: static (model.generate batches), sync (batches "
        "through the same transformers engine), daskgen",
    )
    p.add_argument("--no-plot", action="store_true")
    return cli.parse(p, argv)


def plot(path: Path, static: dict[str, Any], dg: dict[str, Any], a: argparse.Namespace) -> None:
    """Answer lengths of both sides and the static batches' durations."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    bins = np.linspace(0, a.max_new_tokens, 33)
    ax1.hist(
        [static["lengths"], dg["lengths"]],
        bins=bins,
        label=["static generate", "daskgen"],
        color=["tab:orange", "tab:green"],
    )
    ax1.set_xlabel("answer length (tokens, EOS included)")
    ax1.set_ylabel("answers")
    ax1.set_title("real answer lengths (greedy)")
    ax1.legend()
    lengths = np.array(static["lengths"])
    batches = [lengths[i : i + a.batch_size] for i in range(0, len(lengths), a.batch_size)]
    x = np.arange(len(batches))
    ax2.bar(x - 0.2, [b.max() for b in batches], 0.4, label="longest answer (decode steps run)", color="tab:red")
    ax2.bar(x + 0.2, [b.mean() for b in batches], 0.4, label="mean answer", color="tab:blue")
    ax2.set_xticks(x)
    ax2.set_xlabel("static batch")
    ax2.set_ylabel("tokens")
    ax2.set_title(f"static batches of {a.batch_size}: each runs as long as its longest answer")
    ax2.legend(fontsize=8, loc="lower right", framealpha=0.9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_sync_engine(config: RunConfig, requests: list[Any], batch: int) -> dict[str, Any]:
    """Synchronous batches of ``batch`` requests through the *same* transformers engine on one Dask worker.

    Each batch is submitted at once (the engine batches continuously inside it) and the next starts when
    its longest answer is done: the barrier alone, without the static-batch padding of ``model.generate``.
    """
    from daskgen.client.cluster import connect
    from daskgen.client.engines import start_engines

    with connect(config) as connection:
        client = workers.as_client(connection)
        start_engines(client, config)
        (worker,) = sorted(client.scheduler_info(n_workers=-1)["workers"])
        lengths: list[int] = []
        t0 = time.perf_counter()
        for start in range(0, len(requests), batch):
            fut = client.submit(
                workers.generate_on_worker, requests[start : start + batch], workers=[worker], pure=False
            )
            lengths.extend(fut.result())
        seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens": sum(lengths), "lengths": lengths}


SIDES = {
    "static": "static model.generate batches",
    "sync": "sync batches, same transformers engine",
    "daskgen": "daskgen (transformers engine)",
}


def main(argv: list[str] | None = None) -> int:
    """Run the sides, print the table, write its record."""
    a = parse_args(argv)
    cli.quiet_logs()
    sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--sides takes a comma-separated subset of {list(SIDES)}")
    model = a.model or str(__import__("daskgen.models", fromlist=["smollm2_instruct"]).smollm2_instruct())
    rows = load_prompt_rows(a)
    rec = records.Record("Long tail, real model on CPU: static model.generate batches vs daskgen")
    results: dict[str, dict[str, Any]] = {}
    with cli.workdir(a.workdir) as work:
        requests = runs.run_requests(make_config(a, model, work / "ids.zarr"), rows)
        for side in sides:
            if side == "static":
                results[side] = run_static(model, [r.prompt_ids for r in requests], a)
            elif side == "sync":
                results[side] = run_sync_engine(make_config(a, model, work / "sync.zarr"), requests, a.batch_size)
            else:
                results[side] = run_daskgen(make_config(a, model, work / "daskgen.zarr"), rows)
    base = results[sides[0]]
    header = [
        "side",
        "seconds (load excluded)",
        "tokens generated",
        "tokens/s",
        f"speed-up vs {sides[0]}",
        "mean answer",
        "longest",
        f"answers with the {sides[0]} length",
    ]
    table = []
    for side, res in results.items():
        same = sum(x == y for x, y in zip(base["lengths"], res["lengths"], strict=True))
        table.append(
            [
                SIDES[side],
                res["seconds"],
                res["tokens"],
                res["tokens"] / res["seconds"],
                base["seconds"] / res["seconds"],
                float(np.mean(res["lengths"])),
                max(res["lengths"]),
                f"{same}/{len(res['lengths'])}",
            ]
        )
    lengths = np.array(base["lengths"])
    rec.note(
        f"Model {Path(model).name}, {len(rows)} chat prompts (built-in mix of short, medium and long requests"
        f"{'' if a.prompts_file is None else ', from ' + a.prompts_file}), greedy, max_new_tokens "
        f"{a.max_new_tokens}, float32 on CPU, {a.threads} torch thread(s) on each side, at most {a.batch_size} "
        f"sequences per step on each side (static batch size = sync batch = the engine's "
        f"max_requests_per_batch); daskgen: 1 worker, partitions of {a.partition_size}. Answer lengths "
        f"({sides[0]}): mean {lengths.mean():.0f}, max {lengths.max()}, "
        f"{(lengths >= a.max_new_tokens).mean():.0%} at the cap."
    )
    rec.table(header, table)
    if not a.no_plot and "static" in results and "daskgen" in results:
        path = rec.plot_path(cli.plot_folder(a), "longtail_real")
        plot(path, results["static"], results["daskgen"], a)
        rec.plot(path)
    rec.finish(cli.record_folder(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
