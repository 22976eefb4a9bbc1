"""The plan of a run: what the client knows before any engine starts, and the tasks it will submit.

:func:`make_plan` takes the run's settings, resolved once (:func:`daskgen.settings.resolve`; :func:`prepare`
resolves them from the options), validates the input
(tokenizing every prompt once, or reusing the input scan kept in the store, :mod:`daskgen.input.scan_cache`),
creates the store or checks that it matches;
:func:`pending_tasks` then yields one :class:`~daskgen.worker.task.PartitionTask` per partition that
still has rows to generate, in dispatch order (:mod:`daskgen.client.dispatch`).  :mod:`daskgen.client.runner`
drives them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen import tunables
from daskgen.client.dispatch import dispatch_order, long_first, read_length_hints
from daskgen.client.prefix_dispatch import resolve_prefix, with_prefix
from daskgen.config import RunConfig
from daskgen.engines.base import SamplingParams
from daskgen.errors import ConfigError
from daskgen.images.processor import ImageProcessing
from daskgen.images.scan import ImageCheck
from daskgen.input import adapters
from daskgen.input.chat_template import ChatTemplate
from daskgen.input.prefix import PrefixKeys
from daskgen.input.rows import InputScan, iter_selected_rows, scan_prompts, worker_input
from daskgen.input.sampling import (
    STOP_KEYS,
    RowSamplingCheck,
    engine_range_errors,
    merged,
    requested_features,
    run_settings,
)
from daskgen.input.scan_cache import load_scan, scan_key, scan_record
from daskgen.reserved import reserved_names
from daskgen.settings import Prompts, RunSettings, resolve
from daskgen.store.attrs import StoreAttrs
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import FAILED, PENDING, Layout
from daskgen.store.resumable import check_resumable
from daskgen.worker.samples.row_sampling import row_params
from daskgen.worker.task import PartitionTask

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """What the client decided before any engine starts; it never changes during the run.

    The run's live state (checkpoint mask, counters, stop requests) is a
    :class:`~daskgen.client.live.LiveRun` built from it.
    """

    settings: RunSettings
    prompts: InputScan
    store: GenerationStore
    scan_record: dict[str, Any] | None = None  # a fresh input scan to keep in the attrs (under the lock)
    first_partitions: tuple[int, ...] = ()  # dispatched first (partitions left with partial responses)
    predicted: np.ndarray | None = None  # per row: longest response in the length_hints store (NaN: unknown)
    prefix: PrefixKeys | None = None  # the shared-prefix keys dispatch goes by (None: input order)
    #: With prefix dispatch, each partition's requests are sent in prompt order (False: the engine admits its
    #: waiting requests by shared prefix itself, :meth:`~daskgen.engines.base.Engine.prefix_admission`).
    prefix_order: bool = True
    #: The engine args the workers' engines start with when not the run's: with prefix dispatch, the run's and the
    #: engine's own additions (:meth:`~daskgen.engines.base.Engine.prefix_admission`).
    engine_args: dict[str, Any] | None = None

    @property
    def config(self) -> RunConfig:
        """The run's options (:attr:`settings` holds what derives from them)."""
        return self.settings.options

    @property
    def layout(self) -> Layout:
        """The store's layout."""
        return self.store.layout

    @property
    def tokenizer(self) -> Any:
        """The run's tokenizer."""
        return self.settings.tokenizer

    @property
    def template(self) -> ChatTemplate:
        """The run's chat-template options."""
        return self.settings.template

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokenizer's end-of-sequence id (empty without one)."""
        return self.settings.stop_ids


def prepare(config: RunConfig, prompts: Prompts | None = None) -> Plan:
    """The plan of a run of ``config`` over ``prompts``: its settings resolved, then :func:`make_plan`."""
    return make_plan(resolve(config, prompts))


