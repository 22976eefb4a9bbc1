"""The store's ``daskgen`` group attribute: one typed schema for everything a run records.

Every key daskgen writes into the group attribute ``daskgen`` is a field of :class:`StoreAttrs`, so
one place says what a store carries: its schema version and layout, the identity a resume must match
(settings, input, tokenizer), the redacted config, package versions, the engine that ran, the history
of runs, the kept input scan, the partitions left with partial responses, and the packing record.
Keys this version does not know (written by a newer daskgen) are kept in :attr:`StoreAttrs.extra`
and written back unchanged.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

from daskgen.store.layout import Layout

#: Name of the group attribute holding :class:`StoreAttrs`.
ATTRS_KEY = "daskgen"


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values (what Zarr stores in attributes; unknown types become strings)."""
    return json.loads(json.dumps(obj, default=str))


def utc_now() -> str:
    """The current time as an ISO 8601 string in UTC (``created`` and run records)."""
    return dt.datetime.now(dt.timezone.utc).isoformat()


@dataclass
class StoreAttrs:
    """What a store records about itself (the ``daskgen`` group attribute).

    Attributes
    ----------
    schema_version, layout, created:
        Layout version (1 plain, 2 with a ``trajectory`` axis), the :class:`Layout`, creation time.
    identity, input, tokenizer:
        What a resume must match: generation settings, input fingerprint and row count, tokenizer
        identity (vocabulary size, special ids, chat-template hash).
    config, versions, simulated:
        The run's redacted config, package versions, whether the engine is the simulated timing model.
    engine:
        Description of the engine that ran (redacted), or ``None`` before any engine started.
    runs:
        One record per invocation (counts, times, exit reason).
    input_scan:
        The kept input scan (:mod:`daskgen.input.scan_cache`), or ``None``.
    partial_partitions:
        Start rows of partitions holding partial responses, dispatched first by the next run.
    packed:
        The packing record of ``daskgen pack`` (shard rows, rows read per chunk), or ``None``.
    dispatch:
        How the last run dispatched its tasks (``mode``, shared-prefix summary, ``n_tasks``, the first tasks'
        partition start, prefix key and worker index into ``workers``), or ``None``.
    extra:
        Keys this version does not know, kept as they are.
    """

    layout: Layout
    schema_version: int = 1
    created: str = ""
    identity: dict[str, Any] = field(default_factory=dict)
    input: dict[str, Any] = field(default_factory=dict)
    tokenizer: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, Any] = field(default_factory=dict)
    simulated: bool = False
    engine: dict[str, Any] | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)
    input_scan: dict[str, Any] | None = None
    partial_partitions: list[int] = field(default_factory=list)
    packed: dict[str, Any] | None = None
    dispatch: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> StoreAttrs:
        """Parse the attribute as stored (unknown keys go to :attr:`extra`)."""
        names = {f.name for f in dataclasses.fields(cls)} - {"layout", "extra"}
        known = {k: v for k, v in doc.items() if k in names and v is not None}
        extra = {k: v for k, v in doc.items() if k not in names and k != "layout"}
        return cls(layout=Layout(**doc["layout"]), **known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The attribute to store (plain JSON; ``extra`` keys merged back at the top level)."""
        doc = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        doc["layout"] = dataclasses.asdict(self.layout)
        return jsonable({**self.extra, **doc})

    @property
    def logprobs_recorded(self) -> bool:
        """True when the run recorded per-token log-probabilities (the ``logprobs`` setting)."""
        return bool(self.identity.get("logprobs", False))

    @property
    def model_tokens_only(self) -> bool:
        """True when every response token is the model's (a single-turn run, no agent): ``response_mask`` is then
        1 before each sample's ``response_length`` and 0 after it (``daskgen verify`` checks it)."""
        return (self.config.get("agent") or "single_turn") == "single_turn"

    def identity_sections(self) -> dict[str, dict[str, Any]]:
        """The sections a resume must match, by name."""
        return {"identity": self.identity, "input": self.input, "tokenizer": self.tokenizer}
