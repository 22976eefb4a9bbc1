"""Benchmark: torch CPU threads per engine (``daskgen.local-cpu-threads``): tokens/s and CPU seconds per token.

The ``transformers`` engine in this process generates the same greedy job (every sample exactly
``--max-new-tokens`` long) with ``num_threads`` = each of ``--threads`` in turn, the order alternating between
repeats; a local cluster's worker gets the same thread count from ``daskgen.local-cpu-threads`` (its
``OMP_NUM_THREADS``).  Each side is ``overhead_engine.direct_engine``: the engine started and checked, then the job
timed: wall seconds and the CPU seconds of this process and its children.  Reported per side: tokens/s and CPU
seconds per 1,000 tokens, and each side over the first one.  Where a second thread has nothing to do between
operations it spins: the CPU per token rises while the tokens/s do not.

    python benchmarks/cpu_threads.py                         # the tiny test model (built here)
    python benchmarks/cpu_threads.py --model <SmolLM2-135M-Instruct folder> --max-new-tokens 64
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from common import cli, records
from overhead_engine import direct_engine

TINY = "the tiny test model (daskgen.models)"
HEADER = ["threads", "tokens", "wall s", "tokens/s", "CPU s", "CPU s per 1,000 tokens", "tokens/s / first side's",
          "CPU per token / first side's"]  # fmt: skip


def prompt_ids(model: str, n: int) -> list[list[int]]:
    """``n`` short, distinct prompts in the model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer(f"Question {i}: list {i + 3} facts about the number {7 * i + 1}.")["input_ids"] for i in range(n)]


def generate_side(model: str, threads: int, prompts: list[list[int]], max_new: int) -> dict[str, Any]:
    """One side: the engine with ``threads`` driven directly (:func:`overhead_engine.direct_engine`)."""
    from daskgen.engines.base import GenerationRequest, SamplingParams

    params = SamplingParams(max_new_tokens=max_new, min_new_tokens=max_new, temperature=0.0)
    requests = [GenerationRequest(f"t{threads}-{i}", p, params) for i, p in enumerate(prompts)]
    side = asyncio.run(direct_engine("transformers", model, {"num_threads": threads}, requests))
    return {**side, "threads": threads, "wall": side["seconds"], "cpu": sum(side["cpu"].values())}


def model_folder(a: Any, work: Path) -> str:
    """``--model``, or the tiny test model built in ``work``."""
    if a.model:
        return a.model
    from daskgen.models import build_tiny_model

    return str(build_tiny_model(work / "tiny", seed=0))


def main() -> int:
    p = cli.parser(__doc__)
    p.add_argument("--model", default=None, help="model folder (default: the tiny test model, built here)")
    p.add_argument("--threads", default="1,2", help="thread counts to compare, comma-separated (default 1,2)")
    cli.add_flags(p, prompts=8, max_new_tokens=128, repeats=3)
    a = cli.parse(p)
    cli.quiet_logs()
    threads = cli.counts(a.threads)
    record = records.Record("torch CPU threads per engine: tokens/s and CPU per token (transformers engine)")
    with cli.workdir(a.workdir) as work:
        model = model_folder(a, work)
        prompts = prompt_ids(model, a.prompts)
        runs: list[dict[str, Any]] = []
        for repeat in range(a.repeats):
            order = threads if repeat % 2 == 0 else threads[::-1]
            runs += [generate_side(model, n, prompts, a.max_new_tokens) for n in order]
    equal = sum(run["outputs"] == runs[0]["outputs"] for run in runs)
    rows, first = [], None
    for n in threads:
        mine = [run for run in runs if run["threads"] == n]
        tokens, wall, cpu = (sum(run[k] for run in mine) for k in ("tokens", "wall", "cpu"))
        rate, per_k = tokens / wall, 1000 * cpu / tokens
        first = first or (rate, per_k)
        figures = (wall, rate, cpu, per_k, rate / first[0], per_k / first[1])
        rows.append([n, tokens, *map(records.fmt, figures)])
    record.table(
        HEADER,
        rows,
        caption=f"model {a.model or TINY}, {a.prompts} prompts x {a.max_new_tokens} tokens each (greedy), "
        f"{a.repeats} repeats per side, the order alternating; runs whose outputs equal the first run's token for "
        f"token: {equal} of {len(runs)}",
    )
    record.finish(cli.record_folder(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
