"""The ``cluster:`` section: its keys, validation, CLI overrides, and what a built cluster reports.

:func:`parse_cluster_spec` turns the run config's flat mapping into a :class:`ClusterSpec`
(unknown keys and wrongly typed values raise :class:`~daskgen.errors.ConfigError` listing the
valid ones); :func:`kind_values` hands the values of the spec's kind to that kind's deployment class
(:mod:`daskgen.deploy.local`, :mod:`daskgen.deploy.slurm`, :mod:`daskgen.deploy.pbs`), and
:class:`ClusterInfo` describes the cluster :func:`daskgen.deploy.make_cluster` built.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dask.utils import parse_timedelta

from daskgen.deploy.security import cluster_tls
from daskgen.errors import ConfigError

KINDS = ("local", "slurm", "pbs")
#: Task slots per worker: how many partitions one engine has in flight at once.
DEFAULT_THREADS_PER_WORKER = 4

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
    "scheduler_process": (
        KINDS,
        "run the Dask scheduler in a process of its own rather than inside the client "
        "(default true for slurm/pbs, false for local)",
    ),
    "tls_directory": (
        ("slurm", "pbs"),
        "where the per-run certificate files go; shared with the nodes (default ~/.daskgen/tls)",
    ),
}

_LIST_KEYS = ("job_script_prologue", "job_extra_directives", "job_directives_skip", "worker_extra_args")
_STR_KEYS = (
    "local_directory",
    "dashboard_address",
    "memory",
    "queue",
    "partition",
    "account",
    "job_name",
    "interface",
    "log_directory",
    "python",
    "resource_spec",
    "memory_limit",
    "tls_directory",
)
_INT_KEYS = {  # key -> smallest accepted value
    "threads_per_worker": 1,
    "gpus_per_worker": 1,
    "min_workers": 0,
    "max_workers": 1,
    "n_workers": 1,
    "nodes": 1,
    "gpus_per_node": 0,
    "workers_per_node": 1,
    "cpus_per_gpu": 1,
    "cores": 1,
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
    if key == "scheduler_process" and not isinstance(value, bool):
        raise ConfigError(f"cluster.scheduler_process must be true or false, got {value!r}")
    return value


def runs_scheduler_process(kind: str, value: bool | None = None) -> bool:
    """Whether the scheduler runs in a process of its own (:mod:`daskgen.deploy.scheduler_process`):
    ``value`` (``cluster.scheduler_process``), else the kind's default.

    Batch clusters (many nodes, where the client's core is the ceiling) default to it; a local cluster,
    whose few engines cannot produce enough partitions per second to load the client, does not.
    """
    return bool(value if value is not None else kind != "local")


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


def kind_values(s: ClusterSpec) -> dict[str, Any]:
    """The spec's values for the keys of its kind: the keyword arguments of the kind's deployment class."""
    return {key: value for key, value in s.values.items() if s.kind in CLUSTER_KEYS[key][0]}


def ignored_notes(s: ClusterSpec) -> tuple[str, ...]:
    """For the cluster line of a run's log: the given keys that do not apply to the spec's kind."""
    ignored = sorted(k for k in s.values if s.kind not in CLUSTER_KEYS[k][0])
    return (f"ignored for kind {s.kind}: {', '.join(ignored)}",) if ignored else ()
