"""SLURM/PBS clusters through dask-jobqueue: job layout, job scripts, walltime and worker lifetimes.

On GPU nodes every job starts one Dask worker process per GPU (``--nworkers``), each advertising
``--resources GPU=<gpus_per_worker>`` and running ``threads_per_worker`` task slots.  Worker
processes are non-daemonic so engines can start subprocesses, and every worker retires shortly
before the job's walltime (``--lifetime``) so that adaptive scaling submits a replacement job in
time.  Anything the spec leaves out comes from dask's ``jobqueue.<kind>.*`` configuration, as with
plain dask-jobqueue; list settings (prologue, directives, worker arguments) extend the configured
ones.  ``dask_jobqueue`` is optional (extra ``[hpc]``) and imported lazily.
SLURM/PBS clusters use TLS with a per-run certificate unless ``cluster.tls`` is false
(:mod:`daskgen.deploy.security`).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import dask
from dask.utils import parse_bytes, parse_timedelta

from daskgen.deploy.security import (
    RemoveTLSFilesOnClose,
    TLSFiles,
    cluster_tls,
    job_script_security,
    temporary_security,
    tls_directory,
    warn_insecure,
)
from daskgen.deploy.spec import (
    DEFAULT_THREADS_PER_WORKER,
    ClusterInfo,
    ClusterSpec,
    _dashboard,
    _declare_partition_duration,
    _ignored_notes,
    parse_cluster_spec,
    scheduler_process,
)
from daskgen.errors import ConfigError
from daskgen.worker.gpu import ENV_GPUS_PER_WORKER, ENV_LOCAL_RANK, ENV_WORKERS_PER_NODE

DAEMON_ENV = "DASK_DISTRIBUTED__WORKER__DAEMON"
_LIFETIME_VAR = "DASKGEN_WORKER_LIFETIME"


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
# dask-jobqueue keyword arguments and job scripts


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
    if "daskgen.worker.nanny_preload" not in args:
        args += ["--preload-nanny", "daskgen.worker.nanny_preload"]  # see daskgen/worker/nanny_preload.py
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
# the cluster


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


def _make_hpc_cluster(s: ClusterSpec) -> tuple[Any, ClusterInfo]:
    from daskgen.deploy import scheduler_process as own_scheduler

    kwargs = jobqueue_kwargs(s)
    _declare_partition_duration()
    layout, lifetime = _layout(s), _lifetime_plan(s)
    if s.get("dashboard_address"):
        options = dict(dask.config.get(f"jobqueue.{s.kind}.scheduler-options", None) or {})
        kwargs["scheduler_options"] = {**options, "dashboard_address": s.get("dashboard_address")}
    files = _hpc_tls_files(s)
    if files is not None:
        kwargs["security"] = files.security  # dask-jobqueue adds --protocol tls:// and the --tls-* files
    if scheduler_process(s):
        kwargs["scheduler_cls"] = own_scheduler.SchedulerProcess
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
        s.kind,
        layout.workers_per_node,
        layout.threads_per_worker,
        layout.gpus_per_worker,
        lo,
        hi,
        adaptive,
        life,
        _tls_notes(files) + own_scheduler.notes(cluster) + _ignored_notes(s),
        _dashboard(cluster),
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
