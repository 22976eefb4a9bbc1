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
from dask.utils import parse_timedelta

from daskgen.errors import ConfigError

__all__ = ["DEFAULTS", "check_durations", "duration_keys", "get", "seconds"]

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


def seconds(key: str) -> float:
    """A duration tunable in seconds (``"90s"``, ``"15m"`` or a number of seconds).

    Raises :class:`~daskgen.errors.ConfigError` naming the key and where it is set when the value is no duration.
    """
    value = get(key)
    try:
        return float(parse_timedelta(value, default="seconds"))
    except (TypeError, ValueError, KeyError):
        env = "DASK_DASKGEN__" + key.upper().replace("-", "_").replace(".", "__")
        raise ConfigError(
            f"daskgen.{key} must be a duration such as '90s', '15m' or a number of seconds, found {value!r}; "
            f"fix it where it is set (the environment variable {env} or a Dask YAML file)"
        ) from None


def duration_keys(section: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys under ``section`` whose shipped default is a duration string (``"30s"``)."""
    keys = []
    for name, value in section.items():
        if isinstance(value, dict):
            keys += duration_keys(value, f"{prefix}{name}.")
        elif isinstance(value, str):
            try:
                parse_timedelta(value)
            except (TypeError, ValueError, KeyError):
                continue
            keys.append(prefix + name)
    return keys


def check_durations() -> None:
    """Read every duration tunable once, so that a value that is no duration fails before a run starts
    (:class:`~daskgen.errors.ConfigError` naming it), not later on a worker."""
    for key in duration_keys(DEFAULTS["daskgen"]):
        seconds(key)
