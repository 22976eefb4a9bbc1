"""Import a user object given as ``package.module:name`` (engines, agent loops, tools, verifiers)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from daskgen.errors import ConfigError


def import_object(target: str, what: str, error: type[ConfigError] = ConfigError) -> Any:
    """The object ``name`` of ``package.module``; ``error`` names ``what`` and the expected form."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise error(f"{what} {target!r} must be given as 'package.module:name'.")
    try:
        return getattr(import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise error(f"cannot import {what} {target!r}: {exc}") from exc
