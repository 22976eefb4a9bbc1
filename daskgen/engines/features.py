"""Request features: what a run may ask of its engine beyond plain sampling, and the check at plan time.

Each engine declares the features it serves in its ``features`` class attribute (names of
:data:`FEATURES`; those it serves only with an engine arg set in ``features_by_arg``); :func:`check_features`
refuses, before any engine starts, a run that asks its engine for one it lacks, naming the registered engines
that serve it; :func:`check_top_logprobs` refuses a ``top_logprobs`` above the engine's limit
(:meth:`~daskgen.engines.base.Engine.top_logprobs_limit`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import SHAPING_OFF
from daskgen.errors import ConfigError

if TYPE_CHECKING:
    from daskgen.engines.base import Engine

#: Every request feature, with what a run asks for when it uses it.
FEATURES: dict[str, str] = {
    "per_row_sampling": "a row's own sampling settings (its 'sampling' column) or a setting of "
    f"{', '.join(SHAPING_OFF)} other than off",
    "stop": "stop strings ('stop', run-level or per row)",
    "stop_token_ids": "stop token ids ('stop_token_ids', run-level or per row)",
    "structured_outputs": "structured outputs ('response_format')",
    "lora": "LoRA adapters ('adapter')",
    "top_logprobs": "top-k logprobs ('top_logprobs')",
    "refresh": "loading published policy versions into the running engine ('refresh')",
    "policy_fingerprint": "checking each loaded policy version's weights, read from the engine's own tensors, "
    "against the fingerprint its publisher recorded (used by 'refresh' runs; a version loads unchecked on an "
    "engine without it)",
    "images": "images in prompts (image_url content parts of 'messages' rows, an 'images' column of 'prompt' rows)",
    "refresh_with_lora": "loading published policy versions into an engine that holds LoRA adapters ('refresh' "
    "with 'adapters'; the adapters apply to the new base weights)",
}


def engines_serving(feature: str) -> list[str]:
    """Registered engines (importable here) that declare ``feature``; one that serves it only with an engine arg
    set is named with it (``"openai (with engine arg managed=true)"``)."""
    from daskgen.engines import available_engines, get_engine_class

    out = []
    for name in available_engines():
        try:
            cls = get_engine_class(name)
        except Exception:  # an engine whose module fails to import serves nothing here
            continue
        if feature in cls.features:
            out.append(name)
        elif feature in cls.features_by_arg:
            pairs = " or ".join(f"{arg}={json.dumps(value)}" for arg, value in cls.features_by_arg[feature])
            out.append(f"{name} (with engine arg {pairs})")
    return out


def check_features(
    engine: str, features: frozenset[str], wanted: Iterable[str], refused: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`ConfigError` when engine ``engine`` (serving ``features``) lacks a feature in ``wanted``;
    ``refused`` gives the reason of a declared feature the engine cannot serve here
    (:meth:`~daskgen.engines.base.Engine.refused_features`)."""
    missing = sorted(set(wanted) - features)
    if not missing:
        return
    refused = refused or {}
    lines = [
        f"{name}: {FEATURES.get(name, name)}; "
        + (f"not with these engine args on this machine: {refused[name]}; " if name in refused else "")
        + f"engines that serve it: {engines_serving(name) or 'none'}"
        for name in missing
    ]
    raise ConfigError(
        f"engine {engine!r} cannot serve what this run asks for:\n  "
        + "\n  ".join(lines)
        + "\nUse one of the engines listed, or drop these settings."
    )


def check_top_logprobs(engine: str, cls: type[Engine], k: int, engine_args: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` when ``top_logprobs=k`` is more than engine ``engine`` (class ``cls``) gives per
    request with ``engine_args``."""
    found = cls.top_logprobs_limit(engine_args) if k else None
    if found is None or k <= found[0]:
        return
    limit, arg = found
    raise ConfigError(
        f"top_logprobs={k} is more than engine {engine!r} gives per request: at most {limit} (its engine arg "
        f"{arg}={limit}). Lower top_logprobs to {limit} or less, or raise the engine's limit: "
        f"--engine-arg {arg}={k} (engine_args: {{{arg}: {k}}} in the config)."
    )
