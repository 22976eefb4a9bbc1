"""Engine registry: implementations are found by name in the ``daskgen.engines`` entry-point group.

The built-in engines (``transformers``, ``simulated``, ``sglang``, ``vllm``, ``openai``) are registered
once, as entry points in daskgen's ``pyproject.toml``, exactly like third-party engines; so
daskgen must be installed (``pip install -e .`` in a source checkout) for them to be found.
Two distributions registering the same name give a :class:`RuntimeWarning`; the first one found
(in ``sys.path`` order) is used.
"""

from __future__ import annotations

import warnings
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any

from daskgen.engines.base import Engine, EngineStatus, FinishReason, GenerationRequest, GenerationResult, SamplingParams
from daskgen.errors import EngineNotFoundError

__all__ = [
    "Engine",
    "EngineStatus",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "SamplingParams",
    "available_engines",
    "create_engine",
    "get_engine_class",
    "resolve_engine_class",
]

GROUP = "daskgen.engines"


def _targets() -> dict[str, str]:
    """``name -> "module:attr"`` of every registered engine (the first registration of a name wins)."""
    targets: dict[str, str] = {}
    for ep in entry_points(group=GROUP):
        known = targets.get(ep.name)
        if known is None:
            targets[ep.name] = ep.value
        elif known != ep.value:
            dist = getattr(ep.dist, "name", "an unknown distribution")
            warnings.warn(
                f"engine {ep.name!r} is registered twice in the {GROUP!r} entry-point group: using "
                f"{known!r}, ignoring {ep.value!r} (from {dist})",
                RuntimeWarning,
                stacklevel=3,
            )
    return targets


def available_engines() -> list[str]:
    """Names of every registered engine whose module exists."""
    names = []
    for name, target in sorted(_targets().items()):
        module = target.split(":")[0]
        try:
            from importlib.util import find_spec

            if find_spec(module) is not None:
                names.append(name)
        except ModuleNotFoundError:
            continue
    return names


def get_engine_class(name: str) -> type[Engine]:
    """Return the engine class registered as ``name`` (imports it lazily)."""
    targets = _targets()
    if name not in targets:
        raise EngineNotFoundError(
            f"unknown engine {name!r}; registered engines are {sorted(targets)}. "
            f"Third-party engines register under the entry-point group {GROUP!r}."
            + ("" if targets else " None is registered: install daskgen (`pip install -e .` in a source checkout).")
        )
    module_name, _, attr = targets[name].partition(":")
    try:
        module = import_module(module_name)
    except ModuleNotFoundError as exc:
        raise EngineNotFoundError(
            f"engine {name!r} needs the module {exc.name!r}, which is not installed; "
            f"install it (e.g. `pip install daskgen[{name}]`)."
        ) from exc
    return getattr(module, attr)


def resolve_engine_class(spec: str) -> type[Engine]:
    """A registered engine name, or ``package.module:Class`` for a user engine."""
    if ":" not in spec:
        return get_engine_class(spec)
    from daskgen.importing import import_object

    cls = import_object(spec, "engine", EngineNotFoundError)
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise EngineNotFoundError(f"{spec!r} is not a daskgen.engines.Engine subclass.")
    return cls


def create_engine(name: str, model: str, **engine_args: Any) -> Engine:
    """Instantiate the engine ``name`` for ``model`` (does not start it)."""
    return resolve_engine_class(name)(model, **engine_args)
