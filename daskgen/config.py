"""Run configuration: the declared run options, loaded from YAML and flags, and validated.

What a run derives from them is resolved once, by :func:`daskgen.settings.resolve`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.declare import Declared, declared, identity_keys, later_identity
from daskgen.errors import ConfigError
from daskgen.run_options import RunOptions

if TYPE_CHECKING:
    from daskgen.input.chat_template import ChatTemplate
    from daskgen.input.response_format import ResponseFormat
    from daskgen.store.location import StoreLocation
    from daskgen.worker.rounds import VerifyPolicy

#: Settings that define what a store holds; a resume must match them exactly (``option(identity=...)``).
IDENTITY_KEYS = identity_keys(RunOptions)

#: Identity settings added after stores existed, with their default: left out of the identity at that
#: default, so that a store written before them resumes (``option(identity=LATER)``).
LATER_IDENTITY_KEYS: dict[str, Any] = later_identity(RunOptions)


@dataclass
class RunConfig(RunOptions):
    """Everything a ``daskgen run`` needs: the settings of :class:`daskgen.run_options.RunOptions`, checked.

    Each setting is declared once there (type, default, help text, flag); this class loads them from
    YAML and flags (:meth:`load`), validates them, and derives what the run needs from them.
    """

    def __post_init__(self) -> None:
        # Checks only: the fields stay as given; :meth:`to_dict` is their canonical form, :func:`resolve` their meaning.
        self._check_types()
        self._check_ranges()
        self.structured_output()
        self.kept_columns()
        self.adapter_paths()
        self.deadline_timestamp(0.0)
        self.grace_seconds()

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

    def verify_policy(self) -> VerifyPolicy | None:
        """The :class:`daskgen.worker.rounds.VerifyPolicy`, or ``None`` without a verifier."""
        from daskgen.worker.rounds import VerifyPolicy

        return VerifyPolicy.of(self)

    def deadline_timestamp(self, start: float) -> float | None:
        """The deadline as a Unix time (``start`` anchors durations like ``90m``)."""
        if self.deadline is None:
            return None
        import datetime as dt

        text = str(self.deadline).strip()
        seconds = _duration_seconds(text)
        if seconds is not None:
            return start + seconds
        try:
            when = dt.datetime.fromisoformat(text)
        except ValueError:
            raise ConfigError(
                f"deadline {text!r} is neither a duration (90m, 2h, 3600s) nor an ISO 8601 time."
            ) from None
        return (when if when.tzinfo else when.astimezone()).timestamp()

    def grace_seconds(self) -> float:
        """The grace period in seconds (``grace`` is a number of seconds or ``30s``/``2m``/``1h``)."""
        seconds = _duration_seconds(str(self.grace).strip())
        if not seconds:
            raise ConfigError(
                f"grace {self.grace!r} must be a positive duration such as 25s, 90s or 2m "
                "(the time between SIGTERM and the exit)."
            )
        return seconds

    def continues_partial(self) -> bool:
        """Whether aborted samples are stored and continued (``keep_partial``, default on for single_turn)."""
        return self.agent == "single_turn" if self.keep_partial is None else bool(self.keep_partial)

    def kept_columns(self) -> tuple[str, ...] | str:
        """The ``keep_columns`` setting as column names, or ``"*"`` (:mod:`daskgen.input.columns`)."""
        from daskgen.input.columns import normalize
        from daskgen.reserved import reserved_names

        return normalize(self.keep_columns, reserved_names())

    def structured_output(self) -> ResponseFormat | None:
        """The run's ``response_format``, checked (:mod:`daskgen.input.response_format`); ``None`` when unset."""
        from daskgen.input.response_format import from_setting

        return from_setting(self.response_format)

    def adapter_paths(self) -> dict[str, str]:
        """The ``adapters`` setting, each folder checked and made absolute (:mod:`daskgen.input.adapters`)."""
        from daskgen.input.adapters import check_adapters

        return check_adapters(self.adapters, self.adapter)

    def chat_template_options(self) -> ChatTemplate:
        """The run's chat-template options (its ``chat_template`` file read and checked)."""
        from daskgen.input.chat_template import ChatTemplate

        return ChatTemplate.from_settings(self.chat_template, self.chat_template_kwargs)

    def identity(self) -> dict[str, Any]:
        """The settings a resumed run must share with the store."""
        out = self.declared_identity()
        if self.adapters:  # the content of each adapter, not where it lies
            from daskgen.input.adapters import adapter_identity

            out["adapters"] = adapter_identity(self.adapters)
        return out

    def declared_identity(self) -> dict[str, Any]:
        """The identity settings' values (``option(identity=...)``; those declared ``LATER`` only when set), in their
        canonical form (:meth:`to_dict`)."""
        canonical = self.to_dict()
        values = {k: canonical[k] for k in IDENTITY_KEYS}
        return {k: v for k, v in values.items() if k not in LATER_IDENTITY_KEYS or v != LATER_IDENTITY_KEYS[k]}

    def location(self) -> StoreLocation:
        """The :class:`daskgen.store.location.StoreLocation` of :attr:`store` (with :attr:`storage_options`)."""
        from daskgen.store.location import locate

        return locate(self.store, self.storage_options)

    def to_dict(self) -> dict[str, Any]:
        """The options in the form the store keeps them (engine args are redacted by the caller).

        The fields hold what was given; here a number of seconds becomes text (``90`` -> ``"90s"``), a window
        given as text an integer, a ``response_format`` given as JSON text an object, the adapters absolute
        folders, and a whole number given to a float setting a float.  ``storage_options`` (endpoints,
        credentials) are left out: they never reach the store.
        """
        out = {k: v for k, v in dataclasses.asdict(self).items() if k != "storage_options"}
        for key in ("deadline", "grace"):
            if _is_number(out[key]):
                out[key] = f"{out[key]}s"
        if isinstance(self.window, str) and self.window.strip().isdigit():  # from a CLI flag or YAML string
            out["window"] = int(self.window)
        structured = self.structured_output()
        out["response_format"] = None if structured is None else structured.as_dict()
        out["adapters"] = self.adapter_paths()
        for opt in _DECLARED:
            if _expected_type(opt) is float and _is_number(out[opt.name]):
                out[opt.name] = float(out[opt.name])
        return out

    def _check_types(self) -> None:
        """Each setting has its declared type (``int | str`` and lists: :meth:`_check_ranges` and the inputs'
        own checks); the value of a ``Literal[...]`` setting is one of its choices."""
        for opt in _DECLARED:
            value = getattr(self, opt.name)
            if value is None:
                continue
            if opt.choices:
                if value not in opt.choices:
                    unset = " (or unset: off)" if opt.default is None else ""
                    raise ConfigError(
                        f"setting {opt.name!r} must be one of {', '.join(map(repr, opt.choices))}{unset}, found "
                        f"{value!r}."
                    )
                continue
            expected = _expected_type(opt)
            if expected is None or isinstance(value, _ALSO_GIVEN.get(opt.name, ())):
                continue
            if expected is float and _is_number(value):
                continue
            if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
                raise ConfigError(
                    f"setting {opt.name!r} must be {expected.__name__}, found {type(value).__name__} {value!r}; give "
                    f"it a value of type {expected.__name__}, or leave it unset for the default."
                )

    def _check_ranges(self) -> None:
        """Reject out-of-range values, in the order: sizes, sampling, run limits, cluster settings."""
        self._check_sizes()
        self._check_sampling()
        self._check_run_limits()
        self._check_cluster()

    def _check_sizes(self) -> None:
        """``window`` is ``'auto'`` or a positive integer; counts and sizes are >= 1."""
        positive = ("n_samples", "max_new_tokens", "max_prompt_tokens", "partition_size", "max_prompts_in_memory")
        window = int(self.window) if isinstance(self.window, str) and self.window.strip().isdigit() else self.window
        if window != "auto" and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
            raise ConfigError(f"setting 'window' must be 'auto' or an integer >= 1, found {self.window!r}.")
        for key in positive:
            if getattr(self, key) < 1:
                raise ConfigError(f"setting {key!r} must be >= 1, found {getattr(self, key)}.")

    def _check_sampling(self) -> None:
        """Sampling parameters are in range, and ``keep_partial`` is used with the single-turn agent only."""
        from daskgen.input.sampling import run_defaults, setting_errors

        errors = setting_errors({**run_defaults(self), "seed": self.seed}, self.max_new_tokens, "run settings")
        if errors:
            raise ConfigError("; ".join(errors) + ".")
        if self.top_logprobs < 0:
            raise ConfigError(
                f"setting 'top_logprobs' is {self.top_logprobs}; it must be an integer >= 0 (the k most likely "
                "tokens stored per response position; 0 = off). Give 0 or more (--top-logprobs K), or leave it unset."
            )
        if self.max_retries < 0:
            raise ConfigError(
                f"setting 'max_retries' is {self.max_retries}; it must be an integer >= 0 (retries of a failed "
                "partition task). Give 0 or more (--max-retries N), or leave it unset for the default."
            )
        if self.keep_partial and self.agent != "single_turn":
            raise ConfigError(
                f"keep_partial continues single-turn responses only; agent is {self.agent!r}. "
                "Leave keep_partial unset: other agent loops restart an interrupted sample."
            )

    def _check_run_limits(self) -> None:
        """The stopping targets, when set, are >= 1."""
        for key in ("target_done", "token_budget"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, found {getattr(self, key)}.")

    def _check_cluster(self) -> None:
        """TLS files come with a scheduler address to join; ``n_workers``, when set, is >= 1."""
        if (self.tls_ca or self.tls_cert or self.tls_key) and not self.scheduler_address:
            raise ConfigError(
                "tls_ca/tls_cert/tls_key (--tls-ca/--tls-cert/--tls-key) are for joining an existing "
                "scheduler: give scheduler_address tls://HOST:PORT too (clusters daskgen starts make "
                "their own certificate)"
            )
        if self.n_workers is not None and self.n_workers < 1:
            raise ConfigError(f"n_workers must be >= 1, found {self.n_workers}.")


#: The run options, read once from their declarations (types resolved).
_DECLARED = tuple(declared(RunOptions))
#: The declared types checked by ``isinstance``.
_CHECKED = (str, int, float, bool, dict)
#: Other forms a setting may be given in (:meth:`RunConfig.to_dict` makes them canonical): ``deadline`` and
#: ``grace`` as numbers of seconds (YAML), ``response_format`` as JSON text (the command line).
_ALSO_GIVEN: dict[str, tuple[type, ...]] = {"deadline": (int, float), "grace": (int, float), "response_format": (str,)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _duration_seconds(text: str) -> float | None:
    """Seconds of a duration such as ``90``, ``30s``, ``2m`` or ``1h``; ``None`` for other text."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([smh]?)", text)
    return float(match[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[match[2]] if match else None


def _expected_type(opt: Declared) -> type | None:
    """The type a value of ``opt`` must have, or ``None`` when ``isinstance`` cannot tell (unions, lists)."""
    import typing

    base = typing.get_origin(opt.base_type) or opt.base_type
    return base if base in _CHECKED else None


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
