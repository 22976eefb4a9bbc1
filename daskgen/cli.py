"""``daskgen`` command line (typer)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from daskgen.errors import DaskgenError

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Distributed LLM generation on Dask with resumable Zarr stores."
)

Opt = typer.Option


def _key_values(pairs: list[str] | None, flag: str) -> dict[str, Any] | None:
    import yaml

    if not pairs:
        return None
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DaskgenError(f"{flag} expects KEY=VALUE, found {pair!r}")
        out[key] = yaml.safe_load(value)
    return out


@app.command()
def run(
    prompts: Annotated[Path | None, Opt(help="JSONL or Parquet file of prompts.")] = None,
    model: Annotated[str | None, Opt(help="Local model folder (or name the engine understands).")] = None,
    store: Annotated[
        str | None, Opt(help="Output Zarr store (folder or s3://, gs://, az:// URL); rerun against it to resume.")
    ] = None,
    config: Annotated[Path | None, Opt(help="YAML file with the same keys; flags override it.")] = None,
    engine: Annotated[
        str | None, Opt(help="Engine: transformers, sglang, vllm, openai, simulated, or module:Class.")
    ] = None,
    engine_arg: Annotated[list[str] | None, Opt(help="Engine option KEY=VALUE (repeatable).")] = None,
    agent: Annotated[str | None, Opt(help="Agent loop: single_turn, tool, or module:Class.")] = None,
    agent_arg: Annotated[list[str] | None, Opt(help="Agent option KEY=VALUE (repeatable).")] = None,
    n_samples: Annotated[int | None, Opt(help="Samples per prompt.")] = None,
    max_new_tokens: Annotated[int | None, Opt(help="Response token limit.")] = None,
    max_prompt_tokens: Annotated[int | None, Opt(help="Prompt token limit (longer prompts are an error).")] = None,
    temperature: Annotated[float | None, Opt(help="Sampling temperature; 0 = greedy.")] = None,
    top_p: Annotated[float | None, Opt()] = None,
    top_k: Annotated[int | None, Opt()] = None,
    seed: Annotated[int | None, Opt(help="Run seed; per-sample seeds derive from it.")] = None,
    logprobs: Annotated[bool | None, Opt("--logprobs/--no-logprobs", help="Store per-token logprobs.")] = None,
    partition_size: Annotated[int | None, Opt(help="Prompts per task = store chunk rows.")] = None,
    scheduler_address: Annotated[
        str | None, Opt(help="Use this Dask scheduler instead of a LocalCluster (tls://HOST:PORT with --tls-*).")
    ] = None,
    tls_ca: Annotated[Path | None, Opt(help="CA file of a tls:// --scheduler-address.")] = None,
    tls_cert: Annotated[Path | None, Opt(help="Client certificate for a tls:// --scheduler-address.")] = None,
    tls_key: Annotated[Path | None, Opt(help="Client key for a tls:// --scheduler-address.")] = None,
    insecure: Annotated[bool, Opt(help="No TLS on the SLURM/PBS cluster daskgen starts (not recommended).")] = False,
    cluster: Annotated[str | None, Opt(help="local, slurm or pbs (details in the config's cluster: section).")] = None,
    n_workers: Annotated[int | None, Opt(help="LocalCluster workers (default: per GPU, else cores/4).")] = None,
    min_workers: Annotated[int | None, Opt(help="Adaptive scaling lower bound.")] = None,
    max_workers: Annotated[int | None, Opt(help="Adaptive scaling upper bound.")] = None,
    window: Annotated[
        str | None,
        Opt(help="Partitions in flight per worker, or 'auto' (sized from the engine's batch slots; the default)."),
    ] = None,
    max_retries: Annotated[int | None, Opt(help="Retries of a failed partition before its prompts fail.")] = None,
    partition_timeout_s: Annotated[float | None, Opt(help="Treat a partition running longer as hung.")] = None,
    max_prompts_in_memory: Annotated[int | None, Opt(help="Cap on prompts held in memory at once.")] = None,
    target_done: Annotated[int | None, Opt(help="Stop once this many prompts are done.")] = None,
    token_budget: Annotated[int | None, Opt(help="Stop once this run generated this many tokens.")] = None,
    deadline: Annotated[str | None, Opt(help="Stop at this time (ISO 8601) or after 90m / 2h / 3600s.")] = None,
    keep_partial: Annotated[
        bool | None,
        Opt(
            "--keep-partial/--no-keep-partial",
            help="Store aborted partial responses and continue them next attempt "
            "(default: on for the single_turn agent).",
        ),
    ] = None,
    grace: Annotated[
        str | None,
        Opt(
            help="On SIGTERM/SIGINT or at the end of the SLURM allocation: seconds to "
            "abort, save partial responses and commit before exiting with status 3 "
            "(default 25s)."
        ),
    ] = None,
    skip_overlong: Annotated[bool, Opt(help="Record overlong prompts as failed instead of stopping.")] = False,
    retry_failed: Annotated[bool, Opt(help="Regenerate prompts that failed in earlier runs.")] = False,
    length_hints: Annotated[
        str | None,
        Opt(help="Store of an earlier run over the same prompts: start the partitions that were longest there first."),
    ] = None,
    progress: Annotated[bool, Opt("--progress/--no-progress")] = True,
    show: Annotated[int, Opt(help="Print this many decoded answers at the end.")] = 0,
) -> None:
    """Generate (or resume) responses for every prompt into a Zarr store."""
    overrides = {
        k: v
        for k, v in locals().items()
        if k not in ("config", "engine_arg", "agent_arg", "show", "cluster", "insecure")
    }
    from daskgen.client.runner import run as run_generation
    from daskgen.config import RunConfig

    overrides["engine_args"] = _key_values(engine_arg, "--engine-arg")
    overrides["agent_args"] = _key_values(agent_arg, "--agent-arg")
    overrides = {k: (str(v) if isinstance(v, Path) else v) for k, v in overrides.items()}
    overrides["skip_overlong"] = skip_overlong or None
    overrides["retry_failed"] = retry_failed or None
    cfg = RunConfig.load(config, **overrides)
    if cluster:
        cfg.cluster = {**(cfg.cluster or {}), "kind": cluster}
    if insecure:
        cfg.cluster = {**(cfg.cluster or {}), "tls": False}
    summary = run_generation(cfg)
    if show:
        from daskgen.analysis.summary import print_answers

        print_answers(cfg.location(), show)
    typer.echo(summary.line())
    raise typer.Exit(exit_status(summary))


def exit_status(summary: Any) -> int:
    """0 all done (or stopped early by a stop condition), 1 some prompt failed, 3 interrupted (resumable)."""
    from daskgen.client.interrupt import EXIT_INTERRUPTED

    if summary.interrupted:
        return EXIT_INTERRUPTED
    return 0 if summary.failed == 0 else 1


@app.command()
def status(store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL).")]) -> None:
    """Print done / pending / failed counts, tokens generated and the run's settings."""
    from daskgen.analysis.summary import status_report

    typer.echo(status_report(str(store)))


