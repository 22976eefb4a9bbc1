"""Refreshing a worker's engine in place when a trainer publishes a new policy version.

A run with ``refresh`` set gives each worker's :class:`~daskgen.worker.plugin.EnginePlugin` a
:class:`PolicyRefresher`.  It reads the store's policy record (:mod:`daskgen.store.policy`) once per
``daskgen.policy.poll-interval``, and at once when a publisher on the run's cluster announces a version of the
store (:func:`listen_for_versions`: a Dask event on :data:`~daskgen.store.commit_log.POLICY_TOPIC`); when the
newest version is above the one its engine runs, it gets a folder holding its full weights (the published one,
or for a delta version its rebuild in the node's cache, :mod:`daskgen.store.policy_cache`, made while the engine
goes on generating and checked against the version's fingerprint), stages it while the engine still generates
(:meth:`~daskgen.engines.base.Engine.stage_weights`: the ``transformers`` engine reads its tensors into host memory
and fingerprints them, ``sglang`` reads them into shared memory, ``vllm`` copies the folder into host memory
(:mod:`daskgen.engines.staged_folder`); other engines stage nothing), stops admitting the run's requests, empties
the engine as the ``refresh`` policy says, loads the version (:meth:`~daskgen.engines.base.Engine.apply_staged`:
the staged tensors copied in place, or :meth:`~daskgen.engines.base.Engine.update_weights` from the folder), checks
what the engine holds against the version's published fingerprint
(:meth:`~daskgen.engines.base.Engine.loaded_fingerprint`, on engines that declare ``policy_fingerprint``; after a
staged load the engine proves it holds the staged bytes instead of hashing them again) and admits again:

* ``drain``: the requests in flight finish on the old weights first;
* ``continue``: they are aborted keeping their tokens, and each goes on from its prefix on the new weights (the
  same request, ``prompt + tokens so far`` with the budget left: a partial rollout).  The engine prefills the
  context of each one that had begun to generate again (its cache was computed by the old weights): the refresh
  records the requests it interrupted and those contexts' tokens (``interrupted``, ``interrupted_tokens``).

Every request goes through :meth:`PolicyRefresher.generate`, which stamps its result with the versions of its
tokens (``meta["policy_versions"]``: ``[(response position, version), ...]``, read by
:meth:`daskgen.agents.Trajectory.add_model_tokens`).  A load that fails leaves the engine on its version: the
error is logged, shown on the dashboard and in the plugin's status, the version is not tried again, and the run
goes on.  A load whose tensors differ from the published fingerprint is refused the same way, after the engine
loaded its previous version again: it is never recorded as the new version.  Each result also carries the
fingerprint of every version it was generated under (``meta["policy_fingerprints"]``: ``{version: number}``,
:func:`daskgen.store.fingerprint.digest_number` of the checked version's digest; 0 for version 0 and unchecked
loads).  A restarted engine starts again from version 0 (the run's ``model``) and is refreshed before it
takes a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, NoReturn, get_args

from daskgen import tunables
from daskgen.engines.base import (
    BASE_POLICY_VERSION,
    Engine,
    GenerationRequest,
    GenerationResult,
    aborted_result,
)
from daskgen.engines.continuation import continuation_of, joined
from daskgen.errors import RefreshError
from daskgen.run_options import RefreshPolicy
from daskgen.store.attrs import utc_now
from daskgen.store.commit_log import POLICY_TOPIC
from daskgen.store.fingerprint import NO_FINGERPRINT, digest_number, dtype_of, mismatched
from daskgen.store.location import StoreLocation, announced_for
from daskgen.store.policy import PolicyVersion, WorkerPolicy, newest, write_worker_policy
from daskgen.store.policy_cache import checkpoint_for

logger = logging.getLogger(__name__)

#: The ``refresh`` run option's policies for requests in flight (its declared type).
REFRESH_POLICIES: tuple[str, ...] = get_args(RefreshPolicy)


class PolicyRefresher:
    """One worker's policy versions: which version its engine runs, the gate requests pass, the refresh.

    Parameters
    ----------
    location:
        The run's store (where the policy record is).
    policy:
        ``"drain"`` or ``"continue"`` (:data:`REFRESH_POLICIES`).
    live_engine:
        The worker's running engine, or ``None`` while it restarts (the plugin's ``live_engine``).
    worker:
        The worker's name, under which it records its state in the store (``daskgen status`` shows it).
    """

    def __init__(
        self, location: StoreLocation, policy: str, live_engine: Callable[[], Engine | None], worker: str
    ) -> None:
        self.location, self.policy, self.live_engine, self.worker = location, policy, live_engine, worker
        self.engine: Engine | None = None  # the engine whose version is known
        self.version = BASE_POLICY_VERSION
        self.path: str | None = None  # the checkpoint of ``version`` (None: the run's model)
        self.fingerprints: dict[int, int] = {}  # per version loaded: its checked digest's number (0: unchecked)
        self.refreshes = 0
        self.error: str | None = None
        self.refused: set[int] = set()  # versions whose load failed on this engine (not tried again)
        self.looking = asyncio.Lock()  # one look at a time (the loop, and the plugin when an engine starts)
        self.loading = False
        self.changed = asyncio.Condition()
        self.in_flight: dict[str, Engine] = {}
        self.interrupted: set[str] = set()  # requests aborted by a ``continue`` refresh
        self.interrupted_tokens = 0  # prompt + generated tokens of those that had begun: prefilled again
        self.announced = asyncio.Event()  # a publisher announced a version: look now

    # ------------------------------------------------------------------ the loop
    async def follow(self, on_error: Callable[[str], None]) -> None:
        """Read the record once per ``daskgen.policy.poll-interval`` (or when a version is announced); refresh
        when a newer version shows."""
        while True:
            self.announced.clear()
            try:
                await self.check(on_error)
            except Exception as exc:  # a record that cannot be read now: the engine keeps its version
                self._report(on_error, f"reading the policy record failed: {type(exc).__name__}: {exc}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.announced.wait(), tunables.seconds("policy.poll-interval"))

    async def check(self, on_error: Callable[[str], None]) -> None:
        """Bring the running engine to the newest published version (one look at the record)."""
        async with self.looking:
            await self._look(on_error)

    async def _look(self, on_error: Callable[[str], None]) -> None:
        engine = self.live_engine()
        if engine is None:
            return
        entry = await asyncio.to_thread(newest, self.location)
        if engine is not self.engine:  # first look, or a restarted engine: it runs the run's model again
            async with self.changed:
                self.engine, self.version, self.refused = engine, BASE_POLICY_VERSION, set()
                self.path = None
            await self._record("running", self.version)
        if entry is not None and entry.version > self.version and entry.version not in self.refused:
            await self.refresh(engine, entry, on_error)
        async with self.changed:
            self.changed.notify_all()

    async def refresh(self, engine: Engine, entry: PolicyVersion, on_error: Callable[[str], None]) -> None:
        """Rebuild ``entry`` when it is a delta version and stage it (while the engine goes on), then stop admitting,
        empty the engine (``drain`` or ``continue``), load it, admit again."""
        asked = time.monotonic()
        try:
            local = await asyncio.to_thread(checkpoint_for, self.location, entry)
            fetched = time.monotonic()
            staged = await engine.stage_weights(local.path)
        except Exception as exc:  # a delta not rebuilt as published, or a checkpoint that does not fit the model
            self.refused.add(entry.version)
            self._report(on_error, f"loading policy version {entry.version} failed: {type(exc).__name__}: {exc}")
            await self._record("failed", entry.version)
            return
        cost: dict[str, Any] = {"shared_bytes": local.shared_bytes, "fetch_seconds": fetched - asked}
        cost["stage_seconds"] = time.monotonic() - fetched
        async with self.changed:
            self.loading = True
        await self._record("loading", entry.version, **cost)
        try:
            if self.policy == "continue":
                cost["interrupted"] = await self._interrupt(engine)
            async with self.changed:
                await self.changed.wait_for(lambda: not self.in_flight)
            if self.policy == "continue":
                cost["interrupted_tokens"] = self.interrupted_tokens
            idle = time.monotonic()  # the engine holds no request of the run from here until the gate opens
            step_wait = await engine.apply_staged(staged)
            loaded = time.monotonic()
            checked = await self._checked(engine, entry)
            cost.update(load_seconds=loaded - idle, check_seconds=time.monotonic() - loaded)
            cost["step_wait_seconds"] = step_wait
        except Exception as exc:
            self.refused.add(entry.version)
            self._report(on_error, f"loading policy version {entry.version} failed: {type(exc).__name__}: {exc}")
            await self._record("failed", entry.version, **cost)
        else:
            self.version, self.error, self.refreshes = entry.version, None, self.refreshes + 1
            self.path, self.fingerprints[entry.version] = local.path, digest_number(entry.digest) if checked else 0
            logger.info("daskgen: engine now runs policy version %d (%s)", entry.version, local.path)
        finally:
            async with self.changed:
                self.loading = False
                self.changed.notify_all()
        if self.version == entry.version:  # recorded once the engine admits requests on it again
            await self._record("running", entry.version, **cost, paused_seconds=time.monotonic() - idle)

    async def _checked(self, engine: Engine, entry: PolicyVersion) -> bool:
        """Whether the engine's loaded tensors were checked against ``entry``'s published fingerprint (``False``:
        no fingerprint was published, or the engine cannot read its tensors).  Raises
        :class:`~daskgen.errors.RefreshError` when a compared tensor differs (or none could be compared), after
        loading the previous version again."""
        if not entry.tensors or "policy_fingerprint" not in type(engine).features_with(engine.engine_args):
            logger.warning("daskgen: policy version %d loaded unchecked (no fingerprint to compare)", entry.version)
            return False
        loaded = await engine.loaded_fingerprint({name: dtype_of(f) for name, f in entry.tensors.items()})
        wrong, compared = mismatched(entry.tensors, loaded)
        if compared and not wrong:
            return True
        shown = ", ".join(wrong[:5]) + (f" and {len(wrong) - 5} more" if len(wrong) > 5 else "")
        problem = (
            f"the weights the engine holds after loading version {entry.version} differ from its published "
            f"fingerprint in {len(wrong)} of {compared} tensors ({shown}): a partial or stale load"
            if compared
            else f"the engine holds none of version {entry.version}'s {len(entry.tensors)} published tensors under "
            "its name: nothing to check the load against"
        )
        await self._restore(engine, problem)

    async def _restore(self, engine: Engine, problem: str) -> NoReturn:
        """Load the version the engine ran before a refused load again, then raise the refusal."""
        if self.path is None and engine.model is None:
            raise RefreshError(f"{problem}; refused")
        try:
            await engine.update_weights(self.path or engine.model)
        except Exception as exc:  # the engine holds the refused load: its samples are labelled unchecked
            self.fingerprints[self.version] = NO_FINGERPRINT
            raise RefreshError(
                f"{problem}; refused, and loading version {self.version} again failed ({type(exc).__name__}: "
                f"{exc}): samples carry no fingerprint until a version loads"
            ) from exc
        raise RefreshError(f"{problem}; refused, version {self.version} loaded again")

    async def _interrupt(self, engine: Engine) -> int:
        """``continue``: abort every request in flight (how many); each goes on from its prefix after the load."""
        self.interrupted_tokens, aborted = 0, list(self.in_flight)
        for request_id in aborted:
            self.interrupted.add(request_id)
            await engine.abort(request_id)
        return len(aborted)

    async def _record(self, state: str, asked: int, **cost: Any) -> None:
        """Record this worker's state in the store, with what the refresh to ``asked`` cost (``WorkerPolicy``'s
        fields); a failed write is logged: the refresh goes on."""
        record = WorkerPolicy(self.worker, self.version, state, asked, self.error, utc_now(), **cost)
        try:
            await asyncio.to_thread(write_worker_policy, self.location, record)
        except Exception:
            logger.warning("daskgen: recording the policy state of %s failed", self.worker, exc_info=True)

    def _report(self, on_error: Callable[[str], None], message: str) -> None:
        self.error = message
        logger.error("daskgen: %s; the engine keeps policy version %d", message, self.version)
        on_error(message)

    # ------------------------------------------------------------------ requests
    async def generate(
        self, engine: Engine, request: GenerationRequest, stopped: Callable[[], bool]
    ) -> GenerationResult:
        """Run ``request`` on ``engine`` at the current version, across refreshes, stamped with its versions."""
        version = await self._admitted(engine)
        if stopped():  # the run stopped (or the worker drained) while the request waited
            return aborted_result(request)
        result = await self._tracked(engine, request)
        segments = [(0, version)]
        while request.request_id in self.interrupted or result.request_id in self.interrupted:
            self.interrupted.discard(request.request_id)
            rest = continuation_of(request, result, engine.eos_token_ids, engine.continues)
            if rest is None or stopped():
                break
            version = await self._admitted(engine)
            tail = await self._tracked(engine, rest)
            if rest is request:  # generated again from its prompt
                result, segments = tail, [(0, version)]
            else:
                segments.append((len(result.output_ids), version))
                result = joined(result, tail)
        result.meta["policy_versions"] = merged = _merged(segments, len(result.output_ids))
        result.meta["policy_fingerprints"] = {v: self.fingerprints.get(v, NO_FINGERPRINT) for _, v in merged}
        return result

    async def _admitted(self, engine: Engine) -> int:
        """Wait until ``engine`` runs a known version and no refresh is loading; that version."""
        async with self.changed:
            await self.changed.wait_for(
                lambda: not self.loading and (self.engine is engine or self.live_engine() is not engine)
            )
            return self.version

    async def _tracked(self, engine: Engine, request: GenerationRequest) -> GenerationResult:
        self.in_flight[request.request_id] = engine
        try:
            result = await engine.generate(request)
            if request.request_id in self.interrupted and result.output_ids:  # counted before the refresh goes on
                self.interrupted_tokens += len(request.prompt_ids) + len(result.output_ids)
            return result
        finally:
            self.in_flight.pop(request.request_id, None)
            async with self.changed:
                self.changed.notify_all()

    def status(self) -> dict[str, Any]:
        """The worker's policy: version, refreshes done, last error (``None`` after a successful load)."""
        return {
            "policy_version": self.version,
            "policy_fingerprint": self.fingerprints.get(self.version, NO_FINGERPRINT),
            "refreshes": self.refreshes,
            "refresh_error": self.error,
        }


def listen_for_versions(worker: Any, refresher: PolicyRefresher) -> None:
    """Wake ``refresher`` when a version of its store is announced on the worker's cluster (``publish_policy``
    with a ``client``).  Uses the worker's own client (``Worker.client``, made on first use); when none can be
    made the refresher keeps polling, which is only logged."""

    def on_event(event: tuple[float, Any]) -> None:
        if announced_for(event, refresher.location) is not None:
            refresher.announced.set()

    try:
        worker.client.subscribe_topic(POLICY_TOPIC, on_event)
    except Exception:  # noqa: BLE001 - the record is still read every poll interval
        logger.warning("daskgen: policy announcements not received on %s; polling the record", worker.address)


def _merged(segments: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``(position, version)`` segments of ``n`` tokens: one per change of version (the first always kept; a
    later segment at the same position replaces it: no token came from that version)."""
    out: list[tuple[int, int]] = []
    for position, version in segments:
        if out and position >= n:
            continue
        if out and out[-1][0] == position:
            out.pop()
        if not out or out[-1][1] != version:
            out.append((position, version))
    return out
