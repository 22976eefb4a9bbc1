"""Pin each Dask worker to its own GPU(s) before any CUDA initialisation.

A node runs one Dask worker process per GPU.  All of a job's worker processes inherit the same
``CUDA_VISIBLE_DEVICES`` from the batch system (for example ``0,1,2,3`` or
``GPU-<uuid>,...``), so each worker narrows it to its own device at plugin setup, from its
*local rank* (its index among the workers of its node):

1. an explicit rank (argument, or ``DASKGEN_LOCAL_RANK`` in the environment);
2. ``0`` when the node runs a single worker (``DASKGEN_WORKERS_PER_NODE=1``);
3. the worker name's numeric suffix: ``dask worker --nworkers N --name X`` (and so dask-jobqueue)
   names its processes ``X-0 ... X-{N-1}``, and :class:`distributed.LocalCluster` names
   workers ``0, 1, ...``.

:func:`daskgen.deploy` exports ``DASKGEN_WORKERS_PER_NODE`` and ``DASKGEN_GPUS_PER_WORKER`` in
every job script, so the rules above see the job's layout.  Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from daskgen import node
from daskgen.errors import GpuPinningError
from daskgen.node import (
    ENV_GPUS_PER_WORKER,
    ENV_LOCAL_RANK,
    ENV_ORIGINAL_DEVICES,
    ENV_PINNED_DEVICES,
    ENV_RESOLVED_RANK,
    ENV_WORKERS_PER_NODE,
)

logger = logging.getLogger(__name__)

__all__ = [  # the node's environment names too (daskgen.node), where they were always importable from
    *node.__all__,
    "GpuAssignment",
    "GpuPinningError",
    "choose_gpu",
    "count_visible_gpus",
    "export_local_rank",
    "local_rank_from_name",
    "parse_visible_devices",
    "pin_gpu",
    "pin_worker_gpu",
]

_UNSET = "<unset>"
_NO_DEVICE_VALUES = {"nodevfiles", "none", "void"}


@dataclass(frozen=True)
class GpuAssignment:
    """The outcome of GPU pinning for one worker.

    Attributes
    ----------
    local_rank
        The worker's index among its node's workers, or ``None`` when no GPU is visible.
    devices
        The new ``CUDA_VISIBLE_DEVICES`` value, or ``None`` to leave the environment alone.
    visible
        The devices that were visible before pinning.
    reason
        One line explaining the decision, for logs.
    """

    local_rank: int | None
    devices: str | None
    visible: tuple[str, ...]
    reason: str

    def describe(self) -> str:
        """One log line: what was visible and what this worker now sees."""
        if self.devices is None:
            return f"GPU pinning: nothing to do ({self.reason})"
        return (
            f"GPU pinning: local rank {self.local_rank} -> CUDA_VISIBLE_DEVICES={self.devices} "
            f"(visible before: {','.join(self.visible)}; {self.reason})"
        )


def parse_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """Parse a ``CUDA_VISIBLE_DEVICES`` value.

    Parameters
    ----------
    value
        The variable's value, or ``None`` when it is unset.

    Returns
    -------
    tuple of str or None
        ``None`` when unset (every GPU of the machine is visible); otherwise the device entries
        in order (indices, ``GPU-``/``MIG-`` UUIDs).  Like CUDA, entries after the first
        negative index are ignored, so ``""`` and ``"-1"`` mean no device.
    """
    if value is None:
        return None
    if value.strip().lower() in _NO_DEVICE_VALUES:
        return ()
    devices: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lstrip("-").isdigit() and int(entry) < 0:
            break
        devices.append(entry)
    return tuple(devices)


def local_rank_from_name(name: str | int) -> int | None:
    """The local rank encoded in a Dask worker name, or ``None`` if it has none.

    ``"SLURMCluster-3-1"`` -> 1 (the suffix after the last dash), ``2`` or ``"2"`` -> 2
    (``LocalCluster`` names), ``"tcp://10.0.0.1:4000"`` -> ``None``.
    """
    text = str(name).strip()
    suffix = text.rsplit("-", 1)[-1]
    return int(suffix) if suffix.isdigit() else None


def _resolve_rank(
    worker_name: str | int, local_rank: int | None, workers_per_node: int | None
) -> tuple[int | None, str]:
    """Pick the local rank by the precedence of the module docstring, with the rule used."""
    if local_rank is not None:
        return local_rank, "explicit local rank"
    if workers_per_node == 1:
        return 0, "single worker per node"
    rank = local_rank_from_name(worker_name)
    if rank is not None:
        return rank, f"from worker name {worker_name!r}"
    return None, f"worker name {worker_name!r} has no numeric suffix"


def export_local_rank(worker_name: str | int, environ: MutableMapping[str, str] | None = None) -> int | None:
    """Resolve this worker's local rank (module docstring) and set ``DASKGEN_RESOLVED_LOCAL_RANK`` to it, for
    the engine (its CPU thread binding, :mod:`daskgen.engines.cpus`); ``None`` (and the variable removed) when
    it cannot be told.

    Raises
    ------
    GpuPinningError
        When ``DASKGEN_LOCAL_RANK`` or ``DASKGEN_WORKERS_PER_NODE`` is set but not an integer.
    """
    env = os.environ if environ is None else environ
    rank, _ = _resolve_rank(worker_name, _int_env(env, ENV_LOCAL_RANK), _int_env(env, ENV_WORKERS_PER_NODE))
    if rank is None:
        env.pop(ENV_RESOLVED_RANK, None)
    else:
        env[ENV_RESOLVED_RANK] = str(rank)
    return rank


def choose_gpu(
    worker_name: str | int,
    cuda_visible_devices: str | None,
    *,
    local_rank: int | None = None,
    workers_per_node: int | None = None,
    gpus_per_worker: int = 1,
    physical_gpus: int = 0,
) -> GpuAssignment:
    """Decide which device(s) a worker should see.  Pure: reads no environment.

    Parameters
    ----------
    worker_name
        The Dask worker's name (``Worker.name``).
    cuda_visible_devices
        The current ``CUDA_VISIBLE_DEVICES`` value, ``None`` if unset.
    local_rank
        Explicit index of the worker on its node; wins over the name.
    workers_per_node
        Worker processes on this node, when known; checked against the visible GPUs.
    gpus_per_worker
        Devices per worker (tensor parallelism); worker ``r`` gets entries
        ``[r * g, (r + 1) * g)`` of the visible list.
    physical_gpus
        GPUs of the machine (``nvidia-smi -L``), used only when ``CUDA_VISIBLE_DEVICES`` is unset.

    Returns
    -------
    GpuAssignment
        ``devices is None`` when no GPU is visible (CPU engines run unchanged).

    Raises
    ------
    GpuPinningError
        When the node has fewer GPUs than its workers need, or the rank cannot be determined.
    """
    if gpus_per_worker < 1:
        raise GpuPinningError(f"gpus_per_worker must be >= 1, got {gpus_per_worker}")
    parsed = parse_visible_devices(cuda_visible_devices)
    visible = parsed if parsed is not None else tuple(str(i) for i in range(physical_gpus))
    source = "CUDA_VISIBLE_DEVICES" if parsed is not None else "nvidia-smi (CUDA_VISIBLE_DEVICES unset)"
    if not visible:
        return GpuAssignment(None, None, (), f"no GPU visible via {source}")
    _check_node_capacity(visible, workers_per_node, gpus_per_worker, source)
    rank, rule = _resolve_rank(worker_name, local_rank, workers_per_node)
    if rank is None:
        if len(visible) == gpus_per_worker:
            rank, rule = 0, f"{rule}, but exactly one worker's share of GPUs is visible"
        else:
            raise GpuPinningError(
                f"cannot tell which of the {len(visible)} visible GPUs ({','.join(visible)}) worker "
                f"{worker_name!r} should use: {rule}. Name workers NAME-0..NAME-{{N-1}} "
                f"(dask worker --nworkers N --name NAME), or set {ENV_LOCAL_RANK} per worker."
            )
    return _slice_for_rank(visible, rank, rule, gpus_per_worker, worker_name, source)


def _check_node_capacity(
    visible: tuple[str, ...], workers_per_node: int | None, gpus_per_worker: int, source: str
) -> None:
    """Fail early when the node's workers together need more GPUs than are visible."""
    if workers_per_node is None:
        return
    needed = workers_per_node * gpus_per_worker
    if needed > len(visible):
        raise GpuPinningError(
            f"{workers_per_node} workers per node x {gpus_per_worker} GPU(s) each need {needed} GPUs, "
            f"but only {len(visible)} are visible via {source}: {','.join(visible)}. Request "
            f"{needed} GPUs per job (e.g. --gres=gpu:{needed} / ngpus={needed}) or lower gpus_per_node."
        )


