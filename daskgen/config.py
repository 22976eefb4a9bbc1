"""Run configuration: one dataclass, loadable from YAML, overridable by CLI flags."""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daskgen.errors import ConfigError

#: Settings that define what a store holds; a resume must match them exactly.
IDENTITY_KEYS = (
    "model",
    "engine",
    "n_samples",
    "max_new_tokens",
    "max_prompt_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "partition_size",
    "agent",
    "agent_args",
)


@dataclass
class RunConfig:
    """Everything a ``daskgen run`` needs.

    Attributes
    ----------
    prompts, model, store:
        Input file (JSONL or Parquet), model path/name, output Zarr store path.
    engine, engine_args:
        Registered engine name (or ``module:Class``) and its backend options.
    agent, agent_args:
        Agent loop (``single_turn``, ``tool`` or ``module:Class``) and its options.
    n_samples:
        Samples per prompt; all samples of a prompt stay in one partition.
    max_new_tokens, max_prompt_tokens:
        Response and prompt limits; they fix the store's padded widths.
    temperature, top_p, top_k, seed, logprobs:
        Sampling; ``temperature=0`` is greedy.  Per-sample seeds derive from ``seed``.
    partition_size:
        Prompts per Dask task, equal to the store's chunk rows along ``prompt``.
    scheduler_address, n_workers, cluster, min_workers, max_workers:
        Where to run: an existing scheduler, a LocalCluster of ``n_workers``, or a
        ``cluster`` spec for :mod:`daskgen.deploy` (SLURM/PBS via dask-jobqueue).
    window:
        Partitions in flight per worker.
    max_prompts_in_memory:
        Cap on prompts held anywhere (client, scheduler, workers) at once; the input is
        streamed, so memory does not grow with its size.
    max_retries:
        Retries of a failed partition task; then its rows are retried one by one and only
        the rows that still fail are marked failed.
    partition_timeout_s:
        A partition whose generation takes longer counts as hung: its requests are aborted,
        the engine's health is checked (restarted if it fails) and the task is retried.
    skip_overlong, retry_failed:
        Record overlong prompts as failed instead of stopping; regenerate failed prompts.
    progress:
        Show a progress bar.
    """

    prompts: str | None = None
    model: str | None = None
    store: str | None = None
    engine: str = "transformers"
    engine_args: dict[str, Any] = field(default_factory=dict)
    agent: str = "single_turn"
    agent_args: dict[str, Any] = field(default_factory=dict)
    n_samples: int = 1
    max_new_tokens: int = 256
    max_prompt_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    logprobs: bool = False
    partition_size: int = 64
    scheduler_address: str | None = None
    n_workers: int | None = None
    cluster: dict[str, Any] | None = None
    min_workers: int | None = None
    max_workers: int | None = None
    window: int = 2
    max_prompts_in_memory: int = 65536
    max_retries: int = 2
    partition_timeout_s: float | None = None
    skip_overlong: bool = False
    retry_failed: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        self._check_types()
        self._check_ranges()

    @classmethod
    def field_names(cls) -> list[str]:
        """Valid configuration keys."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> RunConfig:
        """Build from a mapping; unknown keys raise :class:`ConfigError` listing valid ones."""
        data = {k.replace("-", "_"): v for k, v in data.items()}
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            hints = []
            for key in unknown:
                close = difflib.get_close_matches(key, cls.field_names(), n=1)
                hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
            raise ConfigError(
                f"unknown key(s) in {source}: {', '.join(hints)}. Valid keys: {', '.join(cls.field_names())}."
            )
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> RunConfig:
        """Read a YAML file (if given) and apply non-``None`` overrides on top."""
        data: dict[str, Any] = {}
        if path is not None:
            data = _read_yaml(Path(path))
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls.from_dict(data, source=str(path) if path else "options")

    def require(self, *keys: str) -> None:
        """Raise unless the given keys are set."""
        missing = [k for k in keys if getattr(self, k) in (None, "")]
        if missing:
            flags = ", ".join("--" + k.replace("_", "-") for k in missing)
            raise ConfigError(f"missing required setting(s) {missing}: pass {flags} or set them in --config.")

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share with the store."""
        return {k: getattr(self, k) for k in IDENTITY_KEYS}

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (for store attrs; engine args are redacted by the caller)."""
        return dataclasses.asdict(self)

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            expected = _expected_type(f.type)
            if value is None or expected is None:
                continue
            if expected is float and isinstance(value, int) and not isinstance(value, bool):
                setattr(self, f.name, float(value))
                continue
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(
                    f"setting {f.name!r} must be {expected.__name__}, found {type(value).__name__} {value!r}."
                )

    def _check_ranges(self) -> None:
        positive = ("n_samples", "max_new_tokens", "max_prompt_tokens", "partition_size", "window",
                    "max_prompts_in_memory")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"setting {key!r} must be >= 1, found {getattr(self, key)}.")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), found {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], found {self.top_p}.")
        if self.top_k < 0 or self.max_retries < 0:
            raise ConfigError("top_k and max_retries must be >= 0.")
        if self.n_workers is not None and self.n_workers < 1:
            raise ConfigError(f"n_workers must be >= 1, found {self.n_workers}.")


_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "dict": dict}


def _expected_type(annotation: Any) -> type | None:
    text = str(annotation).split("|")[0].strip()
    return _TYPES.get(text.split("[")[0])


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass a YAML file with run settings.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of settings, found {type(data).__name__}.")
    return data
