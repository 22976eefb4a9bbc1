"""The ``cluster:`` keys of a deployment class, read from its ``__init__`` signature and docstring.

Every keyword-only parameter of a deployment class's ``__init__`` is a ``cluster:`` key of its kind; a
class whose ``__init__`` takes ``**keys`` also takes the keys of its base class.  The parameter's type
and default are the key's; its ``Annotated`` metadata adds the smallest accepted integer
(:class:`AtLeast`), the ``jobqueue.<kind>.*`` settings a batch key falls back to (:class:`Jobqueue`) and
a validator replacing the type check (:class:`Check`); its entry in the class docstring's numpydoc
``Parameters`` section is its help.  :func:`class_keys` reads them; :func:`check_value` validates one
value against its key; :func:`markdown_table` renders the reference table of ``docs/hpc.md``.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dask.utils import parse_timedelta

from daskgen.errors import ConfigError

__all__ = [
    "AtLeast",
    "Check",
    "ClusterKey",
    "Jobqueue",
    "check_duration",
    "check_value",
    "check_walltime",
    "class_keys",
    "markdown_table",
    "same_queue",
]


@dataclass(frozen=True)
class AtLeast:
    """``Annotated`` metadata: the smallest accepted value of an integer key."""

    value: int


class Jobqueue(tuple[str, ...]):
    """``Annotated`` metadata: the ``jobqueue.<kind>.*`` settings (first one set wins) a key left out takes."""

    def __new__(cls, *names: str) -> Jobqueue:
        return super().__new__(cls, names)


@dataclass(frozen=True)
class Check:
    """``Annotated`` metadata: a validator ``check(name, value) -> value`` replacing the type check."""

    check: Callable[[str, Any], Any]


@dataclass(frozen=True)
class ClusterKey:
    """One ``cluster:`` key as its deployment class declares it (``type`` keeps the ``Annotated`` metadata),
    and the kinds that take it."""

    name: str
    type: Any
    default: Any
    help: str
    kinds: tuple[str, ...] = ()

    def _metadata(self, cls: type[Any]) -> Any:
        return next((extra for extra in getattr(self.type, "__metadata__", ()) if isinstance(extra, cls)), None)

    @property
    def at_least(self) -> int | None:
        """The smallest accepted value of an integer key (:class:`AtLeast`), or ``None``."""
        found = self._metadata(AtLeast)
        return None if found is None else found.value

    @property
    def jobqueue(self) -> tuple[str, ...]:
        """The ``jobqueue.<kind>.*`` settings the key falls back to (:class:`Jobqueue`)."""
        return tuple(self._metadata(Jobqueue) or ())

    @property
    def check(self) -> Callable[[str, Any], Any] | None:
        """The validator replacing the type check (:class:`Check`), or ``None``."""
        found = self._metadata(Check)
        return None if found is None else found.check

    @property
    def is_list(self) -> bool:
        """Whether the key takes a list of strings (extending the configured list)."""
        return typing.get_origin(value_type(self.type)) is list

    def type_name(self) -> str:
        """The type as the docs and error messages spell it."""
        names: dict[Callable[[str, Any], Any], str] = {check_walltime: "quoted string", check_duration: "duration"}
        if self.check is not None:
            return names.get(self.check, "any")
        if self.is_list:
            return "list of strings"
        kind = value_type(self.type)
        name = {int: "integer", str: "string", bool: "true/false"}.get(kind, "any")
        return f"{name} >= {self.at_least}" if self.at_least is not None else name


def value_type(annotation: Any) -> Any:
    """The type a key's value has when given: the annotation without ``None`` and ``Annotated``."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return args[0] if len(args) == 1 else Any
    return annotation


#: Keys read per class, once (a class's signature and docstring do not change while it runs).
_KEYS: dict[type, dict[str, ClusterKey]] = {}


def class_keys(cls: type) -> dict[str, ClusterKey]:
    """The ``cluster:`` keys a deployment class takes: its keyword-only ``__init__`` parameters.

    A class whose ``__init__`` takes ``**keys`` forwards them to its base: the keys of the next
    ``__init__`` along the method resolution order follow.  A parameter missing from its class's
    ``Parameters`` docstring section is a programming error (``TypeError``).
    """
    if cls not in _KEYS:
        _KEYS[cls] = _read_class_keys(cls)
    return _KEYS[cls]