def make_plan(settings: RunSettings) -> Plan:
    """Plan a run with ``settings`` (:func:`daskgen.settings.resolve`), one step after the other and each on what
    the step before found: the input scanned (or its scan reused from the store), the length hints read, the engine
    checked for every feature the run and its rows ask for, the store created or checked, the prefix keys resolved.
    A ``daskgen.*`` setting that daskgen does not have, or of the wrong kind, fails first
    (:func:`daskgen.tunables.check_settings`).
    """
    tunables.check_settings()
    existing, scan, record, keys = _scan_input(settings)
    hints = settings.length_hints
    predicted = None if hints is None else read_length_hints(hints, scan.ids, scan.fingerprint, len(scan))
    structured = scan.structured or settings.structured is not None
    _check_features(settings, keys, structured, images=bool(scan.max_images or settings.tool_images))
    store, record = _open_store(settings, scan, keys, existing, record)
    prefix = resolve_prefix(
        settings.options.dispatch, scan, store.attrs.input_scan, settings.tokenizer, settings.template
    )
    engine_args, admits = (settings.prefix_engine_args, settings.prefix_admits) if prefix else (None, False)
    if engine_args is not None and engine_args != settings.options.engine_args:
        added = {k: v for k, v in engine_args.items() if settings.options.engine_args.get(k) != v}
        logger.info("dispatch by prefix: the %s engines start with %s", settings.options.engine, added)
    return Plan(
        settings,
        scan,
        store,
        scan_record=record,
        first_partitions=tuple(store.attrs.partial_partitions),
        predicted=predicted,
        prefix=prefix,
        prefix_order=not admits,
        engine_args=engine_args,
    )


def _check_features(settings: RunSettings, keys: frozenset[str], structured: bool, *, images: bool = False) -> None:
    """Refuse a run that asks its engine for a feature it does not serve, or for more top-k logprobs than it gives
    (before any engine starts)."""
    from daskgen.engines.features import check_features, check_top_logprobs

    cls, config = settings.engine_cls, settings.options
    run = run_settings(config)
    wanted = requested_features(run, keys)
    wanted |= {"structured_outputs"} if structured else set()
    wanted |= {"top_logprobs"} if config.top_logprobs else set()
    wanted |= {"refresh"} if config.refresh else set()
    wanted |= {"lora"} if settings.adapters else set()
    wanted |= {"refresh_with_lora"} if config.refresh and settings.adapters else set()
    wanted |= {"images"} if images else set()
    features, refused = cls.features_with(config.engine_args), cls.refused_features(config.engine_args)
    check_features(config.engine, features, wanted, refused)
    check_top_logprobs(config.engine, cls, config.top_logprobs, config.engine_args)
    if wrong := engine_range_errors(run, settings.engine_ranges, config.engine, "the run's settings"):
        raise ConfigError("; ".join(wrong))


def _scan_input(
    settings: RunSettings,
) -> tuple[GenerationStore | None, InputScan, dict[str, Any] | None, frozenset[str]]:
    """The store if it exists, and the input scan: reused from the store's attrs when input and tokenizer are
    unchanged, else tokenized anew.

    Returns the existing store (``None``: none yet), the scan, for a fresh scan the record to keep in the attrs
    (``None`` when reused), and the sampling keys the rows set (those of the store's layout for a reused scan).
    """
    config, source, tokenizer = settings.options, settings.source, settings.tokenizer
    # rows with images need a model folder with an image processor: made once the first image is checked
    trust = bool(config.engine_args.get("trust_remote_code", False))
    processing = functools.partial(ImageProcessing, str(config.model), trust_remote_code=trust)
    images = ImageCheck(processing, config.storage_options, settings.folder)
    existing = GenerationStore.open_if_exists(settings.location)
    assert source is not None  # resolve() requires prompts unless given
    key = scan_key(source, settings.tokenizer_identity, config.max_prompt_tokens, config.skip_overlong)
    scan = load_scan(existing.attrs.input_scan if existing else None, key, source)
    if scan is not None:  # the store exists and was checked when created: its layout holds
        return existing, scan, None, frozenset()
    check = RowSamplingCheck(config.max_new_tokens, settings.engine_ranges, config.engine)
    adapter_check = adapters.AdapterCheck(settings.adapters)
    scan = scan_prompts(
        source,
        tokenizer,
        max_prompt_tokens=config.max_prompt_tokens,
        skip_overlong=config.skip_overlong,
        template=settings.template,
        keep_columns=settings.kept_columns,
        reserved_columns=reserved_names(),
        check_row=lambda row: check(row) + adapter_check(row),
        images=images,
    )
    return existing, scan, scan_record(key, scan, source), frozenset(check.keys)


