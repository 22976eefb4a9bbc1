"""Test probes (labelled test doubles): what really reaches an engine, recorded outside the runner.

A test that checks a limit (prompts in memory, the in-flight window) or a precondition (a request
was in flight when something happened) must observe it itself instead of reading the runner's own
counters.  :class:`ProbeEngine` wraps a real registered engine and appends one line per request
event to a file that the test reads with :func:`read_events`:

* ``arrive`` -- the request reached the engine (it is now in flight: running or queued),
* ``pause`` -- a held request stopped part-way (``pause_after``, below) and waits at its gate,
* ``early-<finish reason>`` -- a held request's first ``pause_after`` tokens ended it before the pause (``stop``,
  ``length``: it finished; ``error``, ``abort``: it failed or was aborted, and pauses on its next attempt),
* ``end`` -- its ``generate`` returned (however it ended: finished, aborted, failed).

It can also hold chosen requests at a **gate** (``gate_path``): they arrive, then wait until that
file exists before they reach the inner engine, so a test can freeze the engine's occupancy, look
at it, and release it.  With ``pause_after=k`` a held request (of ``pause_rows``) whose gate is closed
on its first arrival (or on every arrival until it paused once) first gets ``k`` tokens from the inner engine,
then waits at the gate part-way: an abort then ends it with those tokens (a request stopped mid-way, for as long
as the test wants), an opened gate lets it go on from them.  The same request arriving again after its pause
(continued) waits before the inner
engine like any held request, an abort does not end that wait.  Health checks (request id
``daskgen-health``) are neither recorded nor held.  Never use these for real runs.

Request ids of daskgen's partitions are ``p<row>-s<sample>`` (an agent may append ``-t<turn>``);
:func:`row_of` reads the row back.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from daskgen.engines import resolve_engine_class
from daskgen.engines.base import Engine, FinishReason, GenerationRequest, GenerationResult
from daskgen.engines.continuation import continuation_of, joined

__all__ = ["Event", "ProbeEngine", "append_prompt", "in_flight_after", "peak_in_flight", "read_events", "row_of"]

HEALTH_ID = "daskgen-health"
#: How often a held request looks for the gate file.
GATE_POLL_S = 0.02


@dataclass(frozen=True)
class Event:
    """One line of a probe's event file."""

    time: float
    pid: int
    kind: str  # "arrive", "pause", "early-<finish reason>" or "end"
    request_id: str


