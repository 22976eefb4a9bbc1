"""A partition's place on its worker: what it holds of the engine plugin while it runs.

:meth:`daskgen.worker.plugin.EnginePlugin.partition` opens a :class:`PartitionSlot` for each
partition task: the slot counts the partition in the plugin's running partitions and its samples in
the plugin's outstanding samples (what ``window: auto`` reads) and finished samples in its meter (what
the dashboard shows), hands out the engine (registered so a
run-level stop or a drain can abort its requests), and gives everything back when the partition ends,
however it ends.  Partition code reaches the plugin only through its slot and the plugin's public
methods.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, Protocol

from daskgen.agents import EngineHandle, Trajectory
from daskgen.dashboard.metrics import WorkerMeter
from daskgen.engines.base import GenerationResult


class SlotOwner(Protocol):
    """What a slot holds of its worker's engine plugin (:class:`daskgen.worker.plugin.EnginePlugin` is one)."""

    outstanding: int
    stopping: bool
    handles: set[Any]
    meter: WorkerMeter
    refresher: Any  # a daskgen.worker.refresh.PolicyRefresher in runs with ``refresh``, else None

    async def get_engine(self) -> Any: ...

    def live_engine(self) -> Any: ...


class PartitionSlot:
    """One running partition on a worker.

    Parameters
    ----------
    plugin:
        The worker's :class:`~daskgen.worker.plugin.EnginePlugin` (a :class:`SlotOwner`).
    samples:
        Samples the partition will generate (counted outstanding until each finishes).
    """

    def __init__(self, plugin: SlotOwner, samples: int) -> None:
        self.plugin = plugin
        self.left = samples
        self.handle: EngineHandle | None = None
        plugin.outstanding += samples

    async def engine_handle(self) -> EngineHandle:
        """The engine for this partition's requests (aborted at once when the run is stopping)."""
        handle = EngineHandle(
            await self.plugin.get_engine(), live=self.plugin.live_engine, policy=self.plugin.refresher
        )
        self.plugin.handles.add(handle)
        self.handle = handle
        if self.plugin.stopping:
            await handle.abort_all()
        return handle

    async def counted(self, sample: Awaitable[list[Trajectory]]) -> list[Trajectory]:
        """Await one sample and count it finished however it ends (its tokens go to the plugin's meter)."""
        try:
            trajectories = await sample
            self.plugin.meter.record(trajectories)
            return trajectories
        finally:
            self._finished(1)

    def count(self, samples: list[list[Trajectory]], turns: Sequence[GenerationResult] = ()) -> None:
        """Count finished ``samples`` (each a sample's trajectories) and plain ``turns`` (each a sample's one engine
        result, :mod:`daskgen.worker.samples.fast_path`) at once: their tokens go to the meter."""
        for trajectories in samples:
            self.plugin.meter.record(trajectories)
        if turns:
            self.plugin.meter.record_turns(turns)
        self._finished(len(samples) + len(turns))

    def _finished(self, n: int) -> None:
        """``n`` samples are no longer outstanding."""
        done = min(n, self.left)
        self.left -= done
        self.plugin.outstanding -= done

    def release(self) -> None:
        """The partition is over: its handle is dropped, and samples it did not generate (e.g. a satisfied
        verifier) are no longer outstanding."""
        if self.handle is not None:
            self.plugin.handles.discard(self.handle)
        self.plugin.outstanding -= self.left
        self.left = 0

    def __repr__(self) -> str:
        return f"PartitionSlot(left={self.left})"