def _open_store(
    settings: RunSettings,
    scan: InputScan,
    keys: frozenset[str],
    existing: GenerationStore | None,
    record: dict[str, Any] | None,
) -> tuple[GenerationStore, dict[str, Any] | None]:
    """Create the store (with the scan ``record`` in its attrs) or check that the existing one can be resumed;
    ``keys`` are the sampling keys the rows set.

    Returns the store and the scan record still to be kept in its attrs (``None`` once written): the run keeps it
    under the store's lock (:mod:`daskgen.client.runner`).
    """
    from daskgen.versions import package_versions

    keep = settings.kept_columns
    wanted = StoreAttrs(
        layout=_layout(settings, scan, keys),
        identity=settings.identity,
        input={
            "fingerprint": scan.fingerprint,
            "n_prompts": len(scan),
            **({"keep_columns": keep} if keep else {}),
            **(scan.image_identity() if scan.images else {}),
            **(_tool_image_identity(settings) if settings.tool_images else {}),
        },
        tokenizer=settings.tokenizer_identity,
        config=settings.record,
        simulated=settings.simulated,
        versions=package_versions(),
        input_scan=record if existing is None else None,
    )
    if existing is None:
        return GenerationStore.create(settings.location, wanted, scan.ids), None
    check_resumable(existing, wanted)
    return existing, record


def _layout(settings: RunSettings, scan: InputScan, keys: frozenset[str]) -> Layout:
    config = settings.options
    return Layout(
        len(scan),
        config.n_samples,
        config.max_prompt_tokens,
        config.max_new_tokens,
        config.partition_size,
        int(settings.tokenizer.pad_token_id),
        settings.max_trajectories,
        scored=settings.verify is not None,
        columns=scan.columns,
        row_sampling=bool(keys),
        stops=bool(config.stop or config.stop_token_ids or keys & set(STOP_KEYS)),
        structured=scan.structured or settings.structured is not None,
        top_logprobs=config.top_logprobs,
        adapters=bool(settings.adapters),
        max_images=scan.max_images,
        tool_images=settings.tool_images,
    )


def _tool_image_identity(settings: RunSettings) -> dict[str, Any]:
    """What the store's input identity records of a run whose tools return images: the model's image processor and
    placeholder token (a resume with other preprocessing is refused).  Refuses (:class:`ConfigError`) a model
    without an image processor, and a chat template that cannot render an image in a tool message."""
    from daskgen.agents.tool import check_tool_image_template

    config = settings.options
    processing = ImageProcessing(str(config.model), trust_remote_code=bool(config.engine_args.get("trust_remote_code")))
    check_tool_image_template(settings.tokenizer, processing.tokens.image)
    return {"image_processor": processing.identity(), "image_token_id": processing.tokens.image}


def pending_rows(plan: Plan, status: np.ndarray) -> np.ndarray:
    """Mask of rows this run generates, given the checkpoint ``status``."""
    todo = status == PENDING
    if plan.config.retry_failed:
        todo |= status == FAILED
    todo[list(plan.prompts.overlong)] = False
    return todo


