"""The messages between the client and a worker: the partition task the client submits and the result it commits.

The client builds a :class:`PartitionTask` per partition (:mod:`daskgen.client.plan`) and submits it to
:func:`daskgen.worker.partition.run_partition`, which answers with a small :class:`PartitionResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import SamplingParams
from daskgen.input.chat_template import ChatTemplate
from daskgen.store.generation_store import GenerationStore

if TYPE_CHECKING:
    from daskgen.store.layout import Layout
    from daskgen.worker.images import RowImages

__all__ = ["PartitionResult", "PartitionTask"]


@dataclass
class PartitionTask:
    """Everything a worker needs for one partition (small: the pending rows only).

    ``inputs`` are the pending rows as read from the input (``messages`` or ``prompt``); the worker
    tokenizes them (chat template included) into ``prompts``, so the client — one process for the
    whole cluster — never spends its CPU on tokenizing.  ``prompts`` may also be given directly.
    """

    store: GenerationStore  # pickled as its location: each worker opens it once
    start: int
    stop: int
    rows: list[int]
    prompts: list[list[int]] | None
    n_samples: int
    params: SamplingParams
    seed: int
    plugin_name: str = "daskgen-engine"
    timeout_s: float | None = None
    isolate: bool = False
    #: Client side only: a one-row task run while no other such task runs, because its worker died too often
    #: while generating its partition (:mod:`daskgen.client.driver`); the worker runs it like ``isolate``.
    alone: bool = False
    agent: str = "single_turn"
    agent_args: dict[str, Any] = field(default_factory=dict)
    model: str = ""
    continue_partial: bool = False
    verify: Any = None
    rows_meta: list[dict[str, Any]] | None = None
    inputs: list[dict[str, Any]] | None = None
    chat_template: ChatTemplate | None = None  # the run's chat-template options (None: the tokenizer's own)
    #: The Dask key it runs under (set at submission), by which the running task gives back its thread slot.
    key: str = ""
    #: The tokenizer's end ids (added to each row's stop ids), the run's sampling settings (``None`` in a run
    #: with neither per-row settings nor stops) and each pending row's (``None`` when no row has its own).
    eos_ids: tuple[int, ...] = ()
    run_settings: dict[str, Any] | None = None
    row_settings: list[dict[str, Any]] | None = None
    #: Send the requests in prompt order (shared prefixes together: :mod:`daskgen.worker.prefix_order`).
    prefix_order: bool = False
    #: Client side only: the partition's shared-prefix key (-1: none; :mod:`daskgen.client.prefix_dispatch`).
    prefix_key: int = -1
    #: Whether the model folder's own code may run when its image processor loads (the engine args'
    #: ``trust_remote_code``): a preprocessing worker, which has no engine args, loads it as the engine worker does.
    trust_remote_code: bool = False
    #: How the store keeps the images the rows name: ``"copy"`` (their bytes) or ``"reference"`` (where they lie).
    image_storage: str = "copy"
    #: Worker side only: each pending row's images, placed in its prompt (``None``: a run without images), and as a
    #: preprocessing worker gave them (``None``: prepared on this worker).
    images: list[RowImages | None] | None = None
    preprocessed: Any = None

    @property
    def layout(self) -> Layout:
        """The store's layout."""
        return self.store.layout


@dataclass
class PartitionResult:
    """What the client commits: per-row outcome plus counters."""

    start: int
    stop: int
    rows: list[int]
    failed: dict[int, str] = field(default_factory=dict)
    aborted: list[int] = field(default_factory=list)
    notes: dict[int, str] = field(default_factory=dict)
    prompt_tokens: int = 0
    response_tokens: int = 0
    #: Aborted samples whose tokens so far were stored (continued by the next attempt), and those tokens.
    partial_samples: int = 0
    partial_tokens: int = 0
    #: Response tokens of this partition's samples that earlier attempts generated (kept, not regenerated).
    carried_tokens: int = 0
    seconds: float = 0.0
    worker: str = ""
