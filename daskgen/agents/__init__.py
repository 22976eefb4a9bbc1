"""Agent loops: ``single_turn`` (default), ``tool`` (multi-turn tool calling), or ``module:Class``."""

from __future__ import annotations

from typing import Any

from daskgen.agents.base import AgentLoop, EngineHandle, SingleTurn, Trajectory
from daskgen.errors import ConfigError
from daskgen.importing import import_object

__all__ = ["AgentLoop", "EngineHandle", "SingleTurn", "Trajectory", "create_agent", "resolve_agent_class"]

_BUILTIN = {"single_turn": "daskgen.agents.base:SingleTurn", "tool": "daskgen.agents.tool:ToolLoop"}


def resolve_agent_class(spec: str) -> type[AgentLoop]:
    """``single_turn``, ``tool`` or ``package.module:Class`` (an :class:`AgentLoop` subclass)."""
    target = _BUILTIN.get(spec, spec)
    if ":" not in target:
        raise ConfigError(f"unknown agent {spec!r}; use one of {sorted(_BUILTIN)} or 'package.module:Class'.")
    cls = import_object(target, "agent loop")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ConfigError(f"agent {spec!r} is not a daskgen.agents.AgentLoop subclass.")
    return cls


def create_agent(spec: str, model: str, agent_args: dict[str, Any] | None = None) -> AgentLoop:
    """Instantiate (and thereby validate) an agent loop."""
    return resolve_agent_class(spec)(model, **(agent_args or {}))
