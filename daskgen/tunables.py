"""Tunables: the ``daskgen:`` section of Dask's configuration.

The defaults ship in ``daskgen/daskgen.yaml`` and are merged into :data:`dask.config.config`
with :func:`dask.config.update_defaults` when this module is imported (``import daskgen`` does),
as ``distributed`` and ``dask-jobqueue`` do with theirs; values already set by the user's Dask
YAML files or ``DASK_DASKGEN__...`` environment variables win.  Code reads a value where it uses
it (:func:`seconds`, :func:`get`), never at import, so ``dask.config.set`` applies.  The keys and
what they tune are listed in ``daskgen/daskgen.yaml`` and ``docs/architecture.md``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import dask.config
import yaml
from dask.utils import parse_bytes, parse_timedelta

from daskgen.errors import ConfigError

__all__ = ["DEFAULTS", "check_settings", "env_name", "get", "seconds", "settings"]

_PATH = Path(__file__).with_name("daskgen.yaml")
#: The shipped defaults (the parsed ``daskgen.yaml``).
DEFAULTS: dict[str, Any] = yaml.safe_load(_PATH.read_text())
dask.config.update_defaults(DEFAULTS)

#: Environment variables that earlier daskgen versions read before these settings became tunables, and their key now.
RENAMED_ENV = {
    "DASKGEN_ENGINE_START_TIMEOUT": "engine-start-timeout",
    "DASKGEN_HEALTH_TIMEOUT": "health-timeout",
}


def warn_renamed_env(environ: dict[str, str] | os._Environ = os.environ) -> list[str]:
    """Warn about each set environment variable that daskgen no longer reads, naming its replacement.

    Returns the names found (a setting that is silently ignored would change a run without a word).
    """
    found = [name for name in RENAMED_ENV if name in environ]
    for name in found:
        key = RENAMED_ENV[name]
        env = "DASK_DASKGEN__" + key.upper().replace("-", "_")
        warnings.warn(
            f"{name} is set but no longer read: daskgen's tunables live in Dask's config. "
            f"Set {env}={environ[name]}s (or daskgen.{key} in a Dask YAML file) instead.",
            FutureWarning,
            stacklevel=2,
        )
    return found


warn_renamed_env()


def get(key: str) -> Any:
    """``dask.config.get("daskgen.<key>")``, or the shipped default when the config lacks it.

    The fallback covers code that replaced Dask's config after daskgen was imported (e.g.
    ``distributed.utils_test`` restores the config it saw when it was imported).
    """
    name = f"daskgen.{key}"
    return dask.config.get(name, default=dask.config.get(name, config=DEFAULTS))


def env_name(key: str) -> str:
    """The environment variable that sets ``daskgen.<key>`` (``health-timeout``: ``DASK_DASKGEN__HEALTH_TIMEOUT``)."""
    return "DASK_DASKGEN__" + key.upper().replace("-", "_").replace(".", "__")


def seconds(key: str) -> float:
    """A duration tunable in seconds (``"90s"``, ``"15m"`` or a number of seconds).

    Raises :class:`~daskgen.errors.ConfigError` naming the key and where it is set when the value is no duration.
    """
    value = get(key)
    try:
        return float(parse_timedelta(value, default="seconds"))
    except (TypeError, ValueError, KeyError):
        raise _invalid(key, "a duration such as '90s', '15m' or a number of seconds", value) from None


def _invalid(key: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(
        f"daskgen.{key} must be {expected}, found {value!r}; fix it where it is set (the environment variable "
        f"{env_name(key)} or a Dask YAML file)"
    )


def _is_duration(value: str) -> bool:
    try:
        parse_timedelta(value)
    except (TypeError, ValueError, KeyError):
        return False
    return True


def _is_size(value: str) -> bool:
    try:
        parse_bytes(value)
    except (TypeError, ValueError):
        return False
    return not value.strip().isdigit()


#: What a setting must be, by the kind of its shipped default: a description and a check of a value.
_KINDS: dict[str, tuple[str, Any]] = {
    "duration": ("a duration such as '90s', '15m' or a number of seconds", lambda v: _is_duration(v)),
    "size": ("a size such as '16MiB' or a number of bytes", lambda v: isinstance(v, int) or _is_size(str(v))),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
}


def _kind(default: Any) -> str | None:
    """The kind of a setting whose shipped default is ``default`` (``None``: any value, e.g. an unset option)."""
    if isinstance(default, str):
        return "duration" if _is_duration(default) else "size" if _is_size(default) else "str"
    return next((kind for kind in ("bool", "int", "float") if type(default).__name__ == kind), None)


def settings(section: dict[str, Any] | None = None, prefix: str = "") -> dict[str, Any]:
    """Every setting under ``section`` (default: the shipped ``daskgen:`` section) by its dotted key, with its
    value there."""
    section = DEFAULTS["daskgen"] if section is None else section
    out: dict[str, Any] = {}
    for name, value in section.items():
        if isinstance(value, dict):
            out.update(settings(value, f"{prefix}{name}."))
        else:
            out[prefix + name] = value
    return out


def check_settings() -> None:
    """Check every ``daskgen.*`` setting against the kind of its shipped default, and that each set key is one
    daskgen has: a typo or a bad value fails before a run starts (:class:`~daskgen.errors.ConfigError` naming the
    key, what it must be, what was found and where to fix it), not later on a worker or silently."""
    import difflib

    known = settings()
    given = dask.config.get("daskgen", default={})
    for key, value in settings(given if isinstance(given, dict) else {}).items():
        key = key.replace("_", "-")  # Dask takes either (DASK_DASKGEN__HEALTH_TIMEOUT sets health_timeout)
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean daskgen.{close[0]}?" if close else "; the settings are in daskgen/daskgen.yaml"
            raise ConfigError(
                f"daskgen.{key} (set by {env_name(key)} or a Dask YAML file) is not a daskgen setting{hint}"
            )
        kind = _kind(known[key])
        if kind is not None and value is not None and not _KINDS[kind][1](value):
            raise _invalid(key, _KINDS[kind][0], value)
