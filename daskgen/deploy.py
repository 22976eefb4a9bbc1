"""Build the Dask cluster a run executes on: a local cluster, or SLURM/PBS jobs via dask-jobqueue.

The ``cluster:`` section of a run config (see ``docs/hpc.md``) is a flat mapping; ``kind`` picks
the backend.  On GPU nodes every job starts one Dask worker process per GPU (``--nworkers``),
each advertising ``--resources GPU=<gpus_per_worker>`` and running ``threads_per_worker`` task
slots (the in-flight window of partitions).  Worker processes are non-daemonic so engines can
start subprocesses, and every worker retires shortly before the job's walltime (``--lifetime``)
so that adaptive scaling submits a replacement job in time.  Anything the spec leaves out comes
from dask's ``jobqueue.<kind>.*`` configuration (``~/.config/dask/jobqueue.yaml``), as with
plain dask-jobqueue; list settings (prologue, directives, worker arguments) extend the
configured ones.  ``dask_jobqueue`` is optional (extra ``[hpc]``) and imported lazily.
SLURM/PBS clusters use TLS with a per-run certificate unless ``cluster.tls`` is false
(:mod:`daskgen.security`).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dask
from dask.utils import parse_bytes, parse_timedelta

from daskgen.errors import ConfigError
from daskgen.gpu import ENV_GPUS_PER_WORKER, ENV_LOCAL_RANK, ENV_WORKERS_PER_NODE, count_visible_gpus
from daskgen.security import (
    RemoveTLSFilesOnClose,
    TLSFiles,
    cluster_tls,
    job_script_security,
    temporary_security,
    tls_directory,
    warn_insecure,
)

__all__ = [
    "CLUSTER_KEYS",
    "DEFAULT_THREADS_PER_WORKER",
    "KINDS",
    "ClusterInfo",
    "ClusterSpec",
    "apply_cli_overrides",
    "jobqueue_kwargs",
    "make_cluster",
    "parse_cluster_spec",
    "parse_walltime",
    "render_job_script",
    "worker_lifetime",
]

KINDS = ("local", "slurm", "pbs")
#: Task slots per worker: how many partitions one engine has in flight at once.
DEFAULT_THREADS_PER_WORKER = 4
DAEMON_ENV = "DASK_DISTRIBUTED__WORKER__DAEMON"
#: Key prefix of the runner's partition tasks (``daskgen-partition-<start>-<ns>``).
PARTITION_TASK_PREFIX = "daskgen-partition"
#: First guess of a partition's duration for adaptive scaling, until real ones are measured.
DEFAULT_PARTITION_DURATION = "60s"
_LIFETIME_VAR = "DASKGEN_WORKER_LIFETIME"

#: Every accepted key of the ``cluster:`` section, with the kinds it applies to and its meaning.
CLUSTER_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    "kind": (KINDS, "local | slurm | pbs (default local)"),
    "threads_per_worker": (KINDS, f"partitions in flight per worker (default {DEFAULT_THREADS_PER_WORKER})"),
    "gpus_per_worker": (KINDS, "GPUs per worker/engine, >1 for tensor parallelism (default 1)"),
    "min_workers": (KINDS, "adaptive scaling lower bound, in workers"),
    "max_workers": (KINDS, "adaptive scaling upper bound, in workers"),
    "local_directory": (KINDS, "worker scratch directory (e.g. $TMPDIR, /scratch/$USER)"),
    "dashboard_address": (KINDS, "scheduler dashboard address (default :8787)"),
    "n_workers": (("local",), "worker processes (default: visible GPUs, else a CPU-based count)"),
    "memory_limit": (("local",), "memory limit per worker (default: machine memory / workers)"),
    "nodes": (("slurm", "pbs"), "jobs (nodes) of a fixed-size cluster (default 1)"),
    "gpus_per_node": (("slurm", "pbs"), "GPUs per job; one worker per gpus_per_worker of them (default 0)"),
    "workers_per_node": (("slurm", "pbs"), "worker processes per job on CPU-only nodes"),
    "cpus_per_gpu": (("slurm", "pbs"), "CPUs requested per GPU"),
    "cores": (("slurm", "pbs"), "CPUs requested per job (alternative to cpus_per_gpu)"),
    "memory": (("slurm", "pbs"), "memory per job, e.g. '480GB' (split evenly between workers)"),
    "walltime": (("slurm", "pbs"), "job time limit, a quoted string like '04:00:00'"),
    "queue": (("slurm", "pbs"), "queue / partition"),
    "partition": (("slurm",), "alias of queue"),
    "account": (("slurm", "pbs"), "account / project to charge"),
    "job_name": (("slurm", "pbs"), "batch job name"),
    "job_script_prologue": (("slurm", "pbs"), "shell lines run before the workers (module load, conda)"),
    "job_extra_directives": (("slurm", "pbs"), "extra #SBATCH / #PBS directives"),
    "job_directives_skip": (("slurm", "pbs"), "generated directives to drop (substring match)"),
    "worker_extra_args": (("slurm", "pbs"), "extra `dask worker` arguments"),
    "lifetime": (("slurm", "pbs"), "'auto' (from walltime, default), a duration, or false"),
    "lifetime_margin": (("slurm", "pbs"), "time kept free before walltime (default 10%, 2-10 min)"),
    "lifetime_stagger": (("slurm", "pbs"), "random spread of job retirements (default 5%, 1-10 min)"),
    "interface": (("slurm", "pbs"), "network interface of scheduler and workers (e.g. ib0)"),
    "log_directory": (("slurm", "pbs"), "directory for the jobs' stdout/stderr"),
    "python": (("slurm", "pbs"), "python executable on the compute nodes"),
    "resource_spec": (("pbs",), "full '#PBS -l' resource line (replaces the generated select=...)"),
    "tls": (KINDS, "TLS with a per-run certificate (default true for slurm/pbs, false for local)"),
    "tls_directory": (("slurm", "pbs"), "where the per-run certificate files go; shared with the nodes "
                                        "(default ~/.daskgen/tls)"),
}

_LIST_KEYS = ("job_script_prologue", "job_extra_directives", "job_directives_skip", "worker_extra_args")
_STR_KEYS = (
    "local_directory", "dashboard_address", "memory", "queue", "partition", "account", "job_name",
    "interface", "log_directory", "python", "resource_spec", "memory_limit", "tls_directory",
)
_INT_KEYS = {  # key -> smallest accepted value
    "threads_per_worker": 1, "gpus_per_worker": 1, "min_workers": 0, "max_workers": 1, "n_workers": 1,
    "nodes": 1, "gpus_per_node": 0, "workers_per_node": 1, "cpus_per_gpu": 1, "cores": 1,
}


@dataclass(frozen=True)
class ClusterSpec:
    """A validated ``cluster:`` section.  ``None`` means "not given": defaults apply later."""

    kind: str = "local"
    values: Mapping[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` when the spec does not set it."""
        value = self.values.get(key)
        return default if value is None else value