def _slice_for_rank(
    visible: tuple[str, ...],
    rank: int,
    rule: str,
    gpus_per_worker: int,
    worker_name: str | int,
    source: str,
) -> GpuAssignment:
    """Take this rank's share of the visible devices, or explain why there is none."""
    start, stop = rank * gpus_per_worker, (rank + 1) * gpus_per_worker
    if rank < 0 or stop > len(visible):
        raise GpuPinningError(
            f"worker {worker_name!r} has local rank {rank} ({rule}) and needs GPU(s) {start}..{stop - 1}, "
            f"but only {len(visible)} GPU(s) are visible via {source}: {','.join(visible)}. Start at "
            f"most {len(visible) // gpus_per_worker} worker(s) per node or request more GPUs per job."
        )
    return GpuAssignment(rank, ",".join(visible[start:stop]), visible, f"rank {rule}; devices from {source}")


def count_visible_gpus(environ: Mapping[str, str] | None = None) -> int:
    """Count the GPUs this process may use, cheaply (no torch, no CUDA initialisation).

    ``CUDA_VISIBLE_DEVICES`` wins when set (``nvidia-smi`` ignores it); otherwise the lines of
    ``nvidia-smi -L`` are counted; without ``nvidia-smi`` the answer is 0.
    """
    env = os.environ if environ is None else environ
    parsed = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if parsed is not None:
        return len(parsed)
    return _nvidia_smi_count()