@app.command()
def export(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL).")],
    format: Annotated[str, Opt("--format", "-f", help="parquet, jsonl, tensordict or zip.")] = "parquet",
    out: Annotated[Path | None, Opt(help="Output path (default: STORE with the format's suffix).")] = None,
    overwrite: Annotated[bool, Opt(help="Replace an existing output.")] = False,
    text: Annotated[bool, Opt("--text/--no-text", help="Add decoded prompt and response text.")] = True,
    tokenizer: Annotated[str | None, Opt(help="Model folder to decode with (default: the run's model).")] = None,
    prompts: Annotated[Path | None, Opt(help="The run's input file, for raw prompts (default: recorded path).")] = None,
    raw_prompts: Annotated[bool, Opt("--raw-prompts/--no-raw-prompts", help="Add the input's raw prompts.")] = True,
    wandb_project: Annotated[str | None, Opt(help="Upload the zip export as a W&B artifact to this project.")] = None,
) -> None:
    """Export done samples (parquet, jsonl, verl-layout tensordict) or the whole store as one zip."""
    from daskgen.analysis.export import DEFAULT_SUFFIX
    from daskgen.analysis.export import export as run_export
    from daskgen.store.location import default_output

    target = out or default_output(store, DEFAULT_SUFFIX.get(format, f".{format}"))
    result = run_export(
        store,
        target,
        format,
        overwrite=overwrite,
        text=text,
        tokenizer=tokenizer,
        prompts=prompts,
        raw=raw_prompts,
        wandb_project=wandb_project,
    )
    typer.echo(result.line())
    if wandb_project:
        typer.echo(f"uploaded {target} to W&B project {wandb_project!r}")