def pending_tasks(plan: Plan, status: np.ndarray) -> Iterator[PartitionTask]:
    """One task per partition with rows to generate, built lazily while streaming the input.

    Likely-long partitions come first (:mod:`daskgen.client.dispatch`): those holding partial responses of an
    interrupted earlier run, then those the ``length_hints`` store predicts longest (longest first),
    then the others in order; with prefix dispatch each task is sent in prompt order and carries its
    partition's prefix key (:mod:`daskgen.client.prefix_dispatch`).  Only the prompts of tasks the caller
    holds, and of the predicted-long group (at most half of ``max_prompts_in_memory``), are in memory: the
    input is re-read, not kept.
    """
    layout, todo = plan.layout, pending_rows(plan, status)
    starts = [s for s in layout.partitions() if todo[s : s + layout.partition_size].any()]
    interrupted, rest = dispatch_order(starts, list(plan.first_partitions))
    groups = [interrupted]
    if plan.predicted is not None:
        limit = plan.config.max_prompts_in_memory // 2 // layout.partition_size
        longest, rest = long_first(rest, np.where(todo, plan.predicted, np.nan), layout.partition_size, limit)
        groups.append(longest)
    for group in [*groups, rest]:
        for task in _tasks_for(plan, group, todo):
            yield task if plan.prefix is None else with_prefix(task, plan.prefix.keys, plan.prefix_order)


def row_tasks(plan: Plan, rows: list[int]) -> Iterator[PartitionTask]:
    """One task per partition of ``rows`` (rows sent back for generation while the run goes on), in row order,
    each restricted to those rows."""
    todo = np.zeros(plan.layout.n_prompts, dtype=bool)
    todo[rows] = True
    yield from _tasks_for(plan, plan.layout.partitions_of(rows), todo)


def _tasks_for(plan: Plan, starts: list[int], todo: np.ndarray) -> Iterator[PartitionTask]:
    """Tasks of the partitions at ``starts``, reading their prompts in one pass over the input (a group
    not in ascending order is read whole, then yielded in its order)."""
    if starts != sorted(starts):
        tasks = {task.start: task for task in _tasks_for(plan, sorted(starts), todo)}
        yield from (tasks[start] for start in starts)
        return

    shared = _shared_task_fields(plan)
    layout, params, base = plan.layout, shared["params"], plan.settings.folder
    ranges = [(start, min(start + layout.partition_size, layout.n_prompts)) for start in starts]
    wanted = (int(i) for start, stop in ranges for i in np.flatnonzero(todo[start:stop]) + start)
    selected = iter_selected_rows(plan.prompts.source, wanted)
    for start, stop in ranges:
        rows = (np.flatnonzero(todo[start:stop]) + start).tolist()
        full = [next(selected)[1] for _ in rows]  # the pending rows' input rows
        yield PartitionTask(
            plan.store,
            start,
            stop,
            rows,
            None,
            agent_args=dict(plan.config.agent_args),
            rows_meta=full if shared["verify"] is not None else None,
            inputs=[worker_input(r, layout.columns, params.response_format, params.adapter, base) for r in full],
            row_settings=[merged(shared["run_settings"], r.get("sampling")) for r in full]
            if layout.row_sampling
            else None,
            **shared,
        )


def _shared_task_fields(plan: Plan) -> dict[str, Any]:
    """The :class:`PartitionTask` fields every partition shares (the verify policy is built once per run)."""
    cfg = plan.config
    engine_args = cfg.engine_args if plan.engine_args is None else plan.engine_args  # those the engines start with
    return {
        "n_samples": cfg.n_samples,
        "params": _sampling_params(plan),
        "seed": cfg.seed,
        "timeout_s": cfg.partition_timeout_s,
        "agent": cfg.agent,
        "model": str(cfg.model),
        "verify": plan.settings.verify,
        "continue_partial": plan.settings.continue_partial,
        "chat_template": None if plan.template.is_default else plan.template,
        "eos_ids": plan.stop_ids,
        "run_settings": run_settings(cfg) if plan.layout.stops or plan.layout.row_sampling else None,
        "trust_remote_code": bool(engine_args.get("trust_remote_code", False)),
        "image_storage": cfg.image_storage,
    }


def _sampling_params(plan: Plan) -> SamplingParams:
    """The run's sampling settings, with the tokenizer's stop ids."""
    cfg = plan.config
    run = SamplingParams(
        logprobs=cfg.logprobs,
        response_format=plan.settings.structured,
        top_logprobs=cfg.top_logprobs,
        adapter=cfg.adapter,
    )
    return row_params(run_settings(cfg), plan.stop_ids, run)