@dataclass(frozen=True)
class ClusterInfo:
    """What :func:`make_cluster` built, for logs and for sizing the runner's submission window."""

    kind: str
    workers_per_node: int
    threads_per_worker: int
    gpus_per_worker: int
    min_workers: int
    max_workers: int
    adaptive: bool
    lifetime: str | None = None
    notes: tuple[str, ...] = ()
    dashboard: str | None = None

    @property
    def in_flight_window(self) -> int:
        """Partitions to keep submitted so every worker slot is busy and adaptivity scales up.

        The scheduler's adaptive target is roughly (queued + running tasks) / threads per
        worker, so the client must keep at least ``max_workers * threads_per_worker`` tasks
        submitted for the cluster to grow to ``max_workers``.
        """
        return self.max_workers * self.threads_per_worker

    def __str__(self) -> str:
        gpus = f", {self.gpus_per_worker} GPU(s) each" if self.gpus_per_worker else ""
        size = (
            f"adaptive {self.min_workers}..{self.max_workers} workers"
            if self.adaptive
            else f"{self.max_workers} workers"
        )
        text = (
            f"{self.kind} cluster: {size}, {self.workers_per_node} per node{gpus}, "
            f"{self.threads_per_worker} partitions in flight per worker"
        )
        if self.lifetime:
            text += f"; {self.lifetime}"
        if self.dashboard:
            text += f"; dashboard {self.dashboard}"
        return "; ".join([text, *self.notes])


# --------------------------------------------------------------------------------------------
# validation


def parse_cluster_spec(spec: Mapping[str, Any] | None) -> ClusterSpec:
    """Validate a ``cluster:`` section.

    Parameters
    ----------
    spec
        The mapping from the run config (``None`` or empty means a local cluster).

    Returns
    -------
    ClusterSpec
        The kind and the given values, type-checked.  Keys valid for another kind are kept (so
        ``--cluster local`` works with a SLURM config) and ignored when building.

    Raises
    ------
    ConfigError
        For an unknown key (the message lists the valid ones) or a wrongly typed value.
    """
    spec = dict(spec or {})
    unknown = sorted(set(spec) - set(CLUSTER_KEYS))
    if unknown:
        valid = "\n".join(f"  {k}: {doc} [{', '.join(kinds)}]" for k, (kinds, doc) in CLUSTER_KEYS.items())
        raise ConfigError(f"unknown key(s) in the cluster section: {', '.join(unknown)}. Valid keys:\n{valid}")
    kind = str(spec.pop("kind", None) or "local").lower()
    if kind not in KINDS:
        raise ConfigError(f"cluster kind must be one of {', '.join(KINDS)}, got {kind!r}")
    values = {key: _check_value(key, value) for key, value in spec.items() if value is not None}
    if "queue" in values and "partition" in values and values["queue"] != values["partition"]:
        raise ConfigError(f"cluster.queue={values['queue']!r} and cluster.partition={values['partition']!r} differ")
    if "cpus_per_gpu" in values and "cores" in values:
        raise ConfigError("give either cluster.cpus_per_gpu or cluster.cores, not both")
    return ClusterSpec(kind, values)