def _nvidia_smi_count() -> int:
    """Number of physical GPUs listed by ``nvidia-smi -L`` (0 when absent or failing)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    if out.returncode != 0:
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _int_env(env: Mapping[str, str], key: str) -> int | None:
    """An integer environment variable, or ``None`` when unset or empty."""
    value = env.get(key, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise GpuPinningError(f"{key} must be an integer, got {value!r}") from None


def pin_gpu(
    worker_name: str | int,
    *,
    local_rank: int | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> GpuAssignment:
    """Narrow ``CUDA_VISIBLE_DEVICES`` to this worker's GPU(s), in place.

    Call it in the worker process before anything initialises CUDA (the engine plugin's
    setup).  Calling it again is idempotent: the decision is always taken from the value the
    worker started with (remembered in ``DASKGEN_ORIGINAL_CUDA_VISIBLE_DEVICES``).

    Parameters
    ----------
    worker_name
        The Dask worker's name.
    local_rank
        Explicit local rank; defaults to ``DASKGEN_LOCAL_RANK`` when set.
    environ
        The environment to read and modify (default ``os.environ``).

    Returns
    -------
    GpuAssignment
        What was decided; log ``assignment.describe()``.

    Raises
    ------
    GpuPinningError
        See :func:`choose_gpu`.
    """
    env = os.environ if environ is None else environ
    original = _original_devices(env)
    current = None if original == _UNSET else original
    if local_rank is None:
        local_rank = _int_env(env, ENV_LOCAL_RANK)
    assignment = choose_gpu(
        worker_name,
        current,
        local_rank=local_rank,
        workers_per_node=_int_env(env, ENV_WORKERS_PER_NODE),
        gpus_per_worker=_int_env(env, ENV_GPUS_PER_WORKER) or 1,
        physical_gpus=_nvidia_smi_count() if current is None else 0,
    )
    if assignment.devices is not None:
        env[ENV_ORIGINAL_DEVICES] = original
        env[ENV_PINNED_DEVICES] = assignment.devices
        env["CUDA_VISIBLE_DEVICES"] = assignment.devices
    return assignment


def _original_devices(env: Mapping[str, str]) -> str:
    """The devices this process started with: remembered if we pinned it already, else current."""
    current = env.get("CUDA_VISIBLE_DEVICES")
    if ENV_ORIGINAL_DEVICES in env and env.get(ENV_PINNED_DEVICES) == current:
        return env[ENV_ORIGINAL_DEVICES]
    return _UNSET if current is None else current


def pin_worker_gpu(worker_name: str | int) -> str | None:
    """Pin the current worker process (see :func:`pin_gpu`), log the decision, return the devices.

    Returns
    -------
    str or None
        The worker's ``CUDA_VISIBLE_DEVICES`` after pinning, or ``None`` when no GPU is visible.

    Raises
    ------
    GpuPinningError
        See :func:`choose_gpu`.
    """
    assignment = pin_gpu(worker_name)
    logger.info("%s (worker %s)", assignment.describe(), worker_name)
    return assignment.devices