class ProbeEngine(Engine):
    """Test double: a real ``inner`` engine whose requests are recorded (and optionally held).

    Engine args: ``inner`` (engine name), ``events_path`` (file the events are appended to),
    ``gate_path`` (a file whose existence releases held requests; ``{row}`` in it gives every row a gate of
    its own), ``gate_rows`` (rows whose
    requests are held; all rows when ``None`` and a ``gate_path`` is given), ``gate_sample``
    (only this sample index of those rows is held; every sample when ``None``), ``pause_after`` (tokens a
    held request gets before it waits, aborted by an abort; 0: none), ``pause_rows`` (the held rows that
    pause part-way; every held row when ``None``), ``prompts_log`` (file to append one JSON line per request to,
    :func:`append_prompt`); every other key goes to the inner engine.
    """

    name = "probe"
    #: Serves what its inner engine serves at run time; ``refresh`` is forwarded (the inner engine may refuse it).
    features = frozenset({"refresh"})
    #: Copied from the inner engine; its other capabilities are read from it (known once it started).
    supports_seed: bool = False

    def __init__(
        self,
        model: str,
        inner: str = "simulated",
        events_path: str | None = None,
        gate_path: str | None = None,
        gate_rows: Iterable[int] | None = None,
        gate_sample: int | None = None,
        pause_after: int = 0,
        pause_rows: Iterable[int] | None = None,
        prompts_log: str | None = None,
        **inner_args: Any,
    ) -> None:
        super().__init__(model, inner=inner, events_path=events_path, gate_path=gate_path, **inner_args)
        self.inner = resolve_engine_class(inner)(model, **inner_args)
        self.simulated = self.inner.simulated
        self.supports_seed = self.inner.supports_seed
        self.continues = self.inner.continues
        self.events_path, self.gate_path = events_path, gate_path
        self.gate_rows = None if gate_rows is None else {int(r) for r in gate_rows}
        self.gate_sample = gate_sample
        self.pause_after = int(pause_after)
        self.pause_rows = None if pause_rows is None else {int(r) for r in pause_rows}
        self.prompts_log = prompts_log
        self.seen: set[str] = set()  # request ids that paused before (arriving again: a continued request)
        self.pausing: set[str] = set()  # request ids waiting part-way
        self.aborted: set[str] = set()  # of those, the ones an abort ended

    @classmethod
    def is_simulated(cls, engine_args: dict[str, Any]) -> bool:
        return resolve_engine_class(engine_args.get("inner", "simulated")).is_simulated(engine_args)

    @classmethod
    def features_with(cls, engine_args: dict[str, Any]) -> frozenset[str]:
        """The inner engine's features (the requests pass through to it), and this wrapper's own."""
        inner = resolve_engine_class(engine_args.get("inner", "simulated"))
        return cls.features | inner.features_with(engine_args)

    @property
    def capacity(self) -> int | None:
        return self.inner.capacity

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.inner.eos_token_ids

    @property
    def max_total_tokens(self) -> int | None:
        return self.inner.max_total_tokens

    @property
    def vocab_size(self) -> int | None:
        return self.inner.vocab_size

    async def load(self) -> None:
        await self.inner.start()

    async def unload(self) -> None:
        await self.inner.shutdown()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.request_id == HEALTH_ID:
            return await self.inner.generate(request)
        self._record("arrive", request.request_id)
        if self.prompts_log:
            append_prompt(self.prompts_log, request)
        first = request.request_id not in self.seen
        try:
            if not self._held(request.request_id) or os.path.exists(self._gate_of(request.request_id)):
                return await self.inner.generate(request)
            if first and self._pauses(request.request_id):
                return await self._paused(request)
            await self._gate_opens(request.request_id)
            return await self.inner.generate(request)
        finally:
            self._record("end", request.request_id)

    async def _paused(self, request: GenerationRequest) -> GenerationResult:
        """``pause_after`` tokens, a wait at the gate (an abort ends it there), then the rest of the request."""
        params = request.params
        first = replace(
            params,
            max_new_tokens=min(self.pause_after, params.max_new_tokens),
            min_new_tokens=min(self.pause_after, params.min_new_tokens),
        )
        head = await self.inner.generate(GenerationRequest(request.request_id, request.prompt_ids, first))
        if head.finish_reason != FinishReason.LENGTH or len(head.output_ids) >= params.max_new_tokens:
            self._record(f"early-{head.finish_reason.name.lower()}", request.request_id)
            return head  # it ended (or failed, or was aborted) within its first tokens
        head.finish_reason = FinishReason.ABORT
        self.seen.add(request.request_id)
        self.pausing.add(request.request_id)
        self._record("pause", request.request_id)
        try:
            await self._gate_opens(request.request_id)
        finally:
            self.pausing.discard(request.request_id)
        rest = continuation_of(request, head, self.eos_token_ids, self.continues)
        if request.request_id in self.aborted or rest is None:
            self.aborted.discard(request.request_id)
            return head
        tail = await self.inner.generate(rest)
        return tail if rest is request else joined(head, tail)

    async def _gate_opens(self, request_id: str) -> None:
        """Wait until the request's gate exists (or, waiting part-way, an abort came)."""
        while not os.path.exists(self._gate_of(request_id)):
            if request_id in self.aborted:
                return
            await asyncio.sleep(GATE_POLL_S)

    async def abort(self, request_id: str) -> None:
        if request_id in self.pausing:
            self.aborted.add(request_id)
        await self.inner.abort(request_id)

    async def update_weights(self, path: str) -> None:
        await self.inner.update_weights(path)

    async def stage_weights(self, path: str) -> Any:
        return await self.inner.stage_weights(path)

    async def apply_staged(self, staged: Any) -> float | None:
        return await self.inner.apply_staged(staged)

    async def loaded_fingerprint(self, dtypes: dict[str, str]) -> dict[str, str]:
        return await self.inner.loaded_fingerprint(dtypes)

    def health_token_id(self) -> int:
        return self.inner.health_token_id()

    def _gate_of(self, request_id: str) -> str:
        """The gate file of a request: ``gate_path`` with ``{row}`` replaced by the request's row."""
        return str(self.gate_path).replace("{row}", str(row_of(request_id)))

    def _held(self, request_id: str) -> bool:
        if self.gate_path is None:
            return False
        row, sample = row_of(request_id), _sample_of(request_id)
        return (self.gate_rows is None or row in self.gate_rows) and self.gate_sample in (None, sample)

    def _pauses(self, request_id: str) -> bool:
        return self.pause_after > 0 and (self.pause_rows is None or row_of(request_id) in self.pause_rows)

    def _record(self, kind: str, request_id: str) -> None:
        if self.events_path:  # one short O_APPEND write per line: lines of several processes do not mix
            with open(self.events_path, "a") as fh:
                fh.write(f"{time.time():.6f} {os.getpid()} {kind} {request_id}\n")


def append_prompt(path: str, request: GenerationRequest) -> None:
    """Append the request's id and the token ids it was sent to ``path`` (one JSON line)."""
    with open(path, "a") as fh:  # one O_APPEND write per line: lines of several processes do not mix
        fh.write(json.dumps({"id": request.request_id, "prompt": list(request.prompt_ids)}) + "\n")


def row_of(request_id: str) -> int:
    """The prompt row of a partition's request id ``p<row>-s<sample>[...]``."""
    return int(request_id[1:].split("-")[0])


def _sample_of(request_id: str) -> int:
    return int(request_id.split("-")[1][1:])


def read_events(path: str | Path) -> list[Event]:
    """The events a probe appended to ``path``, in file order (empty if it has none yet)."""
    path = Path(path)
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        stamp, pid, kind, request_id = line.split()
        events.append(Event(float(stamp), int(pid), kind, request_id))
    return events


def in_flight_after(events: list[Event]) -> dict[int, set[str]]:
    """Per engine process: the request ids that arrived and have not ended, after ``events``."""
    flying: dict[int, set[str]] = {}
    for event in events:
        ids = flying.setdefault(event.pid, set())
        if event.kind == "arrive":
            ids.add(event.request_id)
        elif event.kind == "end":
            ids.discard(event.request_id)
    return flying


def peak_in_flight(events: list[Event]) -> int:
    """The most distinct prompt rows in flight at once (all engine processes together)."""
    flying: dict[int, int] = {}  # row -> its requests in flight
    peak = 0
    for event in events:
        if event.kind not in ("arrive", "end"):
            continue
        row = row_of(event.request_id)
        flying[row] = flying.get(row, 0) + (1 if event.kind == "arrive" else -1)
        if not flying[row]:
            del flying[row]
        peak = max(peak, len(flying))
    return peak
