"""Clusters of batch jobs through dask-jobqueue: the part SLURM and PBS share.

A :class:`BatchDeployment` subclass per batch system (:class:`daskgen.deploy.slurm.SLURMDeployment`,
:class:`daskgen.deploy.pbs.PBSDeployment`) names its system in class attributes and takes the
``cluster:`` keys of its kind as keyword arguments.  A keyword left at ``None`` falls back to Dask's
``jobqueue.<kind>.*`` configuration (``~/.config/dask/jobqueue.yaml``), as with plain dask-jobqueue;
list settings (prologue, directives, worker arguments) extend the configured lists.  On GPU nodes
every job starts one Dask worker process per ``gpus_per_worker`` GPUs (``--nworkers``), each
advertising ``--resources GPU=<gpus_per_worker>``, and every worker retires before the job's
walltime (:mod:`daskgen.deploy.walltime`) so that adaptive scaling submits a replacement in time.
``dask_jobqueue`` is optional (extra ``[hpc]``) and imported lazily.
"""

from __future__ import annotations

import shutil
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import dask
from dask.utils import parse_bytes

from daskgen.deploy.assembly import (
    JobReaperMixin,
    adaptive_bounds,
    dashboard_link,
    declare_partition_duration,
    job_of_worker,
)
from daskgen.deploy.deployment import DEFAULT_THREADS_PER_WORKER, ClusterInfo, Deployment
from daskgen.deploy.job_script import JobLayout, prologue_lines, worker_arguments
from daskgen.deploy.keys import AtLeast, Check, Jobqueue, check_duration, check_walltime, class_keys
from daskgen.deploy.security import (
    RemoveTLSFilesOnClose,
    TLSFiles,
    job_script_security,
    temporary_security,
    tls_directory,
    warn_insecure,
)
from daskgen.deploy.walltime import describe_lifetime, lifetime_plan
from daskgen.errors import ConfigError

if TYPE_CHECKING:
    from dask_jobqueue.core import Job, JobQueueCluster

__all__ = ["BatchDeployment"]


