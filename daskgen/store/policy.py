"""The policy record: the versions of the policy a trainer published for a run's engines, in order.

A trainer that saved new weights publishes them as the next version (:func:`publish`, ``daskgen policy
publish``): the record ``daskgen.policy`` at the root of the store (JSON, ``{"versions": [{"version", "path",
"time", "digest", "tensors"}, ...]}``) gains one entry: ``tensors`` holds the fingerprint of every
tensor of the checkpoint and ``digest`` the version's, derived from them (:mod:`daskgen.store.fingerprint`;
both ``None`` for a checkpoint given as a URL, which is not read, or a folder without safetensors files).
A delta version (``delta=True``) also names the version it applies to (``base``: always the version before it)
and its delta's key in the store (``delta``, under :data:`~daskgen.store.commit_log.POLICY_DELTAS_PREFIX`: what
changed since ``base``, :mod:`daskgen.store.policy_delta`); workers rebuild its full weights in a node-local
cache (:mod:`daskgen.store.policy_cache`).
It is replaced in one atomic write (write-temp-and-rename in a folder, one conditional PUT on object storage),
compared with what was read first, so two publishers never lose each
other's version.  Versions only increase: a version at or below the newest is refused
(:class:`~daskgen.errors.PolicyVersionError`).  Version 0 is the run's own ``model``; published versions start
at 1.  A running ``daskgen run`` with ``refresh`` set reads the record and loads the newest version into every
worker's engine (:mod:`daskgen.worker.refresh`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from daskgen.engines.base import BASE_POLICY_VERSION
from daskgen.errors import PolicyDeltaError, PolicyError, PolicyVersionError
from daskgen.store.attrs import utc_now
from daskgen.store.commit_log import POLICY_DELTAS_PREFIX, POLICY_KEY, POLICY_TOPIC, POLICY_WORKERS_PREFIX
from daskgen.store.fingerprint import checkpoint_fingerprint
from daskgen.store.identity import read_store_attrs
from daskgen.store.location import StoreLocation, StoreRef, locate
from daskgen.store.policy_cache import checkpoint_for
from daskgen.store.policy_delta import StaleBase, make_delta
from daskgen.store.policy_versions import PolicyVersion, newest, parse_versions, read_versions

__all__ = [
    "PolicyVersion",
    "WorkerPolicy",
    "newest",
    "publish",
    "publish_policy",
    "read_versions",
    "read_worker_policies",
    "write_worker_policy",
]

#: Attempts at replacing the record while other publishers replace it too.
_ATTEMPTS = 20


def publish_policy(store: StoreRef, path: str, version: int, client: Any = None, delta: bool = False) -> PolicyVersion:
    """Publish the checkpoint folder ``path`` as policy ``version`` of the store ``store`` (a folder or URL).

    A ``daskgen run`` with ``refresh`` set loads it into every worker's engine without restarting; its samples
    record the versions that generated them (``policy_version``, ``policy_version_end``, ``version_changed_at``).
    The record keeps the fingerprint of every tensor of the checkpoint (read from its safetensors files), which
    each worker compares with what its engine loaded before serving the version; the samples carry the version's
    digest (``policy_fingerprint``, ``policy_fingerprint_end``).

    Parameters
    ----------
    store:
        The run's store (it must exist: publish after the run created it).
    path:
        The folder the trainer saved the weights to (``model.save_pretrained(path)``), readable by every worker.
    version:
        An integer above the newest published version (the run's own model is version 0).
    client:
        A ``distributed.Client`` of the run's cluster (optional): the version is also announced as a Dask event
        (:data:`~daskgen.store.commit_log.POLICY_TOPIC`), so the run's workers load it at once instead of at their
        next look at the record (``daskgen.policy.poll-interval``).  The record is the truth; the event a hint.
    delta:
        Store only what changed since the newest published version (compressed, in the store's policy area,
        :mod:`daskgen.store.delta_codec`) instead of naming ``path`` for workers to read: each node's workers
        rebuild the full weights once in a local cache from the previous version, check them against this
        version's fingerprint and load them from there.  ``path`` need not be readable by the workers; it must
        hold the same tensors (names, dtypes, shapes) as the newest version, which must have a fingerprint.

    Returns
    -------
    PolicyVersion
        The recorded entry.

    Raises
    ------
    PolicyVersionError
        ``version`` is not above the newest one (``.current`` and ``.asked`` name both).
    PolicyError
        ``store`` is no daskgen store, ``path`` is no folder (or holds a broken safetensors file), or
        ``version`` is below 1.
    PolicyDeltaError
        ``delta=True`` and no version with a fingerprint to apply it to, or the checkpoints' tensors differ.
    """
    location = locate(store)
    if read_store_attrs(location) is None:
        raise PolicyError(
            f"{location.url!r} is not a daskgen store: publish a policy version to the store of a run, after "
            "`daskgen run` created it."
        )
    entry = publish(location, path, version, delta)
    if client is not None:
        client.log_event(POLICY_TOPIC, {"store": location.url, "version": entry.version})
    return entry


def publish(location: StoreLocation, path: str, version: int, delta: bool = False) -> PolicyVersion:
    """Add ``version`` (checkpoint folder ``path``) to the record; refused unless above the newest one.

    Raises :class:`~daskgen.errors.PolicyVersionError` (naming the newest and the asked version) for a version
    at or below the newest, :class:`~daskgen.errors.PolicyError` for a version below 1 or a ``path`` that is
    neither an existing folder nor a URL, :class:`~daskgen.errors.PolicyDeltaError` for a ``delta`` that cannot
    be made.
    """
    number, checked = _checked_version(version), _checked_path(path)
    fingerprint = None if "://" in checked else checkpoint_fingerprint(checked)
    base, key = _stored_delta(location, checked, number, fingerprint) if delta else (None, None)
    entry = PolicyVersion(
        number,
        checked,
        utc_now(),
        fingerprint.digest if fingerprint else None,
        fingerprint.tensors if fingerprint else None,
        base,
        key,
    )

    def appended(raw: bytes | None) -> bytes:
        versions = [] if raw is None else parse_versions(raw, location)
        _check_increases(versions, version, location)
        if base is not None and versions[-1].version != base:
            raise PolicyError(
                f"version {versions[-1].version} of {location.url!r} was published while version {version} was "
                f"made as a delta on version {base}. Publish version {version} again."
            )
        return json.dumps({"versions": [asdict(v) for v in [*versions, entry]]}, indent=1).encode()

    if location.update_object(POLICY_KEY, appended, _ATTEMPTS):
        return entry
    raise PolicyError(
        f"could not publish version {version} to {location.url!r}: the policy record kept changing under "
        f"{_ATTEMPTS} attempts (other publishers). Publish again."
    )


def _stored_delta(location: StoreLocation, path: str, version: int, fingerprint: Any) -> tuple[int, str]:
    """Write the delta from the newest version to the checkpoint ``path`` into the store; its base and key."""
    versions = read_versions(location)
    _check_increases(versions, version, location)
    previous = versions[-1] if versions else None
    if previous is None or not previous.tensors or fingerprint is None:
        raise PolicyDeltaError(
            f"version {version} cannot be published as a delta: "
            + (
                "no version of the store has a fingerprint to apply it to"
                if fingerprint
                else f"{path!r} holds no safetensors file"
            )
            + ". Publish it in full (delta=False); later versions can then be deltas."
        )
    source = previous.path
    if previous.delta is not None and not os.path.isdir(source):  # the publisher's folder is gone: rebuild it
        source = checkpoint_for(location, previous).path
    try:
        raw = make_delta(source, path, previous.version, version, previous.tensors)
    except StaleBase as exc:
        if previous.delta is None:
            raise PolicyDeltaError(f"{exc}: publish version {version} in full (delta=False).") from exc
        source = checkpoint_for(location, previous).path  # the publisher's folder changed: its checked rebuild
        raw = make_delta(source, path, previous.version, version, previous.tensors)
    key = f"{POLICY_DELTAS_PREFIX}/v{version}-on-v{previous.version}-{fingerprint.digest[:16]}.delta"
    location.write_object(key, raw)
    return previous.version, key


@dataclass(frozen=True)
class WorkerPolicy:
    """Where one worker's engine is: the version it runs, and a refresh loading or failed (``state``).

    What the refresh to ``asked`` cost the worker (``None`` when unknown: before a refresh, or a URL checkpoint):
    ``shared_bytes`` read from shared storage for it (:class:`~daskgen.store.policy_cache.LocalCheckpoint`) and
    ``fetch_seconds`` getting its folder (a delta version's rebuild, or the wait for another worker's) and
    ``stage_seconds`` in ``Engine.stage_weights`` (the ``transformers`` engine reading and fingerprinting the
    tensors), while the engine goes on generating; once running, ``paused_seconds`` from the engine holding no
    request of the run (drained or aborted) to admitting again, of which ``load_seconds`` in
    ``Engine.apply_staged`` (of them ``step_wait_seconds`` waiting for the generation step in progress to end, when
    the engine tells) and ``check_seconds`` comparing what the engine holds with the published fingerprint; under
    ``continue``, the ``interrupted`` requests and the ``interrupted_tokens`` (prompt and tokens so far) of those
    that had begun to generate, which the engine prefills again on the new weights before they generate on."""

    worker: str
    version: int
    state: str  # "running", "loading" (stopped admitting, emptying the engine) or "failed" (kept ``version``)
    asked: int  # the version being loaded or that failed (== ``version`` when running)
    error: str | None
    time: str
    shared_bytes: int | None = None
    fetch_seconds: float | None = None
    paused_seconds: float | None = None
    load_seconds: float | None = None
    check_seconds: float | None = None
    stage_seconds: float | None = None
    step_wait_seconds: float | None = None
    interrupted: int | None = None
    interrupted_tokens: int | None = None


def write_worker_policy(location: StoreLocation, state: WorkerPolicy) -> None:
    """Record a worker's policy state (one small object per worker, replaced atomically)."""
    key = f"{POLICY_WORKERS_PREFIX}/{_safe_name(state.worker)}.json"
    location.write_object(key, json.dumps(asdict(state)).encode(), create_location=False)


def read_worker_policies(location: StoreLocation) -> list[WorkerPolicy]:
    """Every worker's recorded policy state, by worker."""
    out = []
    for key, _ in sorted(location.files(POLICY_WORKERS_PREFIX)):
        raw = location.read_bytes(key)
        try:
            out.append(WorkerPolicy(**json.loads(raw or b"")))
        except (ValueError, TypeError):  # written atomically: a foreign object, not a worker's state
            continue
    return out


def _safe_name(worker: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in worker)


def _checked_version(version: int) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < BASE_POLICY_VERSION + 1:
        raise PolicyError(
            f"policy version must be an integer >= 1 (0 is the run's own model), got {version!r}. "
            "Publish 1, 2, ... as the trainer saves new weights."
        )
    return version


def _checked_path(path: str) -> str:
    text = str(path)
    if "://" in text:
        return text
    if not os.path.isdir(text):
        raise PolicyError(
            f"policy checkpoint {text!r} is not a folder. Publish the folder the trainer saved the weights to "
            "(model.save_pretrained(folder)), readable by every worker."
        )
    return os.path.abspath(text)


def _check_increases(versions: list[PolicyVersion], asked: int, location: StoreLocation) -> None:
    current = versions[-1].version if versions else BASE_POLICY_VERSION
    if asked <= current:
        raise PolicyVersionError(
            f"policy version {asked} is not above the newest version {current} of {location.url!r}: versions "
            f"only increase. Publish version {current + 1} or higher.",
            current=current,
            asked=asked,
        )