@app.command()
def follow(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL), also one a run is writing.")],
    cursor: Annotated[str, Opt(help="Name of the durable position (independent names follow independently).")] = (
        "default"
    ),
    format: Annotated[str, Opt("--format", "-f", help="jsonl (stdout) or parquet-dir (one file per batch).")] = (
        "jsonl"
    ),
    batch: Annotated[int, Opt(help="Done prompt groups per batch.")] = 64,
    out: Annotated[Path | None, Opt(help="Folder of the parquet-dir batches.")] = None,
    wait: Annotated[bool, Opt("--wait/--no-wait", help="Wait while a run writes the store.")] = True,
    timeout: Annotated[float | None, Opt(help="Seconds to wait for one batch (exit 2 after).")] = None,
) -> None:
    """Stream finished samples in commit order, each batch once per cursor (acknowledged after it is written)."""
    from daskgen.stream.sinks import follow_to

    summary = follow_to(store, format, out, batch_prompts=batch, cursor=cursor, wait=wait, timeout=timeout)
    typer.echo(summary.line(cursor), err=True)


@app.command()
def report(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL).")],
    out: Annotated[Path | None, Opt(help="report.html or report.png (default: STORE.report.html).")] = None,
    overwrite: Annotated[bool, Opt(help="Replace an existing report.")] = False,
) -> None:
    """Write an HTML or PNG report: status counts, response lengths, throughput over time, settings."""
    from daskgen.analysis.report import write_report
    from daskgen.store.location import default_output

    target = out or default_output(store, ".report.html")
    typer.echo(f"daskgen: report written to {write_report(store, target, overwrite=overwrite)}")


@app.command()
def pack(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL).")],
    out: Annotated[
        str | None,
        Opt(help="Write the packed copy here and keep STORE (default: replace STORE; required on object storage)."),
    ] = None,
    scheduler_address: Annotated[str | None, Opt(help="Copy on this Dask scheduler's workers.")] = None,
    n_workers: Annotated[int | None, Opt(help="LocalCluster workers when no scheduler is given.")] = None,
) -> None:
    """Rewrite a store into few files (Zarr sharding, ~64k prompts per shard); rerun to resume an interrupted pack."""
    from daskgen.store.pack import pack as run_pack

    typer.echo(run_pack(store, out, scheduler_address=scheduler_address, n_workers=n_workers).line())


@app.command()
def unpack(
    store: Annotated[str, typer.Argument(help="A packed daskgen store (folder or URL).")],
    out: Annotated[str | None, Opt(help="Write the unpacked copy here and keep STORE.")] = None,
    scheduler_address: Annotated[str | None, Opt(help="Copy on this Dask scheduler's workers.")] = None,
    n_workers: Annotated[int | None, Opt(help="LocalCluster workers when no scheduler is given.")] = None,
) -> None:
    """Rewrite a packed store back to one file per partition, so that a run can resume it."""
    from daskgen.store.pack import pack as run_pack

    typer.echo(run_pack(store, out, unpack=True, scheduler_address=scheduler_address, n_workers=n_workers).line())


@app.command()
def verify(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL).")],
    repair: Annotated[
        bool, Opt(help="Reset the affected partitions to pending, so that a rerun regenerates only them.")
    ] = False,
    scheduler_address: Annotated[str | None, Opt(help="Read the chunks on this Dask scheduler's workers.")] = None,
    progress: Annotated[bool, Opt(help="Show a progress bar.")] = True,
) -> None:
    """Read every chunk (checksums, decoding) and check every finished row; exit 1 when anything is wrong."""
    from daskgen.store.verify import verify as run_verify

    report = run_verify(store, scheduler_address=scheduler_address, progress=progress)
    for line in report.lines():
        typer.echo(line)
    if repair and not report.sound:
        from daskgen.store.generation_store import GenerationStore
        from daskgen.store.repair import repair as run_repair

        done = run_repair(GenerationStore.open(store), report)
        typer.echo(
            f"repaired: {len(done['partitions'])} partition(s) and {len(done['commit_chunks'])} commit chunk(s) "
            f"reset to pending ({len(done['rows'])} rows); rerun the same `daskgen run` command to regenerate them."
        )
    raise typer.Exit(0 if report.sound else 1)


def main() -> None:
    """Entry point: typed daskgen errors become a clear message and exit status 2."""
    try:
        code = app(standalone_mode=False)
    except DaskgenError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # a second SIGTERM/SIGINT: stopped at once, committed work is kept
        sys.exit(130)
    except Exception as exc:  # click usage errors
        import click

        if isinstance(exc, click.exceptions.Abort):  # click's form of KeyboardInterrupt
            sys.exit(130)
        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        raise
    sys.exit(code if isinstance(code, int) else 0)
