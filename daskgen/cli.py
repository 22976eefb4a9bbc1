"""``daskgen`` command line (typer)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from daskgen.cli_flags import given, options_command
from daskgen.errors import DaskgenError
from daskgen.exit_codes import ExitCode
from daskgen.run_options import RunCommand, RunOptions
from daskgen.stream.options import FollowOptions, SinkOptions

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="Distributed LLM generation on Dask with resumable Zarr stores."
)

Opt = typer.Option


@options_command(app, RunOptions, RunCommand)
def run(**values: Any) -> None:
    """Generate (or resume) responses for every prompt into a Zarr store."""
    from daskgen.client.runner import run as run_generation
    from daskgen.config import RunConfig

    command = RunCommand(**given(RunCommand, values))
    cfg = RunConfig.load(command.config, **given(RunOptions, values))
    # the command's cluster flags are merged into the cluster section once (daskgen.config.cluster_section); a
    # SIGTERM from here on: the process shuts down, status kept
    summary = run_generation(cfg, then_exit=True, command=command)
    if command.show:
        from daskgen.analysis.summary import print_answers

        print_answers(cfg.location(), command.show)
    typer.echo(summary.line())
    raise typer.Exit(exit_status(summary))


def exit_status(summary: Any) -> int:
    """OK all done (or stopped early by a stop condition), FAILED some prompt failed, INTERRUPTED (resumable:
    prompts are left pending; an interruption that came after every prompt ended counts as none)."""
    if summary.interrupted and summary.pending:
        return ExitCode.INTERRUPTED
    return ExitCode.OK if summary.failed == 0 else ExitCode.FAILED


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
    images: Annotated[
        str, Opt(help="parquet: reference (each image by hash and store key) or bytes (also OUT.images.parquet).")
    ] = "reference",
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
        images=images,
    )
    typer.echo(result.line())
    if wandb_project:
        typer.echo(f"uploaded {target} to W&B project {wandb_project!r}")


@options_command(app, FollowOptions, SinkOptions)
def follow(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL), also one a run is writing.")],
    **values: Any,
) -> None:
    """Stream finished samples (commit order, or input order within a window), each batch once per cursor."""
    from daskgen.stream.sinks import follow_to

    options = FollowOptions(**given(FollowOptions, values))
    summary = follow_to(store, SinkOptions(**given(SinkOptions, values)), options)
    typer.echo(summary.line(options.cursor), err=True)


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


policy_app = typer.Typer(no_args_is_help=True, help="Publish policy versions for running engines to load.")
app.add_typer(policy_app, name="policy")


@policy_app.command("publish")
def policy_publish(
    store: Annotated[str, typer.Argument(help="The run's daskgen store (folder or URL).")],
    path: Annotated[str, typer.Argument(help="Checkpoint folder (save_pretrained) readable by every worker.")],
    version: Annotated[int, Opt(help="Version number, above the newest published one (the run's model is 0).")],
    scheduler_address: Annotated[
        str | None, Opt(help="The run's Dask scheduler: announce the version there, so workers load it at once.")
    ] = None,
    delta: Annotated[
        bool, Opt(help="Store only what changed since the newest version; workers rebuild it in a local cache.")
    ] = False,
) -> None:
    """Publish a checkpoint as the next policy version; runs with `refresh` load it without restarting."""
    from daskgen.store.policy import publish_policy

    if scheduler_address is None:
        entry = publish_policy(store, path, version, delta=delta)
    else:
        from distributed import Client

        with Client(scheduler_address, timeout="30s") as client:
            entry = publish_policy(store, path, version, client=client, delta=delta)
    stored = f" as a delta on version {entry.base} ({entry.delta})" if entry.delta else ""
    typer.echo(f"daskgen: published policy version {entry.version}: {entry.path}{stored} ({entry.time})")


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
    from daskgen.store.tools.pack import pack as run_pack

    typer.echo(run_pack(store, out, scheduler_address=scheduler_address, n_workers=n_workers).line())


@app.command()
def unpack(
    store: Annotated[str, typer.Argument(help="A packed daskgen store (folder or URL).")],
    out: Annotated[str | None, Opt(help="Write the unpacked copy here and keep STORE.")] = None,
    scheduler_address: Annotated[str | None, Opt(help="Copy on this Dask scheduler's workers.")] = None,
    n_workers: Annotated[int | None, Opt(help="LocalCluster workers when no scheduler is given.")] = None,
) -> None:
    """Rewrite a packed store back to one file per partition, so that a run can resume it."""
    from daskgen.store.tools.pack import pack as run_pack

    typer.echo(run_pack(store, out, unpack=True, scheduler_address=scheduler_address, n_workers=n_workers).line())


@app.command()
def verify(
    store: Annotated[str, typer.Argument(help="A daskgen store (folder or URL).")],
    repair: Annotated[
        bool, Opt(help="Reset the affected partitions to pending, so that a rerun regenerates only them.")
    ] = False,
    scheduler_address: Annotated[str | None, Opt(help="Read the chunks on this Dask scheduler's workers.")] = None,
    progress: Annotated[bool, Opt(help="Show a progress bar.")] = True,
    deep: Annotated[
        bool, Opt(help="Also run the model's image processor again on each stored image and compare grids and spans.")
    ] = False,
) -> None:
    """Read every chunk (checksums, decoding) and check every finished row; exit 1 when anything is wrong."""
    from daskgen.store.tools.verify import verify as run_verify

    report = run_verify(store, scheduler_address=scheduler_address, progress=progress)
    if deep:
        from daskgen.images.deep_check import verify_deeply
        from daskgen.store.generation_store import GenerationStore

        report = verify_deeply(report, GenerationStore.open(store))
    for line in report.lines():
        typer.echo(line)
    if repair and not report.sound:
        from daskgen.store.generation_store import GenerationStore
        from daskgen.store.tools.repair import repair as run_repair

        done = run_repair(GenerationStore.open(store), report)
        typer.echo(
            f"repaired: {len(done['partitions'])} partition(s) and {len(done['commit_chunks'])} commit chunk(s) "
            f"reset to pending ({len(done['rows'])} rows); rerun the same `daskgen run` command to regenerate them."
        )
    raise typer.Exit(ExitCode.OK if report.sound else ExitCode.FAILED)


def main() -> None:
    """Entry point: typed daskgen errors become a clear message and exit status 2."""
    try:
        code = app(standalone_mode=False)
    except DaskgenError as exc:
        typer.echo(f"error: {exc}", err=True)
        sys.exit(ExitCode.ERROR)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:  # a second SIGTERM/SIGINT: stopped at once, committed work is kept
        sys.exit(ExitCode.STOPPED_AT_ONCE)
    except Exception as exc:  # click's usage errors, by shape: typer may carry its own copy of click
        if type(exc).__name__ == "Abort":  # click's form of KeyboardInterrupt
            sys.exit(ExitCode.STOPPED_AT_ONCE)
        show, exit_code = getattr(exc, "show", None), getattr(exc, "exit_code", None)
        if callable(show) and isinstance(exit_code, int):
            show()
            sys.exit(exit_code)
        raise
    sys.exit(code if isinstance(code, int) else ExitCode.OK)
