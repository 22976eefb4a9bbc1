"""The options of a run, each declared once (see :mod:`daskgen.declare`).

:class:`RunOptions` holds every run setting: a key of the ``--config`` YAML file, a keyword of
:func:`daskgen.generate`, a field of :class:`daskgen.config.RunConfig` (which adds loading and
validation) and, unless it is a mapping, a flag of ``daskgen run``.  :class:`RunCommand` holds the
flags of ``daskgen run`` that are not run settings.  The option table of docs/usage.md is rendered from both.

A declaration also says whether the setting is part of the store's identity (``identity``), whether a
row may set it in its ``sampling`` column and to what (``row``, a :class:`daskgen.ranges.Range`), and
which value leaves a sampling setting off (``off``); the identity list, the per-row keys and the off
values are derived from here (:mod:`daskgen.declare`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from daskgen.declare import LATER, option
from daskgen.ranges import distinct, integer, is_integer, number

IO, ENGINE, SAMPLING, ROUNDS, CLUSTER, TASKS, STOPPING = (
    "Input and output",
    "Engine and agent",
    "Sampling",
    "Verifier rounds",
    "Cluster",
    "Tasks and failures",
    "Stopping",
)


#: How a ``refresh`` run treats the requests in flight when a new policy version is loaded.
RefreshPolicy = Literal["drain", "continue"]
#: The order in which partitions and their prompts reach the engines.
Dispatch = Literal["auto", "prefix", "order"]
#: How the store keeps each distinct image of the prompts: its bytes, or a reference to where it was read.
ImageStorage = Literal["copy", "reference"]


def key_values(what: str, flag: str, *, identity: bool = False) -> Any:
    """A mapping of options, given on the command line as repeatable ``flag KEY=VALUE``."""
    help = f"{what} options (on the command line KEY=VALUE, VALUE read as YAML)."
    return option(help=help, group=ENGINE, flags=(flag,), pairs=True, factory=dict, identity=identity)


@dataclass
class RunOptions:
    """Every setting of a run, with its default; the help of each is in its declaration."""

    prompts: str | None = option(None, "JSONL or Parquet file of prompts.", group=IO, cli_type=Path, required=True)
    model: str | None = option(
        None, "Local model folder (or a name the engine understands).", group=IO, required=True, identity=True
    )
    store: str | None = option(
        None,
        "Output Zarr store: a folder or an object-storage URL (s3://, gs://, az://); rerun against it to resume.",
        group=IO,
        required=True,
    )
    storage_options: dict[str, Any] | None = option(
        None,
        "Options of an object-storage store (endpoint, region, credentials, client_options) for "
        "obstore.store.from_url; default: from the environment (AWS_*, ...). Never written to the store.",
        group=IO,
        flags=None,
    )
    chat_template: str | None = option(
        None,
        "Jinja chat-template file rendering 'messages' rows instead of the model's own.",
        group=IO,
        cli_type=Path,
    )
    chat_template_kwargs: dict[str, Any] = option(
        help="Chat-template variables for every row, e.g. enable_thinking=false (a row's own chat_template_kwargs "
        "column overrides them key by key; on the command line KEY=VALUE, VALUE read as YAML).",
        group=IO,
        flags=("--chat-template-kwarg",),
        pairs=True,
        factory=dict,
    )
    keep_columns: list[str] | str | None = option(
        None,
        "Input columns stored per prompt and handed to exports, followers and verifiers: a list (on the command "
        "line comma-separated) or '*' (every column of the first row but the prompt and daskgen's own keys).",
        group=IO,
        cli_type=str,
    )
    image_storage: ImageStorage = option(
        "copy",
        "How the store keeps each distinct image of the prompts: copy stores its bytes (the store holds everything "
        "it needs); reference stores only the absolute URL it was read from and its size (a data: URL's image "
        "is stored as bytes), so the store stays small but reads the files where they lie, which must stay there "
        "unchanged (docs/images.md). A resume may switch: the store then holds both.",
        group=IO,
    )
    engine: str = option(
        "transformers",
        "Engine: transformers, sglang, vllm, openai, simulated, or module:Class.",
        group=ENGINE,
        identity=True,
    )
    engine_args: dict[str, Any] = key_values("Engine", "--engine-arg")
    adapters: dict[str, str] = option(
        help="LoRA adapters the run may use: name -> PEFT adapter folder (on the command line NAME=PATH).",
        group=ENGINE,
        flags=("--adapter-path",),
        pairs=True,
        factory=dict,
    )
    adapter: str | None = option(
        None,
        "The LoRA adapter (a name of 'adapters') for every row; a row's own adapter column replaces it.",
        group=ENGINE,
        identity=LATER,
    )
    agent: str = option("single_turn", "Agent loop: single_turn, tool, or module:Class.", group=ENGINE, identity=True)
    agent_args: dict[str, Any] = key_values("Agent", "--agent-arg", identity=True)
    verifier: str | None = option(
        None,
        "Score each response with this package.module:function (multi-round sampling).",
        group=ROUNDS,
        identity=True,
    )
    round_size: int = option(
        1, "With a verifier: samples per round, up to n_samples (must divide it).", group=ROUNDS, identity=True
    )
    until_correct: int | None = option(
        None,
        "With a verifier: stop a prompt once this many responses scored >= correct_threshold.",
        group=ROUNDS,
        identity=True,
    )
    correct_threshold: float = option(
        1.0, "With a verifier: the score from which a response is correct.", group=ROUNDS, identity=True
    )
    stop_when: str | None = option(
        None,
        "With a verifier: package.module:function(scores) that stops a prompt when it returns true.",
        group=ROUNDS,
        identity=True,
    )
    count_truncated: bool = option(
        False, "With a verifier: truncated responses count towards until_correct.", group=ROUNDS, identity=True
    )
    n_samples: int = option(
        1, "Samples per prompt; all samples of a prompt stay in one partition.", group=SAMPLING, identity=True
    )
    # Sampling settings a row may set in its ``sampling`` column (``row``); those with an ``off`` value ask the
    # engine for per-row sampling when not off.
    max_new_tokens: int = option(
        256,
        "Response token limit (the store's padded response width).",
        group=SAMPLING,
        identity=True,
        row=integer(1, "the run's max_new_tokens"),
    )
    max_prompt_tokens: int = option(
        1024,
        "Prompt token limit; longer prompts are an error (or failed rows with skip_overlong).",
        group=SAMPLING,
        identity=True,
    )
    temperature: float = option(
        1.0, "Sampling temperature; 0 = greedy.", group=SAMPLING, identity=True, row=number(0, note="0 = greedy")
    )
    top_p: float = option(
        1.0,
        "Nucleus sampling: the probability mass sampled from (1 = all tokens).",
        group=SAMPLING,
        identity=True,
        row=number(0, 1, low_open=True, note="1 = off"),
    )
    top_k: int = option(
        0,
        "Sample from the k most likely tokens (0 = all tokens).",
        group=SAMPLING,
        identity=True,
        row=integer(0, note="0 = off"),
    )
    min_p: float = option(
        0.0,
        "Drop tokens below min_p times the top token's probability (0 = off).",
        group=SAMPLING,
        identity=True,
        row=number(0, 1),
        off=0.0,
    )
    min_new_tokens: int = option(
        0,
        "End-of-sequence and stops are ignored before this many tokens.",
        group=SAMPLING,
        identity=True,
        row=integer(0, "max_new_tokens"),
        off=0,
    )
    stop: list[str] | None = option(
        None,
        "Stop strings: a sample ends with the token completing one (kept in the response).",
        group=SAMPLING,
        identity=True,
        row=distinct(lambda s: isinstance(s, str) and bool(s), "non-empty strings"),
    )
    stop_token_ids: list[int] | None = option(
        None,
        "Token ids that end a sample (kept in the response), besides the model's EOS.",
        group=SAMPLING,
        identity=True,
        row=distinct(lambda t: is_integer(t) and t >= 0, "token ids >= 0"),
    )
    repetition_penalty: float = option(
        1.0,
        "Penalty on tokens already in the prompt or response (1 = off).",
        group=SAMPLING,
        identity=True,
        row=number(0, low_open=True),
        off=1.0,
    )
    presence_penalty: float = option(
        0.0,
        "Penalty on tokens already in the response (0 = off).",
        group=SAMPLING,
        identity=True,
        row=number(-2, 2),
        off=0.0,
    )
    frequency_penalty: float = option(
        0.0,
        "Penalty per occurrence of a token in the response (0 = off).",
        group=SAMPLING,
        identity=True,
        row=number(-2, 2),
        off=0.0,
    )
    seed: int = option(
        0,
        "Run seed; per-sample seeds derive from it (or from a row's own seed).",
        group=SAMPLING,
        identity=True,
        row=integer(0),
    )
    logprobs: bool = option(False, "Store per-token logprobs.", group=SAMPLING, identity=True)
    response_format: dict[str, Any] | None = option(
        None,
        "Structured outputs for every row: {json_schema: {...}}, {regex: '...'}, {choice: [...]} or {grammar: EBNF} "
        "(a row's own response_format column replaces it; on the command line JSON text).",
        group=SAMPLING,
        cli_type=str,
        identity=True,
    )
    top_logprobs: int = option(
        0,
        "Store the k most likely tokens and their logprobs at each response position (0 = off).",
        group=SAMPLING,
        identity=LATER,
    )
    partition_size: int = option(
        64, "Prompts per Dask task = the store's chunk rows along prompt.", group=TASKS, identity=True
    )
    scheduler_address: str | None = option(
        None, "Use this Dask scheduler instead of a LocalCluster (tls://HOST:PORT with --tls-*).", group=CLUSTER
    )
    tls_ca: str | None = option(
        None,
        "CA file that signed a tls:// scheduler's certificate (default: Dask's TLS config).",
        group=CLUSTER,
        cli_type=Path,
    )
    tls_cert: str | None = option(
        None, "Client certificate for a tls:// scheduler_address.", group=CLUSTER, cli_type=Path
    )
    tls_key: str | None = option(None, "Client key for a tls:// scheduler_address.", group=CLUSTER, cli_type=Path)
    n_workers: int | None = option(
        None, "LocalCluster workers (default: one per GPU, else one per 4 cores).", group=CLUSTER
    )
    cluster: dict[str, Any] | None = option(
        None,
        "Cluster spec for daskgen.deploy: kind (local, slurm or pbs) and its keys (docs/hpc.md).",
        group=CLUSTER,
        flags=None,
    )
    min_workers: int | None = option(None, "Adaptive scaling lower bound.", group=CLUSTER)
    max_workers: int | None = option(None, "Adaptive scaling upper bound.", group=CLUSTER)
    window: int | str = option(
        "auto",
        "Partitions in flight per worker, or 'auto': each worker starts at about 8x its engine's batch slots of "
        "requests, then admits partitions while its engine holds fewer than 2x its slots of unfinished requests "
        "(2 to 64 partitions).",
        group=TASKS,
        cli_type=str,
    )
    refresh: RefreshPolicy | None = option(
        None,
        "Load policy versions published to the store (daskgen policy publish) into the running engines: 'drain' "
        "finishes requests in flight on the old weights first, 'continue' aborts them and continues each from "
        "its tokens on the new weights (default: off).",
        group=ENGINE,
    )
    max_prompts_in_memory: int = option(
        65536, "Cap on prompts held anywhere (client, scheduler, workers) at once; the input is streamed.", group=TASKS
    )
    max_retries: int = option(
        2,
        "Retries of a failed partition task; then its rows are retried one by one and only those that still "
        "fail are marked failed.",
        group=TASKS,
    )
    partition_timeout_s: float | None = option(
        None,
        "A partition running longer counts as hung: its requests are aborted, the engine checked (restarted "
        "if it fails) and the task retried.",
        group=TASKS,
    )
    target_done: int | None = option(None, "Stop once this many prompts are done in the store.", group=STOPPING)
    token_budget: int | None = option(None, "Stop once this run generated this many response tokens.", group=STOPPING)
    deadline: str | None = option(
        None, "Stop at this time (ISO 8601) or after a duration from the start (90m, 2h, 3600s).", group=STOPPING
    )
    keep_partial: bool | None = option(
        None,
        "Store aborted partial responses and continue them token-exactly in the next attempt (default: on for "
        "the single_turn agent; other agent loops restart an interrupted sample).",
        group=STOPPING,
    )
    grace: str = option(
        "25s",
        "On SIGTERM/SIGINT or at the end of the SLURM allocation: seconds (or 30s, 2m) to abort, save partial "
        "responses and commit before exiting with status 3.",
        group=STOPPING,
    )
    skip_overlong: bool = option(False, "Record overlong prompts as failed instead of stopping.", group=TASKS)
    retry_failed: bool = option(False, "Regenerate prompts that failed in earlier runs.", group=TASKS)
    length_hints: str | None = option(
        None,
        "Store of an earlier run over the same prompts (same storage_options): the partitions that were "
        "longest there start first (rows matched by position or id).",
        group=TASKS,
    )
    dispatch: Dispatch = option(
        "auto",
        "prefix: partitions of one shared prefix (system prompt, few-shot examples) go to the same worker, and "
        "each partition's prompts reach the engine with shared prefixes next to each other (an engine that "
        "admits by prefix itself, sglang under its lpm schedule, gets them in input order); order: input order; "
        "auto: prefix when shared prefixes hold at least 20 % of the prompt tokens (docs/dispatch.md).",
        group=TASKS,
    )
    progress: bool = option(True, "Show a progress bar.", group=IO)


@dataclass
class RunCommand:
    """The flags of ``daskgen run`` that are not run settings."""

    config: Path | None = option(None, "YAML file with the run settings; flags override it.", group=IO)
    show: int = option(0, "Print this many decoded answers at the end.", group=IO)
    cluster_kind: str | None = option(
        None,
        "local, slurm or pbs: sets the kind of the config's cluster: section.",
        group=CLUSTER,
        flags=("--cluster",),
    )
    insecure: bool = option(False, "No TLS on the SLURM/PBS cluster daskgen starts (not recommended).", group=CLUSTER)
