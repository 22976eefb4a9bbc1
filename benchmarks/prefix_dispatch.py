"""Prefix-aware dispatch: prompt tokens the engines computed and makespan, ``dispatch: prefix`` vs ``order``.

Both sides in one invocation, interleaved (order, prefix, order, prefix, ...) for each worker count:

* **prefix-heavy, shuffled**: ``--systems`` system prompts of about ``--system-tokens`` characters, each
  paired with every one of ``--questions`` short questions, shuffled (8 x 512 = 4,096 rows by default);
  sides ``dispatch: order`` and ``dispatch: prefix``;
* **prefix-heavy, grouped** (``--grouped``): the same rows sorted by system prompt;
* **no shared prefix**: as many rows, each a distinct prompt of the same length; sides ``order`` and
  ``auto`` (which must find no prefix worth it and keep input order).

Each run is a real daskgen run (``runner.run``) on a fresh LocalCluster of ``--workers`` workers (in one
process unless ``--processes yes``).  With ``--engine simulated`` (the default) each worker has one
simulated engine with the prefill model on: every prompt token an engine computes costs
``--prefill-per-token`` model seconds, and each engine has a prefix cache of ``--cache-tokens`` tokens
(:mod:`daskgen.engines.simulated.prefix_cache`; one row per cache size).  With ``--engine vllm`` or
``sglang`` the engines are real, in-process, on the CPU (``--model``: a local model folder, by default
SmolLM2-135M-Instruct from :func:`daskgen.models.smollm2_instruct`; the lanes' environments; engine arguments
of ``overhead_engine.ENGINE_ARGS``, ``--max-batch`` requests per engine; greedy), one worker process each.
``--engine-arg KEY=VALUE`` (repeatable, VALUE read as YAML) adds or overrides an engine argument of either kind:
e.g. ``num_gpu_blocks_override=16`` gives each vLLM engine a KV cache of 16 blocks (128 tokens each on a CPU),
fewer than the shared prefixes need, so that input order evicts prefixes an engine needs again.
Measured per run: the prompt tokens the engines computed (every sample's prompt less the tokens its engine
served from its prefix cache, as the engine reported them per request: the store's ``cached_prompt_tokens``),
the makespan (engines ready to the last commit, wall seconds; ``time_scale`` 1, so that model seconds are
wall seconds), response tokens per second of makespan, the engines' mean batch (occupancy; the simulated
engine's statistics), the busiest simulated engine's model seconds (prefill and steps: the makespan's floor;
what the makespan has above it is the host's share, e.g. many in-process workers on few cores) and the rows
stored without their full response (simulated: fixed lengths).
Reported: medians over ``--repeats`` and the ratios order / prefix (tokens: > 1 means prefix computes
fewer; makespan: > 1 means prefix is faster).

    python benchmarks/prefix_dispatch.py                       # ~10 minutes on 2 cores
    python benchmarks/prefix_dispatch.py --questions 32 --repeats 1 --no-record
    python benchmarks/prefix_dispatch.py --workers 16,32,64 --questions 1536 --cache-tokens 4096   # ~25 minutes
    python benchmarks/prefix_dispatch.py --engine vllm --systems 4 --system-tokens 2400 --questions 32 \
        --max-new-tokens 8 --max-batch 16 --partition-size 16 --workloads shuffled   # the vllm lane's venv
    python benchmarks/prefix_dispatch.py --engine vllm --systems 8 --system-tokens 2400 --questions 16 \
        --max-new-tokens 8 --max-batch 4 --partition-size 32 --workloads shuffled \
        --engine-arg num_gpu_blocks_override=16 --engine-arg max_model_len=1024   # a KV cache of ~2 prefixes
    python benchmarks/prefix_dispatch.py --engine sglang --systems 8 --system-tokens 2400 --questions 40 \
        --max-new-tokens 8 --max-batch 16 --partition-size 16 --workers 1,2 --workloads shuffled,grouped \
        --engine-arg schedule_policy=lpm --repeats 1   # the same sglang schedule on both sides (the sglang lane's venv)

A run dispatched by prefix may start its engines with arguments of the engine's own
(:meth:`daskgen.engines.base.Engine.prefix_admission`: sglang's ``schedule_policy: lpm`` unless set); each table
row names the arguments where the two sides' engines started differently, so set the policy with ``--engine-arg``
to compare like with like.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
from pathlib import Path
from typing import Any

from common import cli, runs, workers
from overhead_engine import ENGINE_ARGS

from daskgen.cli_flags import key_values

TITLE = "Prefix-aware dispatch: prompt tokens computed and makespan, prefix vs order"
WORDS = "the of model data token engine cache batch prompt system answer short long write read store".split()  # noqa: SIM905


def text(rng: random.Random, n_chars: int) -> str:
    """Random words, about ``n_chars`` bytes (one token each with the simulated engine's byte tokenizer)."""
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < n_chars:
        out.append(rng.choice(WORDS))
    return " ".join(out)


def workload(a: argparse.Namespace, kind: str) -> list[dict[str, Any]]:
    """The rows of a workload: ``shuffled`` or ``grouped`` (prefix-heavy), or ``plain`` (no shared prefix)."""
    rng = random.Random(a.seed)
    systems = [f"System prompt {k}. " + text(rng, a.system_tokens) for k in range(a.systems)]
    questions = [f"Question {q}: what is {q} times {q % 13}?" for q in range(a.questions)]
    rows = []
    for k in range(a.systems):
        for q in questions:
            system = systems[k] if kind != "plain" else f"Context {len(rows)}: " + text(rng, a.system_tokens)
            rows.append({"messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]})
    if kind != "grouped":
        rng.shuffle(rows)
    return rows


def engine_settings(a: argparse.Namespace, cache: int) -> tuple[str, str, dict[str, Any]]:
    """The model, engine name and engine arguments of a run (``cache``: the simulated prefix cache)."""
    extra = key_values(a.engine_arg, "--engine-arg")
    if a.engine != "simulated":
        model = a.model or str(__import__("daskgen.models", fromlist=["smollm2_instruct"]).smollm2_instruct())
        defaults = ENGINE_ARGS[a.engine](argparse.Namespace(max_requests=a.max_batch, threads=1))
        return model, a.engine, {**defaults, **extra}
    args = {
        "max_batch": a.max_batch,
        "step_time_base_s": a.step_base,
        "step_time_per_seq_s": a.step_per_seq,
        "time_scale": 1.0,
        "length_dist": "fixed",
        "length_mean": a.max_new_tokens,
        "prefill_time_per_token_s": a.prefill_per_token,
        "prefix_cache_tokens": cache,
    }
    return "simulated-prefix", "simulated", {**args, **extra}


def one_run(a: argparse.Namespace, rows: list[dict[str, Any]], dispatch: str, n_workers: int, cache: int) -> dict:
    """One daskgen run on a fresh cluster; prompt tokens computed, the engines' mean batch, the makespan."""
    import dask
    from distributed import LocalCluster

    from daskgen.config import RunConfig
    from daskgen.store.generation_store import GenerationStore

    store = a.work / "store.zarr"
    shutil.rmtree(store, ignore_errors=True)
    model, engine, engine_args = engine_settings(a, cache)
    spec: dict[str, Any] = {"n_workers": n_workers, "threads_per_worker": 1, "processes": a.processes == "yes"}
    if a.processes != "yes":  # workers in one process: each would hold the process's memory to its share alone
        spec["memory_limit"] = 0  # (64 workers: a 24 GiB machine's 375 MiB), so all would spill and pause
    daemon = {"distributed.worker.daemon": False}  # worker processes may start the engines' own subprocesses
    with dask.config.set(daemon), LocalCluster(**spec, dashboard_address=None) as cluster:
        config = RunConfig(
            model=model,
            engine=engine,
            engine_args=engine_args,
            store=str(store),
            max_new_tokens=a.max_new_tokens,
            max_prompt_tokens=a.system_tokens + 256,
            partition_size=a.partition_size,
            scheduler_address=cluster.scheduler_address,
            dispatch=dispatch,
            temperature=0.0 if engine != "simulated" else 1.0,
            progress=False,
        )
        summary, marks = runs.timed_run(
            config,
            rows,
            on_ready=lambda c: c.run(workers.reset_engine_stats),
            on_done=lambda c: list(c.run(workers.engine_stats).values()),
        )
    stats = [s for s in marks["on_done"] if s]
    written = GenerationStore.open(store)
    record = written.attrs.dispatch or {}
    data = written.read_region(0, len(rows), ("prompt_length", "response_length", "cached_prompt_tokens"))
    lengths, cached = data["response_length"], data["cached_prompt_tokens"]
    return {
        "engine_args": applied_args(engine, engine_args, record.get("mode", "?")),
        "short": int((lengths < a.max_new_tokens).sum()) if engine == "simulated" else 0,  # rows missing tokens
        "prompt": int(data["prompt_length"].sum()),
        "prefill": int(data["prompt_length"].sum() - cached.sum()) if (cached >= 0).all() else None,
        "batch": statistics.mean(mean_batch(s) for s in stats) if stats else None,
        "busy": max((s["busy_s"] for s in stats if "busy_s" in s), default=None),  # model s: makespan's floor
        "makespan": marks["generate_s"],
        "tokens_s": int(lengths.sum()) / marks["generate_s"],
        "mode": record.get("mode", "?"),
        "tasks": record.get("n_tasks", 0),
        "prompts": summary.generated_prompts,
    }


def applied_args(engine: str, engine_args: dict[str, Any], mode: str) -> dict[str, Any]:
    """The engine arguments a run's engines started with: a run dispatched by prefix adds the engine class's own
    (:meth:`daskgen.engines.base.Engine.prefix_admission`, e.g. sglang's ``schedule_policy: lpm``)."""
    if mode != "prefix":
        return dict(engine_args)
    from daskgen.engines import resolve_engine_class

    return resolve_engine_class(engine).prefix_admission(dict(engine_args))[0]


def mean_batch(stats: dict[str, Any]) -> float:
    """An engine's mean batch over its steps (``batch_size_hist``: batch size -> steps)."""
    hist = stats.get("batch_size_hist") or {}
    steps = sum(hist.values())
    return sum(int(size) * n for size, n in hist.items()) / steps if steps else float("nan")


WORKLOADS = {  # name: (rows, the two sides: A, B)
    "prefix-heavy, shuffled": ("shuffled", ("order", "prefix")),
    "prefix-heavy, grouped": ("grouped", ("order", "prefix")),
    "no shared prefix": ("plain", ("order", "auto")),
}


def part_prefix(a: argparse.Namespace, work: Path, rec: Any) -> None:
    """Each workload, worker count and cache size, interleaved repeats; one table row per combination."""
    a.work = work
    rec.note(
        f"Workloads: {a.systems} system prompts of ~{a.system_tokens} characters x {a.questions} questions "
        f"({a.systems * a.questions:,} rows), and as many rows with no shared prefix. Engine {a.engine}"
        + (
            f": max_batch {a.max_batch}, step {a.step_base} + {a.step_per_seq} x running s, prefill "
            f"{a.prefill_per_token} s per computed prompt token (byte tokenizer: one token per character)"
            if a.engine == "simulated"
            else f" ({engine_settings(a, 0)[0]}, {engine_settings(a, 0)[2]}, greedy)"
        )
        + f"; {a.max_new_tokens} new tokens per row; partitions of {a.partition_size}; {a.repeats} interleaved "
        f"repeats per side; LocalCluster with processes={a.processes} (one thread per worker)."
    )
    rows_out = []
    for name, (kind, sides) in WORKLOADS.items():
        if kind not in a.workloads.split(",") and not (kind == "grouped" and a.grouped):
            continue
        rows = workload(a, kind)
        caches = cli.counts(a.cache_tokens) if a.engine == "simulated" else [0]
        for cache in caches if kind != "plain" else caches[:1]:  # nothing shared: one cache size tells all
            for n_workers in cli.counts(a.workers):
                got: dict[str, list[dict]] = {side: [] for side in sides}
                for _ in range(a.repeats):
                    for side in sides:
                        got[side].append(one_run(a, rows, side, n_workers, cache))
                rows_out.append(table_row(name, n_workers, cache, got[sides[0]], got[sides[1]]))
                print(rows_out[-1], flush=True)
    rec.table(
        [
            "workload",
            "workers",
            "cache tokens",
            "sides (mode run)",
            "prompt tokens computed, median (A; B)",
            "A / B tokens",
            "makespan s, median (A; B)",
            "A / B makespan",
            "per repeat A / B makespan",
            "response tokens/s, median (A; B)",
            "prompt tokens in all",
            "engines' mean batch (A; B)",
            "busiest engine's model s, median (A; B)",
            "rows without their full response (all runs)",
        ],
        rows_out,
    )


def table_row(name: str, n_workers: int, cache: int, base: list[dict], other: list[dict]) -> list[Any]:
    """One table row: the medians of both sides and their ratios (A = the first side, input order)."""

    def med(side: list[dict], key: str) -> float:
        values = [r[key] for r in side if r[key] is not None]
        return statistics.median(values) if values else float("nan")

    sides = f"A {base[0]['mode']}; B {other[0]['mode']} ({other[0]['tasks']} tasks)"
    args_a, args_b = base[0]["engine_args"], other[0]["engine_args"]
    differ = sorted(k for k in {*args_a, *args_b} if args_a.get(k) != args_b.get(k))
    if differ:  # the engine arguments the two sides' engines started with, where they differ
        sides += " — engine args differ: " + ", ".join(f"{k} A {args_a.get(k)}, B {args_b.get(k)}" for k in differ)
    elif "schedule_policy" in args_a:
        sides += f" — schedule_policy {args_a['schedule_policy']} on both"
    per_repeat = ", ".join(f"{x['makespan'] / y['makespan']:.3f}" for x, y in zip(base, other, strict=True))
    return [
        name,
        n_workers,
        cache or "engine's own",
        sides,
        f"{med(base, 'prefill'):,.0f}; {med(other, 'prefill'):,.0f}",
        f"{med(base, 'prefill') / med(other, 'prefill'):.2f}",
        f"{med(base, 'makespan'):.2f}; {med(other, 'makespan'):.2f}",
        f"{med(base, 'makespan') / med(other, 'makespan'):.3f}",
        per_repeat,
        f"{med(base, 'tokens_s'):.1f}; {med(other, 'tokens_s'):.1f}",
        f"{base[0]['prompt']:,}",
        f"{med(base, 'batch'):.1f}; {med(other, 'batch'):.1f}",
        f"{med(base, 'busy'):.2f}; {med(other, 'busy'):.2f}",
        sum(r["short"] for r in base + other),
    ]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--workers", default="2", help="worker counts, comma-separated")
    p.add_argument("--engine", default="simulated", choices=("simulated", "vllm", "sglang"), help="the engines")
    p.add_argument("--model", default="", help="local model folder (--engine vllm or sglang; default SmolLM2)")
    p.add_argument("--cache-tokens", default="4096,65536", help="each simulated engine's prefix-cache sizes")
    p.add_argument(
        "--processes",
        default="",
        help="yes: one process per worker (as deployed; default with a "
        "real engine); no: in-process (default with the simulated engine)",
    )
    p.add_argument("--systems", type=int, default=8, help="distinct system prompts")
    p.add_argument("--system-tokens", type=int, default=600, help="characters per system prompt")
    p.add_argument("--questions", type=int, default=512, help="questions, each paired with every system prompt")
    p.add_argument("--grouped", action="store_true", help="also the prefix-heavy rows grouped by system prompt")
    p.add_argument("--workloads", default="shuffled,plain", help="of shuffled, grouped, plain (comma-separated)")
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine argument added to (or overriding) the defaults, VALUE read as YAML; repeatable\n"
        "(e.g. num_gpu_blocks_override=16: each vLLM engine's KV cache in blocks)",
    )
    p.add_argument("--prefill-per-token", type=float, default=5e-5, help="model seconds per computed prompt token")
    cli.add_flags(
        p, max_new_tokens=32, max_batch=64, step_base=0.02, step_per_seq=0.0002, partition_size=64, repeats=2, seed=0
    )
    a = cli.parse(p, argv)
    a.processes = a.processes or ("no" if a.engine == "simulated" else "yes")
    return a


if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, {"prefix": part_prefix}))
