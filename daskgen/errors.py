"""Typed errors: every error daskgen raises for its users to catch, all :class:`DaskgenError`.

Every message says what was expected, what was found and how to fix it.  Signals that never leave
the engine that raises them (a closed event loop, a stopped sglang backend, a failed HTTP request)
are defined beside that engine, which turns them into a request's error or an :class:`EngineError`.
"""

from __future__ import annotations


class DaskgenError(Exception):
    """Base class of every error daskgen raises on purpose."""


class ConfigError(DaskgenError, ValueError):
    """Invalid run configuration (unknown keys, wrong types, bad engine options)."""


class InputError(DaskgenError, ValueError):
    """The prompt file is malformed; the message names the row and column."""


class StoreError(DaskgenError):
    """The store cannot be created or opened."""


class StoreWriteError(StoreError):
    """Writing to the store failed (disk full, permissions, ...); the run stops, finished work stays."""


class StoreMismatchError(StoreError):
    """A rerun's settings or input differ from the store's."""


class ImageReferenceError(StoreError):
    """An image the store keeps as a reference (``image_storage: reference``) cannot be read where it points, or
    its bytes there no longer hash to the image's name."""


class StoreLockedError(StoreError):
    """Another live client is running against the store."""


class EngineError(DaskgenError, RuntimeError):
    """The engine failed to start, crashed or failed its health check."""


class EngineUnavailable(EngineError):
    """A worker's engine cannot take work: its restart failed (e.g. its server stopped answering).

    Not the prompts' fault: a partition that fails with it is not marked failed; it waits for an engine,
    and the run stops (exit status 2, finished work kept) when no worker has one left.
    """


class ClusterError(DaskgenError):
    """The Dask cluster cannot run daskgen's tasks (e.g. its scheduler lacks daskgen); no prompt's fault."""


class GpuPinningError(ConfigError):
    """This worker cannot be given its own GPU (too few GPUs, or its local rank is unknown)."""


class EngineNotFoundError(ConfigError):
    """No engine registered under the requested name."""


class ExportError(DaskgenError, ValueError):
    """An export or report cannot be made (unknown format, missing optional package, failed upload)."""


class OutputExistsError(ExportError, FileExistsError):
    """The output path of an export or report exists; pass ``overwrite=True`` (``--overwrite``)."""


class RunInterrupted(DaskgenError):
    """The run was stopped from outside (SIGTERM/SIGINT, end of the allocation) before it finished.

    Finished work and partial responses are committed; rerun the same command to resume.
    """


class PackError(StoreError):
    """A store cannot be packed or unpacked (not a store, already packed, output in the way, verify failed)."""


class PackStalled(PackError):
    """No copy task of a pack or unpack finished for ``daskgen.pack.stall-timeout`` (workers lost or stuck)."""

    def __init__(self, message: str, stall_s: float) -> None:
        super().__init__(message)
        self.stall_s = stall_s


class SchedulerLost(RunInterrupted):
    """The Dask scheduler stopped answering (killed, its node lost) while the run was going.

    Everything committed before is kept and the store lock is released; rerun the same command
    against a new cluster to resume.
    """


class FollowError(DaskgenError):
    """A store cannot be followed as asked (bad cursor name, unknown format or field, a foreign cursor object)."""


class FollowTimeout(FollowError, TimeoutError):
    """``daskgen.follow(..., timeout=T)`` waited ``T`` seconds and no batch became ready.

    Nothing was lost: the cursor still holds the last acknowledged position; follow again to go on.
    """


class PolicyError(DaskgenError):
    """A policy version cannot be published or read (not a store, a path that does not exist, a foreign record)."""


class PolicyVersionError(PolicyError, ValueError):
    """A published policy version is not above the newest one: versions only increase.

    ``current`` is the newest published version, ``asked`` the one refused.
    """

    def __init__(self, message: str, current: int, asked: int) -> None:
        super().__init__(message)
        self.current, self.asked = current, asked


class PolicyDeltaError(PolicyError):
    """A delta policy version cannot be made or applied: the checkpoints do not hold the same tensors (names,
    dtypes, shapes), the delta is not a daskgen delta, or the weights rebuilt from it differ from the version's
    published fingerprint."""


class RefreshError(EngineError):
    """An engine cannot load new weights in place (it does not support it, or the load failed).

    A worker whose refresh fails keeps generating on the version it has and reports the error.
    """