class BatchDeployment(Deployment):
    """A cluster of worker jobs on one batch system; subclasses set the class attributes.

    Parameters are the ``cluster:`` keys of the kind (``docs/hpc.md``): these and, through ``**keys``,
    those of :class:`~daskgen.deploy.deployment.Deployment`; ``None`` means "not given".  A key left out
    falls back to the ``jobqueue.<kind>.*`` settings its annotation names (:meth:`setting`).

    Parameters
    ----------
    nodes
        Jobs (nodes) of a fixed-size cluster.
    gpus_per_node
        GPUs per job; one worker per `gpus_per_worker` of them (0: CPU nodes).
    workers_per_node
        Worker processes per job on CPU-only nodes (e.g. HTTP engines).
    cpus_per_gpu
        CPUs requested per GPU (or give `cores`).
    cores
        CPUs requested per job (or give `cpus_per_gpu`).
    memory
        Memory per job, e.g. `480GB`, split evenly between its workers (required).
    walltime
        Job time limit, quoted: `"04:00:00"`, SLURM also `"1-00:00:00"`.
    queue
        Queue / partition.
    account
        Account / project to charge.
    job_name
        Batch job name.
    job_script_prologue
        Shell lines before the workers start (module load, conda).
    job_extra_directives
        Extra `#SBATCH`/`#PBS` lines; a `--gres`/`--gpus` here replaces the generated `--gres=gpu:N`.
    job_directives_skip
        Generated directives to drop (substring match, e.g. `--mem` where a site forbids it).
    worker_extra_args
        Extra `dask worker` arguments; your own `--lifetime`/`--resources` replace daskgen's.
    lifetime
        When workers retire: `auto` (before the walltime), a duration, or `false`.
    lifetime_margin
        Time kept free before the walltime (default 10%, 2-10 min).
    lifetime_stagger
        Random spread of job retirements (default 5%, 1-10 min).
    interface
        Network interface of scheduler and workers, e.g. `ib0`.
    log_directory
        Where job stdout/stderr go.
    python
        Python on the compute nodes (SLURM default: the client's).
    tls_directory
        Parent of the per-run certificate folders, shared with the nodes (default `~/.daskgen/tls`).

    Raises
    ------
    ConfigError
        Without dask-jobqueue, or without a memory size (keyword or ``jobqueue.<kind>.memory``).
    """

    #: Command that submits a job; it must be on ``PATH`` to start a cluster.
    submit_command: ClassVar[str]
    #: Environment variable holding the job id inside a job (names the workers of rendered scripts).
    job_id_variable: ClassVar[str]
    #: Name of the dask-jobqueue cluster class (its ``job_cls`` writes the script).
    jobqueue_cluster: ClassVar[str]

    def __init__(
        self,
        *,
        nodes: Annotated[int, AtLeast(1)] = 1,
        gpus_per_node: Annotated[int, AtLeast(0)] = 0,
        workers_per_node: Annotated[int | None, AtLeast(1), Jobqueue("processes")] = None,
        cpus_per_gpu: Annotated[int | None, AtLeast(1)] = None,
        cores: Annotated[int | None, AtLeast(1), Jobqueue("job-cpu", "cores")] = None,
        memory: Annotated[str | None, Jobqueue("memory")] = None,
        walltime: Annotated[str | None, Jobqueue("walltime"), Check(check_walltime)] = None,
        queue: Annotated[str | None, Jobqueue("queue")] = None,
        account: Annotated[str | None, Jobqueue("account")] = None,
        job_name: Annotated[str | None, Jobqueue("name")] = None,
        job_script_prologue: Annotated[list[str] | None, Jobqueue("job-script-prologue")] = None,
        job_extra_directives: Annotated[list[str] | None, Jobqueue("job-extra-directives")] = None,
        job_directives_skip: Annotated[list[str] | None, Jobqueue("job-directives-skip")] = None,
        worker_extra_args: Annotated[list[str] | None, Jobqueue("worker-extra-args")] = None,
        lifetime: Annotated[Any, Check(check_duration)] = "auto",
        lifetime_margin: Annotated[Any, Check(check_duration)] = None,
        lifetime_stagger: Annotated[Any, Check(check_duration)] = None,
        interface: Annotated[str | None, Jobqueue("interface")] = None,
        log_directory: Annotated[str | None, Jobqueue("log-directory")] = None,
        python: Annotated[str | None, Jobqueue("python")] = None,
        tls_directory: str | None = None,
        **keys: Any,
    ) -> None:
        self.cluster_base()  # importing dask_jobqueue loads its jobqueue.* configuration defaults
        super().__init__(**keys)
        self.nodes, self.gpus_per_node = nodes or 1, gpus_per_node or 0
        self.workers_per_node, self.cpus_per_gpu = workers_per_node, cpus_per_gpu
        self.cores = self.setting("cores", cores)
        self.memory = self._checked_memory(self.setting("memory", memory))
        self.walltime = self.setting("walltime", walltime)
        self.lifetime = lifetime_plan(lifetime, self.walltime, self.kind, lifetime_margin, lifetime_stagger)
        self.job_script_prologue = self.setting("job_script_prologue", job_script_prologue)
        self.job_extra_directives = self.setting("job_extra_directives", job_extra_directives)
        self.job_directives_skip = self.setting("job_directives_skip", job_directives_skip)
        self.worker_extra_args = self.setting("worker_extra_args", worker_extra_args)
        given = {"account": account, "local_directory": self.local_directory, "interface": interface}
        given |= {"log_directory": log_directory, "python": python, "job_name": job_name, "queue": queue}
        self.passed_through = {key: self.setting(key, value) for key, value in given.items()}
        self.tls_directory = tls_directory

    # ------------------------------------------------------------------ configuration

    def setting(self, key: str, given: Any) -> Any:
        """The value of ``cluster.<key>`` merged with Dask's ``jobqueue.<kind>.*`` configuration.

        A key left out (``None``) takes the first configured of the ``jobqueue`` settings its annotation
        names (:class:`~daskgen.deploy.keys.Jobqueue`); list keys extend the configured list.
        """
        spec = class_keys(type(self))[key]
        configured = next((c for c in map(self.config, spec.jobqueue) if c is not None), None)
        if spec.is_list:
            return list(configured or []) + list(given or [])
        return configured if given is None else given

    def config(self, key: str) -> Any:
        """``jobqueue.<kind>.<key>`` from Dask's configuration, or ``None``."""
        return dask.config.get(f"jobqueue.{self.kind}.{key}", None)

    def _checked_memory(self, memory: Any) -> str:
        if not memory:
            raise ConfigError(
                f"cluster.memory is required for {self.kind} (memory per job, e.g. '480GB'), "
                f"or set jobqueue.{self.kind}.memory in your dask config"
            )
        try:
            parse_bytes(memory)
        except ValueError:
            raise ConfigError(f"cluster.memory must be a size like '480GB', got {memory!r}") from None
        return str(memory)

    # ------------------------------------------------------------------ the job

    def layout(self) -> JobLayout:
        """Workers, threads and CPUs per job.

        Raises
        ------
        ConfigError
            When ``gpus_per_node`` is not a multiple of ``gpus_per_worker`` or contradicts ``workers_per_node``.
        """
        gpus, per_worker, threads = self.gpus_per_node, self.gpus_per_worker, self.threads_per_worker
        workers = self._workers_per_node()
        cpus = self.cpus_per_gpu * gpus if gpus and self.cpus_per_gpu else self.cores
        # Task slots are not CPUs (partition tasks are async and wait on the engine): by default a
        # job asks for at most DEFAULT_THREADS_PER_WORKER CPUs per worker however many slots it runs.
        cpus = cpus or workers * min(threads, DEFAULT_THREADS_PER_WORKER)
        return JobLayout(gpus, per_worker if gpus else 0, workers, threads, cpus)

    def _workers_per_node(self) -> int:
        gpus, per_worker = self.gpus_per_node, self.gpus_per_worker
        if not gpus:
            return int(self.setting("workers_per_node", self.workers_per_node) or 1)
        if gpus % per_worker:
            raise ConfigError(f"cluster.gpus_per_node={gpus} is not a multiple of gpus_per_worker={per_worker}")
        if self.workers_per_node not in (None, gpus // per_worker):
            raise ConfigError(
                f"cluster.workers_per_node={self.workers_per_node} contradicts gpus_per_node={gpus} / "
                f"gpus_per_worker={per_worker} = {gpus // per_worker}; drop workers_per_node on GPU nodes"
            )
        return gpus // per_worker

    def directives(self, layout: JobLayout) -> list[str]:
        """Extra job directives (without the prefix): configured and given ones; subclasses add their own."""
        return list(self.job_extra_directives)

    def system_kwargs(self, layout: JobLayout) -> dict[str, Any]:
        """Keyword arguments only this batch system's job class takes."""
        return {}

    def jobqueue_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the dask-jobqueue cluster and job classes of this kind."""
        layout = self.layout()
        kwargs: dict[str, Any] = {
            "processes": layout.workers_per_node,
            "cores": layout.workers_per_node * layout.threads_per_worker,  # -> --nthreads per worker
            "memory": self.memory,
            "walltime": self.walltime,
            "job_script_prologue": prologue_lines(layout, self.lifetime, self.job_script_prologue),
            "worker_extra_args": worker_arguments(layout, self.lifetime, self.worker_extra_args),
            "job_extra_directives": self.directives(layout),
            "job_directives_skip": self.job_directives_skip,
            **{key: value for key, value in self.passed_through.items() if value is not None},
        }
        return {**kwargs, **self.system_kwargs(layout)}

    def job_script(self, scheduler_address: str, security: Any = None) -> str:
        """The batch script of one worker job for a scheduler at ``scheduler_address`` (see
        :func:`daskgen.deploy.render_job_script`)."""
        kwargs = self.jobqueue_kwargs()
        security = job_script_security(scheduler_address, security)
        if security is not None:
            kwargs.update(security=security, protocol="tls://")
        name = f"daskgen-${{{self.job_id_variable}}}"
        # dask-jobqueue types job_cls as an optional instance attribute; each cluster class sets it on the class.
        job_cls: type[Job] = self.cluster_base().job_cls  # type: ignore[misc, assignment]
        return job_cls(scheduler=scheduler_address, name=name, **kwargs).job_script()

    # ------------------------------------------------------------------ the cluster

    def cluster_base(self) -> type[JobQueueCluster]:
        """The dask-jobqueue cluster class of this kind.

        Raises
        ------
        ConfigError
            When dask-jobqueue is not installed.
        """
        try:
            import dask_jobqueue
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ConfigError(f"cluster kind {self.kind!r} needs dask-jobqueue: pip install 'daskgen[hpc]'") from exc
        return getattr(dask_jobqueue, self.jobqueue_cluster)

    def start(self) -> tuple[Any, ClusterInfo]:
        """Start the cluster (adaptive; fixed size is ``min == max`` so expired jobs are resubmitted).

        Raises
        ------
        ConfigError
            When :attr:`submit_command` is not on ``PATH`` or the layout is inconsistent.
        """
        from daskgen.deploy import scheduler_process as own_scheduler

        if shutil.which(self.submit_command) is None:
            raise ConfigError(
                f"cluster kind {self.kind!r} submits jobs with {self.submit_command}, which is not on PATH; "
                "start daskgen on a login node of the batch system"
            )
        layout, files = self.layout(), self._tls_files()
        base = self.cluster_base()
        cluster_cls = type(base.__name__, (RemoveTLSFilesOnClose, JobReaperMixin, base), {"__module__": __name__})
        cluster = cluster_cls(**self.cluster_kwargs(files))
        cluster.tls_files = files
        lo, hi, adaptive = adaptive_bounds(self.min_workers, self.max_workers, self.nodes * layout.workers_per_node)
        # Always adaptive: with min == max the cluster still resubmits jobs that hit their walltime.
        key = {"worker_key": job_of_worker} if layout.workers_per_node > 1 else {}
        cluster.adapt(minimum=lo, maximum=hi, **key)
        sizes = (layout.workers_per_node, layout.threads_per_worker, layout.gpus_per_worker, lo, hi, adaptive)
        notes = self._tls_notes(files) + own_scheduler.notes(cluster)
        return cluster, ClusterInfo(self.kind, *sizes, describe_lifetime(self.lifetime), notes, dashboard_link(cluster))

    def cluster_kwargs(self, files: TLSFiles | None) -> dict[str, Any]:
        """:meth:`jobqueue_kwargs` plus the scheduler's options and the run's certificate ``files``; declares
        the partition duration for adaptive scaling first (the scheduler takes the config it starts with)."""
        from daskgen.deploy.scheduler_process import SchedulerProcess

        kwargs = self.jobqueue_kwargs()
        declare_partition_duration()
        if self.dashboard_address:
            options = dict(self.config("scheduler-options") or {})
            kwargs["scheduler_options"] = {**options, "dashboard_address": self.dashboard_address}
        if files is not None:
            kwargs["security"] = files.security  # dask-jobqueue adds --protocol tls:// and the --tls-* files
        if self.scheduler_process:
            kwargs["scheduler_cls"] = SchedulerProcess
        return kwargs

    def _tls_files(self) -> TLSFiles | None:
        """A per-run certificate in files the worker jobs can read, or ``None`` (with a warning) without TLS."""
        if not self.tls:
            warn_insecure(self.kind)
            return None
        return TLSFiles(temporary_security(), tls_directory(self.kind, self.tls_directory))

    @staticmethod
    def _tls_notes(files: TLSFiles | None) -> tuple[str, ...]:
        if files is None:
            return ("TLS off (--insecure)",)
        return (f"TLS with a per-run certificate in {files.directory}",)