def _read_class_keys(cls: type) -> dict[str, ClusterKey]:
    """:func:`class_keys`, read from the class."""
    keys: dict[str, ClusterKey] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        hints, helps = typing.get_type_hints(init, include_extras=True), parameter_help(klass)
        params = list(inspect.signature(init).parameters.values())
        for param in params:
            if param.kind is param.KEYWORD_ONLY and param.name not in keys:
                if param.name not in helps:
                    raise TypeError(f"{klass.__name__}: document {param.name!r} in the docstring's Parameters")
                keys[param.name] = ClusterKey(param.name, hints[param.name], param.default, helps[param.name])
        if not any(param.kind is param.VAR_KEYWORD for param in params):
            break
    return keys


def parameter_help(cls: type) -> dict[str, str]:
    """The entries of a class docstring's numpydoc ``Parameters`` section, each joined into one line."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    section = re.search(r"^Parameters\n-+\n(.*?)(?=^\S[^\n]*\n-+\n|\Z)", doc, re.DOTALL | re.MULTILINE)
    entries = re.findall(r"^(\w+)[^\n]*\n((?:[ \t]+\S[^\n]*\n?)+)", section[1] if section else "", re.MULTILINE)
    return {name: " ".join(text.split()) for name, text in entries}


def check_value(key: ClusterKey, value: Any) -> Any:
    """``value`` of ``key`` type-checked (numbers given for a string are stringified, one multi-line
    string for a list is split into lines).

    Raises
    ------
    ConfigError
        Naming the key, the expected type, the value found and how to write it.
    """
    if key.check is not None:
        return key.check(key.name, value)
    kind = value_type(key.type)
    if key.is_list:
        return _str_list(key.name, value)
    if kind is bool and not isinstance(value, bool):
        raise ConfigError(f"cluster.{key.name} must be true or false, got {value!r}; write it unquoted in YAML")
    if kind is int:
        lowest = key.at_least if key.at_least is not None else -(2**63)
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
            raise ConfigError(
                f"cluster.{key.name} must be an integer >= {lowest}, got {value!r} ({type(value).__name__}); "
                "write a whole number, unquoted in YAML"
            )
    if kind is str:
        return _str_value(key.name, value)
    return value


def check_walltime(name: str, value: Any) -> str:
    """A walltime must be a string: YAML reads an unquoted ``30:00`` as the base-60 integer 1800."""
    if not isinstance(value, str):
        raise ConfigError(
            f"cluster.{name} must be a string like '04:00:00', got {value!r} ({type(value).__name__}); "
            "quote it in YAML (unquoted 30:00 is read as the base-60 integer 1800)"
        )
    return value


def check_duration(name: str, value: Any) -> Any:
    """Durations are dask timedeltas ('55m', '1h', 90); ``lifetime`` also takes 'auto' and false."""
    if name == "lifetime" and (value is False or str(value).lower() in ("auto", "off", "none", "false")):
        return value
    try:
        parse_timedelta(value, default="s")
    except (ValueError, TypeError, KeyError):
        raise ConfigError(f"cluster.{name} must be a duration like '55m' or 3300, got {value!r}") from None
    return value


def same_queue(queue: str | None, partition: str | None) -> str | None:
    """The queue of ``cluster.queue`` and its alias ``cluster.partition``.

    Raises
    ------
    ConfigError
        When both are given and differ.
    """
    if queue and partition and queue != partition:
        raise ConfigError(f"cluster.queue={queue!r} and cluster.partition={partition!r} differ; give one of them")
    return queue or partition


def _str_value(name: str, value: Any) -> str:
    """A string value (numbers such as a memory size of 64 are accepted and stringified)."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"cluster.{name} must be a string, got {value!r}")
    return str(value)


def _str_list(name: str, value: Any) -> list[str]:
    """A list of strings; a single string is split into lines."""
    if isinstance(value, str):
        return [line for line in value.splitlines() if line.strip()]
    if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ConfigError(f"cluster.{name} must be a list of strings (or one multi-line string), got {value!r}")


def markdown_table(keys: Iterable[ClusterKey], all_kinds: tuple[str, ...]) -> str:
    """The reference table of ``cluster:`` keys (``docs/hpc.md``): kinds, type, default, jobqueue fallback, help."""
    rows = [
        "| key | kinds | type | default | falls back to `jobqueue.<kind>.` | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for key in keys:
        kinds = "all" if key.kinds == all_kinds else ", ".join(key.kinds)
        default = "" if key.default in (None, inspect.Parameter.empty) else f"`{key.default}`"
        fallback = " / ".join(f"`{name}`" for name in key.jobqueue)
        rows.append(f"| `{key.name}` | {kinds} | {key.type_name()} | {default} | {fallback} | {key.help} |")
    return "\n".join(rows) + "\n"
