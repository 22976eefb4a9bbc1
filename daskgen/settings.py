"""A run's settings, resolved once: what the checked options (:class:`daskgen.config.RunConfig`) mean for a run.

:func:`resolve` turns the options into the frozen :class:`RunSettings` a run is planned and driven with (the
store's location, the engine class, the tokenizer, the chat-template options, the structured output, the
kept columns, the adapters, the verify policy, the identity, the cluster section with the command line's
flags merged by :func:`cluster_section`).  The plan holds the settings; nothing derives them again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.config import RunConfig

if TYPE_CHECKING:
    from daskgen.engines.base import Engine
    from daskgen.input.chat_template import ChatTemplate
    from daskgen.input.response_format import ResponseFormat
    from daskgen.run_options import RunCommand
    from daskgen.store.location import StoreLocation
    from daskgen.worker.rounds import VerifyPolicy

#: The prompts of a run: a JSONL or Parquet file, or the rows themselves.
Prompts = str | Path | Sequence[Any]


@dataclass(frozen=True)
class RunSettings:
    """What a run derives from its options, resolved once (:func:`resolve`) and never changed.

    Attributes
    ----------
    options:
        The options as checked (:class:`RunConfig`): plain values such as ``n_samples`` are read there.
    source, folder:
        The prompts to run (``None`` only where a caller plans no input); the folder of their file, which relative
        image paths are read from (``None``: rows given in memory, read from the current folder).
    location, length_hints:
        Where the store lives (:class:`~daskgen.store.location.StoreLocation`, reachable); the ``length_hints``
        store's location (``None``: unset).
    max_trajectories, tool_images:
        The most trajectories the run's agent loop makes of one sample (the store's width; the agent is created,
        and so its arguments checked, here), and the most images its tools may return per sample (0: none).
    engine_cls, simulated, prefix_engine_args, prefix_admits, engine_ranges:
        The engine class ``engine`` names, and whether it generates without a model (engine args included); the
        engine args of a run dispatched by prefix, and whether the engine then admits requests by prefix itself;
        the engine's narrower sampling ranges with the run's engine args
        (:meth:`~daskgen.engines.base.Engine.ranges_with`).
    tokenizer, stop_ids, tokenizer_identity:
        The model's tokenizer (a byte tokenizer for simulated engines), its end-of-sequence id, and what a resume
        must match of it and of the chat-template options.
    template, structured, kept_columns, adapters, window:
        The chat-template options, the run's structured output (``None``: unset), the kept input columns
        (names or ``"*"``), the LoRA adapters (absolute folders), the partitions a worker admits (``"auto"`` or a
        number).
    verify:
        The :class:`~daskgen.worker.rounds.VerifyPolicy`, or ``None`` without a verifier.
    identity, record:
        The settings a resumed run must share with the store; the options as the store's attrs keep them
        (:meth:`RunConfig.to_dict <daskgen.config.RunConfig.to_dict>`: canonical, redacted, without
        ``storage_options``).
    cluster:
        The ``cluster:`` section with the command line's flags merged (kind, TLS, worker bounds, local workers).
    grace_s, started, deadline_at, continue_partial:
        The grace period in seconds; when the run started and its deadline as Unix times (``None``: none);
        whether aborted samples are stored and continued (``keep_partial``, by default for the single-turn agent).
    """

    options: RunConfig
    source: Prompts | None
    folder: Path | None
    location: StoreLocation
    length_hints: StoreLocation | None
    max_trajectories: int
    tool_images: int
    engine_cls: type[Engine]
    simulated: bool
    prefix_engine_args: dict[str, Any]
    prefix_admits: bool
    engine_ranges: dict[str, Any]
    tokenizer: Any
    stop_ids: tuple[int, ...]
    tokenizer_identity: dict[str, Any]
    template: ChatTemplate
    structured: ResponseFormat | None
    kept_columns: tuple[str, ...] | str
    adapters: dict[str, str]
    window: int | str
    verify: VerifyPolicy | None
    identity: dict[str, Any]
    record: dict[str, Any]
    cluster: dict[str, Any]
    grace_s: float
    started: float
    deadline_at: float | None
    continue_partial: bool


def resolve(config: RunConfig, prompts: Prompts | None = None, *, command: RunCommand | None = None) -> RunSettings:
    """The :class:`RunSettings` of a run of ``config`` over ``prompts`` (default: the ``prompts`` setting, then
    required); ``command`` holds the flags of ``daskgen run`` merged into the cluster section.

    Raises :class:`ConfigError` for a missing setting, an unreachable store, an unknown engine, a model folder
    without a tokenizer or verifier settings without a verifier, before anything is created.
    """
    from daskgen.agents import create_agent
    from daskgen.engines import resolve_engine_class
    from daskgen.input.adapters import adapter_identity
    from daskgen.input.chat_template import ChatTemplate
    from daskgen.input.columns import normalize
    from daskgen.input.response_format import from_setting
    from daskgen.input.rows import input_folder
    from daskgen.input.tokenizer import model_tokenizer, tokenizer_identity
    from daskgen.redaction import redact
    from daskgen.reserved import reserved_names
    from daskgen.store.location import locate
    from daskgen.worker.rounds import VerifyPolicy

    # What the options say alone first, then each derived value from the module that owns its rule.
    cluster = cluster_section(config, command)  # merging flags into a mapping: nothing to refuse
    config.require("model", "store", *(() if prompts is not None else ("prompts",)))
    started = time.time()
    grace_s, deadline_at = config.grace_seconds(), config.deadline_timestamp(started)
    identity, options, continue_partial = config.declared_identity(), config.to_dict(), config.continues_partial()
    verify = VerifyPolicy.of(config)
    location = locate(config.store, config.storage_options)
    location.check_reachable()  # a missing bucket or refused credentials: said before anything starts
    hints = locate(config.length_hints, config.storage_options) if config.length_hints else None
    agent = create_agent(config.agent, str(config.model), config.agent_args)
    engine_cls = resolve_engine_class(config.engine)
    simulated = engine_cls.is_simulated(config.engine_args)
    prefix_engine_args, prefix_admits = engine_cls.prefix_admission(dict(config.engine_args))
    engine_ranges = engine_cls.ranges_with(config.engine_args)
    tokenizer = model_tokenizer(str(config.model), config.engine, simulated=simulated)
    eos = tokenizer.eos_token_id
    template = ChatTemplate.from_settings(config.chat_template, config.chat_template_kwargs)
    source = prompts if prompts is not None else config.prompts
    adapters = options["adapters"]  # checked, absolute folders (the options' canonical form)
    if adapters:  # the content of each adapter, not where it lies
        identity["adapters"] = adapter_identity(adapters)
    return RunSettings(
        options=config,
        source=source,
        folder=input_folder(source),
        location=location,
        length_hints=hints,
        max_trajectories=agent.max_trajectories,
        tool_images=int(getattr(agent, "max_tool_images", 0)),
        engine_cls=engine_cls,
        simulated=simulated,
        prefix_engine_args=prefix_engine_args,
        prefix_admits=prefix_admits,
        engine_ranges=engine_ranges,
        tokenizer=tokenizer,
        stop_ids=() if eos is None else (int(eos),),
        tokenizer_identity=tokenizer_identity(tokenizer, template),
        template=template,
        structured=from_setting(config.response_format),
        kept_columns=normalize(config.keep_columns, reserved_names()),
        adapters=adapters,
        window=options["window"],
        verify=verify,
        identity=identity,
        record=redact(options),
        cluster=cluster,
        grace_s=grace_s,
        started=started,
        deadline_at=deadline_at,
        continue_partial=continue_partial,
    )


def cluster_section(config: RunConfig, command: RunCommand | None = None) -> dict[str, Any]:
    """The run's ``cluster:`` section (default: a local cluster) with the run's flags merged: ``command``'s kind and
    ``--insecure``, the worker bounds, a local cluster's ``n_workers``, and task slots per worker for the window
    (partition tasks are async, an idle slot costs nothing: the window + 1) unless the section sets them."""
    from daskgen.deploy.spec import apply_cli_overrides
    from daskgen.worker.admission import AUTO_MAX_WINDOW

    section = apply_cli_overrides(
        config.cluster or {"kind": "local"},
        kind=command.cluster_kind if command is not None else None,
        tls=False if command is not None and command.insecure else None,
        min_workers=config.min_workers,
        max_workers=config.max_workers,
        n_workers=config.n_workers,
    )
    section.setdefault("threads_per_worker", (AUTO_MAX_WINDOW if config.window == "auto" else int(config.window)) + 1)
    return section