def _check_value(key: str, value: Any) -> Any:
    """Type-check one value; lists may be given as one multi-line string."""
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int) or value < _INT_KEYS[key]:
            raise ConfigError(f"cluster.{key} must be an integer >= {_INT_KEYS[key]}, got {value!r}")
        return value
    if key in _LIST_KEYS:
        return _str_list(key, value)
    if key in _STR_KEYS:
        return _str_value(key, value)
    if key == "walltime" and not isinstance(value, str):
        raise ConfigError(
            f"cluster.walltime must be a string like '04:00:00', got {value!r} ({type(value).__name__}); "
            "quote it in YAML (unquoted 30:00 is read as the base-60 integer 1800)"
        )
    if key in ("lifetime", "lifetime_margin", "lifetime_stagger"):
        _check_duration(key, value)
    if key == "tls":
        cluster_tls("local", value)  # raises unless a boolean
    return value


def _str_value(key: str, value: Any) -> str:
    """A string value (numbers such as a memory size of 64 are accepted and stringified)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"cluster.{key} must be a string, got {value!r}")
    return str(value)


def _str_list(key: str, value: Any) -> list[str]:
    """A list of strings; a single string is split into lines."""
    if isinstance(value, str):
        return [line for line in value.splitlines() if line.strip()]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"cluster.{key} must be a list of strings, got {value!r}")


def _check_duration(key: str, value: Any) -> None:
    """Durations are dask timedeltas ('55m', '1h', 90); lifetime also takes 'auto' and false."""
    if key == "lifetime" and (value is False or str(value).lower() in ("auto", "off", "none", "false")):
        return
    try:
        parse_timedelta(value, default="s")
    except (ValueError, TypeError, KeyError):
        raise ConfigError(f"cluster.{key} must be a duration like '55m' or 3300, got {value!r}") from None


def apply_cli_overrides(
    section: Mapping[str, Any] | None,
    *,
    kind: str | None = None,
    min_workers: int | None = None,
    max_workers: int | None = None,
) -> dict[str, Any]:
    """Merge command-line flags (``--cluster``, ``--min-workers``, ``--max-workers``) over a config section."""
    merged = dict(section or {})
    for key, value in (("kind", kind), ("min_workers", min_workers), ("max_workers", max_workers)):
        if value is not None:
            merged[key] = value
    return merged


# --------------------------------------------------------------------------------------------
# walltime and lifetimes


_SLURM_WALLTIME = re.compile(r"^(?:(?P<d>\d+)-)?(?P<rest>\d+(?::\d+){0,2})$")


def parse_walltime(value: str, kind: str = "slurm") -> float:
    """Seconds in a batch-system walltime.

    SLURM accepts ``M``, ``M:S``, ``H:M:S``, ``D-H``, ``D-H:M`` and ``D-H:M:S``; PBS accepts
    ``[[H:]M:]S``.  A bare number is minutes for SLURM and seconds for PBS.

    Raises
    ------
    ConfigError
        When the text is not a walltime.
    """
    match = _SLURM_WALLTIME.match(str(value).strip())
    if match is None or (match["d"] and kind != "slurm"):
        raise ConfigError(f"cannot read walltime {value!r} for {kind} (expected e.g. '04:00:00')")
    parts = [int(p) for p in match["rest"].split(":")]
    if match["d"] is not None:  # D-H, D-H:M, D-H:M:S
        parts += [0] * (3 - len(parts))
        hours, minutes, seconds = parts
        return float(int(match["d"]) * 86400 + hours * 3600 + minutes * 60 + seconds)
    if len(parts) == 3:
        return float(parts[0] * 3600 + parts[1] * 60 + parts[2])
    if len(parts) == 2:
        return float(parts[0] * 60 + parts[1])
    return float(parts[0] * 60 if kind == "slurm" else parts[0])


def worker_lifetime(
    walltime_s: float, margin_s: float | None = None, stagger_s: float | None = None
) -> tuple[int, int]:
    """Longest worker lifetime and its random spread, so workers retire before the walltime.

    Each job retires after ``lifetime - U(0, stagger)``; with the defaults (margin 10% of the
    walltime clamped to 2-10 min, stagger 5% clamped to 1-10 min) a 1-hour job retires between
    51 and 54 minutes.

    Returns
    -------
    (lifetime_s, stagger_s)

    Raises
    ------
    ConfigError
        When the walltime leaves less than a minute of work after margin and stagger.
    """
    margin = _clamp(0.10 * walltime_s, 120, 600) if margin_s is None else margin_s
    stagger = _clamp(0.05 * walltime_s, 60, 600) if stagger_s is None else stagger_s
    lifetime = walltime_s - margin
    if lifetime - stagger < 60:
        raise ConfigError(
            f"walltime of {walltime_s:.0f}s is too short for a worker lifetime with a {margin:.0f}s "
            f"margin and {stagger:.0f}s stagger; raise the walltime, lower cluster.lifetime_margin/"
            "lifetime_stagger, or set cluster.lifetime: false"
        )
    return int(lifetime), int(stagger)


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


def _lifetime_plan(s: ClusterSpec) -> tuple[int, int] | None:
    """(lifetime_s, stagger_s) for this spec, or ``None`` when lifetimes are off."""
    raw = s.get("lifetime", "auto")
    if raw is False or str(raw).lower() in ("off", "none", "false"):
        return None
    margin = _seconds(s.get("lifetime_margin"))
    stagger = _seconds(s.get("lifetime_stagger"))
    if str(raw).lower() != "auto":
        return int(parse_timedelta(raw, default="s")), int(stagger or 0)
    walltime = s.get("walltime") or dask.config.get(f"jobqueue.{s.kind}.walltime", None)
    if not walltime:
        return None
    return worker_lifetime(parse_walltime(str(walltime), s.kind), margin, stagger)


def _seconds(value: Any) -> float | None:
    return None if value is None else float(parse_timedelta(value, default="s"))


# --------------------------------------------------------------------------------------------
# dask-jobqueue keyword arguments


@dataclass(frozen=True)
class _Layout:
    """How one job is cut into workers."""

    gpus_per_node: int
    gpus_per_worker: int
    workers_per_node: int
    threads_per_worker: int
    cpus: int | None  # CPUs to request per job; None lets the config/threads decide


def _layout(s: ClusterSpec) -> _Layout:
    """Workers, threads and CPUs per job from the spec and the ``jobqueue.<kind>`` config."""
    gpus = s.get("gpus_per_node", 0)
    per_worker = s.get("gpus_per_worker", 1)
    threads = s.get("threads_per_worker", DEFAULT_THREADS_PER_WORKER)
    if gpus:
        if gpus % per_worker:
            raise ConfigError(f"cluster.gpus_per_node={gpus} is not a multiple of gpus_per_worker={per_worker}")
        workers = gpus // per_worker
        if s.get("workers_per_node", workers) != workers:
            raise ConfigError(
                f"cluster.workers_per_node={s.get('workers_per_node')} contradicts gpus_per_node={gpus} / "
                f"gpus_per_worker={per_worker} = {workers}; drop workers_per_node on GPU nodes"
            )
    else:
        workers = s.get("workers_per_node") or dask.config.get(f"jobqueue.{s.kind}.processes", None) or 1
    per_gpu = s.get("cpus_per_gpu") if gpus else None
    cpus = per_gpu * gpus if per_gpu else s.get("cores") or _config_cpus(s.kind)
    # Task slots are not CPUs (partition tasks are async and wait on the engine): by default a
    # job asks for at most DEFAULT_THREADS_PER_WORKER CPUs per worker however many slots it runs.
    cpus = cpus or int(workers) * min(threads, DEFAULT_THREADS_PER_WORKER)
    return _Layout(gpus, per_worker if gpus else 0, int(workers), threads, cpus)


def _config_cpus(kind: str) -> int | None:
    """CPUs per job from jobqueue config: ``job-cpu`` (SLURM) or ``cores``."""
    job_cpu = dask.config.get(f"jobqueue.{kind}.job-cpu", None) if kind == "slurm" else None
    return job_cpu or dask.config.get(f"jobqueue.{kind}.cores", None)


def _config_list(kind: str, key: str) -> list[str]:
    return list(dask.config.get(f"jobqueue.{kind}.{key}", None) or [])


def _memory(s: ClusterSpec) -> str:
    memory = s.get("memory") or dask.config.get(f"jobqueue.{s.kind}.memory", None)
    if not memory:
        raise ConfigError(
            f"cluster.memory is required for {s.kind} (memory per job, e.g. '480GB'), "
            f"or set jobqueue.{s.kind}.memory in your dask config"
        )
    try:
        parse_bytes(memory)
    except ValueError:
        raise ConfigError(f"cluster.memory must be a size like '480GB', got {memory!r}") from None
    return str(memory)


def _prologue(s: ClusterSpec, layout: _Layout, lifetime: tuple[int, int] | None) -> list[str]:
    """Our environment lines, then the configured and the spec's prologue lines."""
    lines = [
        f"unset {ENV_LOCAL_RANK}",  # sbatch/qsub may copy it from the submitting shell
        f"export {DAEMON_ENV}=False",
        f"export {ENV_WORKERS_PER_NODE}={layout.workers_per_node}",
    ]
    if layout.gpus_per_node:
        lines.append(f"export {ENV_GPUS_PER_WORKER}={layout.gpus_per_worker}")
    if lifetime is not None and lifetime[1] > 0:
        # One draw per job: all of a job's workers retire together, different jobs at different times.
        lines.append(f"{_LIFETIME_VAR}=$(( {lifetime[0]} - (RANDOM * 32768 + RANDOM) % {lifetime[1] + 1} ))")
    return lines + _config_list(s.kind, "job-script-prologue") + s.get("job_script_prologue", [])


