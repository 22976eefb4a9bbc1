"""What daskgen puts into a worker job's script: the job layout, the prologue lines and the worker arguments.

The script itself is written by dask-jobqueue's job class from the keyword arguments a
:class:`daskgen.deploy.batch.BatchDeployment` assembles; this module supplies the parts every batch
system shares.  The prologue exports the GPU layout for :mod:`daskgen.worker.gpu`, makes the worker
processes non-daemonic (engines start subprocesses) and draws the job's lifetime once, so that all
of a job's workers retire together and different jobs at different times.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from daskgen.node import ENV_GPUS_PER_WORKER, ENV_LOCAL_RANK, ENV_WORKERS_PER_NODE

__all__ = ["DAEMON_ENV", "LIFETIME_VAR", "NANNY_PRELOAD", "JobLayout", "has_flag", "prologue_lines", "worker_arguments"]

#: Dask's setting that makes worker processes daemonic, as an environment variable.
DAEMON_ENV = "DASK_DISTRIBUTED__WORKER__DAEMON"
#: Shell variable holding the job's drawn worker lifetime in seconds.
LIFETIME_VAR = "DASKGEN_WORKER_LIFETIME"
#: Nanny preload that keeps glibc's malloc defaults and drains workers on SIGTERM.
NANNY_PRELOAD = "daskgen.worker.nanny"


@dataclass(frozen=True)
class JobLayout:
    """How one job (one node) is cut into workers."""

    gpus_per_node: int
    gpus_per_worker: int
    workers_per_node: int
    threads_per_worker: int
    cpus: int | None  # CPUs to request per job; None lets the configuration or the threads decide


def prologue_lines(layout: JobLayout, lifetime: tuple[int, int] | None, extra: Sequence[str]) -> list[str]:
    """daskgen's environment lines, then ``extra`` (the configured and the run's prologue lines)."""
    lines = [
        f"unset {ENV_LOCAL_RANK}",  # sbatch/qsub may copy it from the submitting shell
        f"export {DAEMON_ENV}=False",
        f"export {ENV_WORKERS_PER_NODE}={layout.workers_per_node}",
    ]
    if layout.gpus_per_node:
        lines.append(f"export {ENV_GPUS_PER_WORKER}={layout.gpus_per_worker}")
    if lifetime is not None and lifetime[1] > 0:
        # One draw per job: all of a job's workers retire together, different jobs at different times.
        lines.append(f"{LIFETIME_VAR}=$(( {lifetime[0]} - (RANDOM * 32768 + RANDOM) % {lifetime[1] + 1} ))")
    return lines + list(extra)


def worker_arguments(layout: JobLayout, lifetime: tuple[int, int] | None, given: Sequence[str]) -> list[str]:
    """``given`` (configured and run ``dask worker`` arguments) plus GPU resources, the nanny preload and the
    lifetime, each unless ``given`` already has it."""
    args = list(given)
    if layout.gpus_per_node and not has_flag(args, "--resources"):
        args += ["--resources", f"GPU={layout.gpus_per_worker}"]
    if NANNY_PRELOAD not in args:
        args += ["--preload-nanny", NANNY_PRELOAD]  # see daskgen/worker/nanny.py
    if lifetime is not None and not has_flag(args, "--lifetime"):
        value = f"${{{LIFETIME_VAR}}}s" if lifetime[1] > 0 else f"{lifetime[0]}s"
        args += ["--lifetime", value]
    return args


def has_flag(args: Iterable[str], flag: str) -> bool:
    """Whether ``args`` contain ``flag`` (as ``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)