def _worker_args(s: ClusterSpec, layout: _Layout, lifetime: tuple[int, int] | None) -> list[str]:
    """Configured and spec ``dask worker`` arguments plus GPU resources and the lifetime."""
    args = _config_list(s.kind, "worker-extra-args") + s.get("worker_extra_args", [])
    if layout.gpus_per_node and not _has_flag(args, "--resources"):
        args += ["--resources", f"GPU={layout.gpus_per_worker}"]
    if "daskgen.nanny_preload" not in args:
        args += ["--preload-nanny", "daskgen.nanny_preload"]  # see daskgen/nanny_preload.py
    if lifetime is not None and not _has_flag(args, "--lifetime"):
        value = f"${{{_LIFETIME_VAR}}}s" if lifetime[1] > 0 else f"{lifetime[0]}s"
        args += ["--lifetime", value]
    return args


def _has_flag(args: Iterable[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _directives(s: ClusterSpec, layout: _Layout) -> list[str]:
    """Configured and spec directives, plus the SLURM GPU request unless one is already there."""
    directives = _config_list(s.kind, "job-extra-directives") + s.get("job_extra_directives", [])
    gpu_given = any(re.match(r"^\s*(--gres|--gpus|-G\b)", d) for d in directives)
    if s.kind == "slurm" and layout.gpus_per_node and not gpu_given:
        directives.append(f"--gres=gpu:{layout.gpus_per_node}")
    if s.kind == "slurm" and not any(re.match(r"^\s*--signal", d) for d in directives):
        directives.append(f"--signal=B:TERM@{SIGNAL_LEAD_S}")
    return directives


#: SLURM signals a worker job's batch shell (the ``dask worker`` command, exec'd) this many seconds
#: before its walltime, so its workers drain (hand back in-flight work) before SLURM kills the job.
SIGNAL_LEAD_S = 120


def _exec_python(s: ClusterSpec, given: str | None) -> str:
    """The job's python prefixed with ``exec``: the batch shell becomes ``dask worker`` and gets SIGTERM."""
    import sys

    python = given or dask.config.get(f"jobqueue.{s.kind}.python", None) or sys.executable
    return python if python.lstrip().startswith("exec ") else f"exec {python}"


def _pbs_resource_spec(s: ClusterSpec, layout: _Layout, memory: str) -> str | None:
    """The ``-l select=...`` line with ``ngpus``, unless the spec or config gives one."""
    given = s.get("resource_spec") or dask.config.get("jobqueue.pbs.resource-spec", None)
    if given:
        return str(given)
    from dask_jobqueue.pbs import pbs_format_bytes_ceil

    cpus = layout.cpus or layout.workers_per_node * layout.threads_per_worker
    spec = f"select=1:ncpus={cpus}"
    if layout.gpus_per_node:
        spec += f":ngpus={layout.gpus_per_node}"
    return spec + f":mem={pbs_format_bytes_ceil(parse_bytes(memory))}"


def jobqueue_kwargs(spec: Mapping[str, Any] | ClusterSpec) -> dict[str, Any]:
    """Keyword arguments for ``SLURMCluster``/``PBSCluster`` (and their Job classes).

    Only what daskgen needs or the spec gives is set; the rest stays to dask-jobqueue's
    ``jobqueue.<kind>.*`` configuration.

    Raises
    ------
    ConfigError
        For a local spec, a missing memory size or an inconsistent layout.
    """
    s = spec if isinstance(spec, ClusterSpec) else parse_cluster_spec(spec)
    if s.kind == "local":
        raise ConfigError("jobqueue_kwargs() is for kind slurm or pbs, not local")
    _job_class(s.kind)  # importing dask_jobqueue loads its jobqueue.* config defaults (e.g. walltime)
    layout, lifetime, memory = _layout(s), _lifetime_plan(s), _memory(s)
    kwargs: dict[str, Any] = {
        "processes": layout.workers_per_node,
        "cores": layout.workers_per_node * layout.threads_per_worker,  # -> --nthreads per worker
        "memory": memory,
        "job_script_prologue": _prologue(s, layout, lifetime),
        "worker_extra_args": _worker_args(s, layout, lifetime),
        "job_extra_directives": _directives(s, layout),
    }
    if s.kind == "slurm" and layout.cpus:
        kwargs["job_cpu"] = layout.cpus
    if s.kind == "pbs":
        kwargs["resource_spec"] = _pbs_resource_spec(s, layout, memory)
    for key in ("walltime", "account", "local_directory", "interface", "log_directory", "python", "job_name"):
        if s.get(key) is not None:
            kwargs[key] = s.get(key)
    if s.kind == "slurm":
        kwargs["python"] = _exec_python(s, kwargs.get("python"))
    queue = s.get("queue") or s.get("partition")
    if queue:
        kwargs["queue"] = queue
    if s.get("job_directives_skip"):
        kwargs["job_directives_skip"] = _config_list(s.kind, "job-directives-skip") + s.get("job_directives_skip")
    return kwargs


def _job_class(kind: str) -> type:
    try:
        from dask_jobqueue.pbs import PBSJob
        from dask_jobqueue.slurm import SLURMJob
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"cluster kind {kind!r} needs dask-jobqueue: pip install 'daskgen[hpc]'") from exc
    return {"slurm": SLURMJob, "pbs": PBSJob}[kind]


def render_job_script(spec: Mapping[str, Any] | ClusterSpec, scheduler_address: str, security: Any = None) -> str:
    """The batch script of one worker job, for a scheduler you started yourself.

    Submit it with ``sbatch``/``qsub`` as many times as you want nodes.  Workers are named
    ``daskgen-$SLURM_JOB_ID-<i>`` (``$PBS_JOBID`` on PBS) so that several jobs never clash.
    No scheduler is started.  For a ``tls://`` scheduler the workers get ``--protocol tls://``
    and ``--tls-ca-file``/``--tls-cert``/``--tls-key``: the files of ``security`` (a
    :class:`distributed.security.Security` naming files), by default those of Dask's
    ``distributed.comm.tls.ca-file`` and ``distributed.comm.tls.worker.*`` configuration.

    Raises
    ------
    ConfigError
        A bad spec, or a ``tls://`` scheduler without worker certificate files.
    """
    s = spec if isinstance(spec, ClusterSpec) else parse_cluster_spec(spec)
    kwargs = jobqueue_kwargs(s)
    security = job_script_security(scheduler_address, security)
    if security is not None:
        kwargs.update(security=security, protocol="tls://")
    job_id = "${SLURM_JOB_ID}" if s.kind == "slurm" else "${PBS_JOBID}"
    job = _job_class(s.kind)(scheduler=scheduler_address, name=f"daskgen-{job_id}", **kwargs)
    return job.job_script()


# --------------------------------------------------------------------------------------------
# clusters


class _JobReaperMixin:
    """Forget a multi-worker job once all of its workers have left.

    ``SpecCluster`` only notices a finished job when the departing worker's name is the job's
    name, which is not the case with ``--nworkers N`` (workers ``<job>-0 ... <job>-{N-1}``): a
    job that reached its walltime would stay in the plan forever and adaptive scaling would
    never replace it.  After ``distributed.deploy.lost-worker-timeout`` without any of its
    workers, the job is closed and dropped, so the cluster resubmits it.
    """

    def _update_worker_status(self, op: str, msg: Any) -> None:
        if op == "remove":
            info = self.scheduler_info["workers"].get(msg)  # type: ignore[attr-defined]
            job = self._job_of(str(info["name"])) if info else None
            if job is not None:
                delay = parse_timedelta(dask.config.get("distributed.deploy.lost-worker-timeout"))
                handle = self.workers.get(job)  # type: ignore[attr-defined]
                asyncio.get_running_loop().call_later(delay, self._reap_if_gone, job, handle)
        super()._update_worker_status(op, msg)  # type: ignore[misc]

    def _job_members(self, job: Any) -> set[str]:
        group = self.worker_spec.get(job, {}).get("group", ())  # type: ignore[attr-defined]
        return {f"{job}{suffix}" for suffix in group}

    def _job_of(self, worker_name: str) -> Any:
        for job in self.worker_spec:  # type: ignore[attr-defined]
            if worker_name in self._job_members(job):
                return job
        return None

    def _reap_if_gone(self, job: Any, handle: Any) -> None:
        if handle is None or self.workers.get(job) is not handle:  # type: ignore[attr-defined]
            return  # already closed, or already replaced by a new job of the same name
        members = self._job_members(job)
        alive = {str(w["name"]) for w in self.scheduler_info["workers"].values()}  # type: ignore[attr-defined]
        if not members & alive:
            self._futures.add(asyncio.ensure_future(self.workers[job].close()))  # type: ignore[attr-defined]
            del self.workers[job]  # type: ignore[attr-defined]


def job_of_worker(worker_state: Any) -> str:
    """Adaptive grouping key: the job of a worker named ``<job>-<i>`` (scale down whole jobs only)."""
    return str(worker_state.name).rsplit("-", 1)[0]


def _cluster_class(kind: str) -> type:
    try:
        from dask_jobqueue import PBSCluster, SLURMCluster
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConfigError(f"cluster kind {kind!r} needs dask-jobqueue: pip install 'daskgen[hpc]'") from exc
    base = {"slurm": SLURMCluster, "pbs": PBSCluster}[kind]
    return type(base.__name__, (RemoveTLSFilesOnClose, _JobReaperMixin, base), {"__module__": __name__})


def _scaling(s: ClusterSpec, workers_per_node: int) -> tuple[int, int, bool]:
    """(min_workers, max_workers, adaptive) — fixed size is adaptive with min == max."""
    lo, hi = s.get("min_workers"), s.get("max_workers")
    if lo is None and hi is None:
        n = s.get("nodes", 1) * workers_per_node
        return n, n, False
    lo = lo or 0
    hi = hi if hi is not None else max(lo, s.get("nodes", 1) * workers_per_node)
    if hi < lo or hi < 1:
        raise ConfigError(f"cluster.max_workers={hi} must be >= 1 and >= min_workers={lo}")
    return lo, hi, True


def _declare_partition_duration() -> None:
    """Tell the (in-process) scheduler that partition tasks are long before the first one ends.

    Adaptive scaling sizes the cluster from the expected duration of queued tasks; an unknown
    task counts 0.5 s, which would keep an elastic cluster at one or two workers until the first
    partition (minutes, engine start included) has finished.  A configured value wins.
    """
    durations = dict(dask.config.get("distributed.scheduler.default-task-durations", None) or {})
    if PARTITION_TASK_PREFIX not in durations:
        durations[PARTITION_TASK_PREFIX] = DEFAULT_PARTITION_DURATION
        dask.config.set({"distributed.scheduler.default-task-durations": durations})


def _make_hpc_cluster(s: ClusterSpec) -> tuple[Any, ClusterInfo]:
    kwargs = jobqueue_kwargs(s)
    _declare_partition_duration()
    layout, lifetime = _layout(s), _lifetime_plan(s)
    if s.get("dashboard_address"):
        options = dict(dask.config.get(f"jobqueue.{s.kind}.scheduler-options", None) or {})
        kwargs["scheduler_options"] = {**options, "dashboard_address": s.get("dashboard_address")}
    files = _hpc_tls_files(s)
    if files is not None:
        kwargs["security"] = files.security  # dask-jobqueue adds --protocol tls:// and the --tls-* files
    cluster = _cluster_class(s.kind)(**kwargs)
    cluster.tls_files = files
    lo, hi, adaptive = _scaling(s, layout.workers_per_node)
    # Always adaptive: with min == max the cluster still resubmits jobs that hit their walltime.
    key = {"worker_key": job_of_worker} if layout.workers_per_node > 1 else {}
    cluster.adapt(minimum=lo, maximum=hi, **key)
    life = None
    if lifetime is not None:
        life = f"workers retire {lifetime[0] - lifetime[1]}-{lifetime[0]}s after start (before walltime)"
    info = ClusterInfo(
        s.kind, layout.workers_per_node, layout.threads_per_worker, layout.gpus_per_worker,
        lo, hi, adaptive, life, _tls_notes(files) + _ignored_notes(s), _dashboard(cluster),
    )
    return cluster, info


def _hpc_tls_files(s: ClusterSpec) -> TLSFiles | None:
    """A per-run certificate in files the worker jobs can read, or ``None`` (with a warning) without TLS."""
    if not cluster_tls(s.kind, s.get("tls")):
        warn_insecure(s.kind)
        return None
    return TLSFiles(temporary_security(), tls_directory(s.kind, s.get("tls_directory")))


def _tls_notes(files: TLSFiles | None) -> tuple[str, ...]:
    if files is None:
        return ("TLS off (--insecure)",)
    return (f"TLS with a per-run certificate in {files.directory}",)


def _local_workers(s: ClusterSpec, gpus: int) -> tuple[int, int]:
    """(n_workers, gpus_per_worker) for a local cluster."""
    per_worker = s.get("gpus_per_worker", 1)
    if gpus:
        slots = gpus // per_worker
        if slots == 0:
            raise ConfigError(f"cluster.gpus_per_worker={per_worker} but only {gpus} GPU(s) are visible")
        n = s.get("n_workers", slots)
        if n > slots:
            raise ConfigError(f"cluster.n_workers={n} needs {n * per_worker} GPUs, only {gpus} are visible")
        return n, per_worker
    cpus = os.cpu_count() or 1
    return s.get("n_workers", max(1, min(4, cpus // 4))), 0


def _keep_glibc_malloc_defaults() -> None:
    """Stop the nanny from exporting ``MALLOC_TRIM_THRESHOLD_`` to engine workers.

    Dask's default ``distributed.nanny.pre-spawn-environ`` sets ``MALLOC_TRIM_THRESHOLD_=65536``. A fixed
    threshold turns off glibc's dynamic mmap threshold, so every large tensor buffer of an inference
    step is mmap'ed and unmapped again: the ``transformers`` engine generated 1.6-1.8x fewer tokens per
    second on CPU with it (benchmarks/overhead.py, engine part).  Like the daemon setting, nannies read
    this whenever they (re)start a worker, so it is changed process-wide.
    """
    environ = dict(dask.config.get("distributed.nanny.pre-spawn-environ", None) or {})
    if environ.pop("MALLOC_TRIM_THRESHOLD_", None) is not None:
        dask.config.set({"distributed.nanny.pre-spawn-environ": environ})


def _make_local_cluster(s: ClusterSpec) -> tuple[Any, ClusterInfo]:
    from distributed import LocalCluster

    gpus = count_visible_gpus()
    n, per_worker = _local_workers(s, gpus)
    if gpus and (s.get("min_workers") is not None or s.get("max_workers") is not None):
        raise ConfigError("min_workers/max_workers (adaptive scaling) are not supported on a local GPU machine")
    threads = s.get("threads_per_worker", DEFAULT_THREADS_PER_WORKER if gpus else 2)
    # Read by each Nanny whenever it (re)starts a worker process, so it must stay set globally.
    dask.config.set({"distributed.worker.daemon": False})
    _keep_glibc_malloc_defaults()
    intra_op = str(max(1, (os.cpu_count() or 1) // n))  # undo the nanny's OMP_NUM_THREADS=1 for CPU engines
    kwargs: dict[str, Any] = {
        "n_workers": n,
        "threads_per_worker": threads,
        "processes": True,
        "dashboard_address": s.get("dashboard_address", ":0"),
        "env": {
            "OMP_NUM_THREADS": intra_op,
            "MKL_NUM_THREADS": intra_op,
            ENV_WORKERS_PER_NODE: str(n),
            ENV_LOCAL_RANK: "",  # workers are named 0..n-1: the name is the rank
        },
    }
    if per_worker:
        kwargs["resources"] = {"GPU": per_worker}
        kwargs["env"][ENV_GPUS_PER_WORKER] = str(per_worker)
    for key in ("memory_limit", "local_directory"):
        if s.get(key) is not None:
            kwargs[key] = s.get(key)
    tls = cluster_tls("local", s.get("tls"))
    if tls:
        kwargs["security"] = temporary_security()  # in memory: the nannies pass it to their workers
    cluster = LocalCluster(**kwargs)
    lo, hi, adaptive = n, n, False
    if s.get("min_workers") is not None or s.get("max_workers") is not None:
        lo, hi = s.get("min_workers", 0), s.get("max_workers", max(n, s.get("min_workers", 0)))
        if hi < max(lo, 1):
            raise ConfigError(f"cluster.max_workers={hi} must be >= 1 and >= min_workers={lo}")
        _declare_partition_duration()
        cluster.adapt(minimum=lo, maximum=hi)
        adaptive = True
    notes = (("TLS with a per-run certificate",) if tls else ()) + _ignored_notes(s)
    info = ClusterInfo("local", n, threads, per_worker, lo, hi, adaptive, None, notes, _dashboard(cluster))
    return cluster, info


def _dashboard(cluster: Any) -> str | None:
    try:
        return cluster.dashboard_link
    except Exception:  # no dashboard (bokeh missing or disabled)
        return None


def _ignored_notes(s: ClusterSpec) -> tuple[str, ...]:
    ignored = sorted(k for k in s.values if s.kind not in CLUSTER_KEYS[k][0])
    return (f"ignored for kind {s.kind}: {', '.join(ignored)}",) if ignored else ()


def make_cluster(spec: Mapping[str, Any] | None = None) -> tuple[Any, ClusterInfo]:
    """Start the cluster described by a ``cluster:`` config section.

    Parameters
    ----------
    spec
        The section (see :data:`CLUSTER_KEYS` and ``docs/hpc.md``); ``None`` means local.

    Returns
    -------
    (cluster, info)
        A running ``distributed.LocalCluster`` or dask-jobqueue cluster (already adaptive:
        fixed-size HPC clusters use ``min == max`` so that expired jobs are resubmitted), and a
        :class:`ClusterInfo` describing it.  Close the cluster when done.

    Raises
    ------
    ConfigError
        Unknown keys, bad values, missing memory (HPC) or missing dask-jobqueue.

    Notes
    -----
    For ``local``, the process-wide dask setting ``distributed.worker.daemon`` is set to
    ``False``: nannies read it each time they (re)start a worker, and engines such as SGLang
    need non-daemonic workers to start their own subprocesses.
    """
    s = parse_cluster_spec(spec)
    if s.kind == "local":
        return _make_local_cluster(s)
    return _make_hpc_cluster(s)
