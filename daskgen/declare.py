"""How an option is declared once, and what derives from the declaration.

An option is a field of an options dataclass, declared with :func:`option`: its type and default are
the field's, its help text, ``--help`` group and command-line spelling are in the field's metadata
(:class:`OptionSpec`).  The tables: :class:`daskgen.run_options.RunOptions` (``daskgen run``, its
``--config`` YAML and :func:`daskgen.generate`), :class:`daskgen.run_options.RunCommand` (flags of
``daskgen run`` only), :class:`daskgen.stream.options.FollowOptions` (``daskgen follow`` and
:func:`daskgen.follow`).  Derived from them:

* the options of a ``daskgen`` command (:mod:`daskgen.cli_flags`);
* the keyword arguments and docstring of a Python entry point (:func:`takes_options`);
* the option table of docs/usage.md (:func:`markdown_table`);
* the settings that form a store's identity (:func:`identity_keys`), those a row may set in its
  ``sampling`` column with their ranges (:func:`row_ranges`), and the values that leave a sampling
  setting off (:func:`off_values`).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import textwrap
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    from daskgen.ranges import Range

F = TypeVar("F", bound=Callable[..., Any])

#: ``option(identity=LATER)``: part of the store's identity only when not at its default (a setting added
#: after stores existed, so that a store written before it resumes).
LATER = "later"


@dataclass(frozen=True)
class OptionSpec:
    """What a field says about itself beyond its type and default.

    Attributes
    ----------
    help:
        One text for ``--help``, the docstring of the Python entry point and docs/usage.md.
    group:
        The ``--help`` panel (and docs/usage.md section) the option is listed in.
    flags:
        Command-line spelling: ``()`` derives ``--name-with-dashes`` (``--x/--no-x`` for a bool);
        ``None`` means the option has no flag (YAML and Python only, e.g. a mapping).
    pairs:
        A mapping given on the command line as repeatable ``KEY=VALUE`` flags (``flags`` names the flag).
    cli_type:
        The flag's type where it is not the field's (a path, or ``str`` for ``int | str``).
    required:
        Needed for a run (from a flag or the config file); a required keyword of the Python entry point.
    identity:
        Part of the store's identity (a resume must match it): ``True``, or :data:`LATER` (only when not
        at its default).
    row:
        A row may set it in its ``sampling`` column: the values it takes (:class:`daskgen.ranges.Range`).
    off:
        The value that leaves a sampling setting off; any other asks the engine for per-row sampling (the
        ``per_row_sampling`` feature), and the engines that take it by name are sent it then.
    """

    help: str
    group: str = ""
    flags: tuple[str, ...] | None = ()
    pairs: bool = False
    cli_type: Any = None
    required: bool = False
    identity: bool | str = False
    row: Range | None = None
    off: Any = None


def option(
    default: Any = None,
    help: str = "",
    *,
    group: str = "",
    flags: tuple[str, ...] | None = (),
    pairs: bool = False,
    cli_type: Any = None,
    required: bool = False,
    factory: Callable[[], Any] | None = None,
    identity: bool | str = False,
    row: Range | None = None,
    off: Any = None,
) -> Any:
    """A dataclass field declaring one option (``factory`` builds a mutable default such as ``{}``; the other
    keywords are the fields of :class:`OptionSpec`)."""
    if row is not None:
        row = row.with_off(off)
    metadata = {"option": OptionSpec(help, group, flags, pairs, cli_type, required, identity, row, off)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Declared:
    """One declared option, read from its dataclass: name, resolved type, default and spec."""

    name: str
    type: Any
    default: Any
    spec: OptionSpec

    @property
    def base_type(self) -> Any:
        """The type without ``None`` (``int`` for ``int | None``)."""
        args = [a for a in typing.get_args(self.type) if a is not type(None)]
        if typing.get_origin(self.type) in (typing.Union, types.UnionType):
            return args[0] if len(args) == 1 else self.type
        return self.type

    @property
    def choices(self) -> tuple[Any, ...]:
        """The values of a ``Literal[...]`` option (empty for other types)."""
        return typing.get_args(self.base_type) if typing.get_origin(self.base_type) is Literal else ()

    @property
    def help(self) -> str:
        """The help text, naming the choices of a ``Literal[...]`` option."""
        if not self.choices:
            return self.spec.help
        return f"{self.spec.help} One of: {', '.join(map(str, self.choices))}."

    @property
    def switch(self) -> bool:
        """A bool given as ``--x/--no-x``."""
        return self.base_type is bool and not self.spec.flags

    @property
    def flags(self) -> tuple[str, ...]:
        """The command-line spelling (empty when the option has no flag)."""
        if self.spec.flags is None:
            return ()
        if self.spec.flags:
            return self.spec.flags
        flag = "--" + self.name.replace("_", "-")
        return (f"{flag}/--no-{flag[2:]}",) if self.switch else (flag,)

    @property
    def cli_type(self) -> Any:
        """The type of the flag's value."""
        return list[str] if self.spec.pairs else self.spec.cli_type or self.base_type

    def python_default(self) -> Any:
        """The default of the Python keyword (``inspect.Parameter.empty`` when required)."""
        return inspect.Parameter.empty if self.spec.required else self.default


def declared(table: type) -> Iterator[Declared]:
    """The options of an options dataclass, in declaration order."""
    namespace = vars(sys.modules[table.__module__])
    for f in dataclasses.fields(table):
        spec = f.metadata.get("option")
        if spec is None:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        yield Declared(f.name, resolve(f.type, namespace), default, spec)


def names(table: type) -> list[str]:
    """The option names of ``table``."""
    return [opt.name for opt in declared(table)]


def identity_keys(table: type) -> tuple[str, ...]:
    """The options of ``table`` that form a store's identity (``option(identity=...)``)."""
    return tuple(opt.name for opt in declared(table) if opt.spec.identity)


def later_identity(table: type) -> dict[str, Any]:
    """The identity options declared :data:`LATER`, with the default at which they stay out of the identity."""
    return {opt.name: opt.default for opt in declared(table) if opt.spec.identity == LATER}


def row_ranges(table: type) -> dict[str, Range]:
    """The options of ``table`` a row may set (``option(row=...)``), with their ranges."""
    return {opt.name: opt.spec.row for opt in declared(table) if opt.spec.row is not None}


def off_values(table: type) -> dict[str, Any]:
    """The options of ``table`` with an off value (``option(off=...)``), with it."""
    return {opt.name: opt.spec.off for opt in declared(table) if opt.spec.off is not None}


def own_parameters(func: Callable[..., Any]) -> list[inspect.Parameter]:
    """The parameters of ``func`` but its ``**options``, their annotations resolved (:func:`resolve`)."""
    return [
        p.replace(annotation=resolve(p.annotation, func.__globals__))
        for p in inspect.signature(func).parameters.values()
        if p.kind is not p.VAR_KEYWORD
    ]


def resolve(annotation: Any, namespace: dict[str, Any]) -> Any:
    """The type an annotation names; the text itself where it names what only type checkers import."""
    if not isinstance(annotation, str):
        return annotation
    try:
        return eval(annotation, namespace)
    except NameError:
        return annotation


def takes_options(table: type, *, after: str = "Returns") -> Callable[[F], F]:
    """Give a ``func(positional..., **options)`` the keyword arguments and docs of ``table``'s options.

    The signature becomes the function's own positional parameters followed by one keyword-only
    parameter per option (required ones without default; a call without them is a ``TypeError``), and
    the docstring gets one entry per option, before its ``after`` section (at the end without one).
    """

    def decorate(func: F) -> F:
        own = own_parameters(func)
        options = [o for o in declared(table) if o.name not in {p.name for p in own}]
        required = [o.name for o in options if o.spec.required]

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            missing = [name for name in required if kwargs.get(name) is None]
            if missing:
                raise TypeError(f"{func.__name__}() missing required keyword argument(s): {', '.join(missing)}")
            return func(*args, **kwargs)

        keywords = [
            inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.python_default(), annotation=o.type)
            for o in options
        ]
        call.__signature__ = inspect.Signature([*own, *keywords])  # type: ignore[attr-defined]
        entries = "".join(
            f"{o.name}:\n{textwrap.fill(o.help, 100, initial_indent='    ', subsequent_indent='    ')}\n"
            for o in options
        )
        doc = inspect.cleandoc(func.__doc__ or "")
        head, sep, tail = doc.partition(f"\n{after}\n")
        call.__doc__ = f"{head.rstrip()}\n{entries}\n{after}\n{tail}" if sep else f"{doc}\n{entries}"
        return call  # type: ignore[return-value]

    return decorate


def markdown_table(settings: type, flag_only: type) -> str:
    """The option table of docs/usage.md: the ``settings`` options, then the ``flag_only`` ones, as in ``--help``."""
    rows: dict[str, list[str]] = {}
    for table in (settings, flag_only):
        for opt in declared(table):
            rows.setdefault(opt.spec.group, []).append(_markdown_row(opt, table is settings))
    lines = ["| setting | flag | default | meaning |", "|---|---|---|---|"]
    for group, group_rows in rows.items():
        lines.append(f"| **{group}** | | | |")
        lines.extend(group_rows)
    return "\n".join(lines) + "\n"


def _markdown_row(opt: Declared, setting: bool) -> str:
    name = f"`{opt.name}`" if setting else "(flag only)"
    if opt.spec.pairs:
        flag = f"`{opt.flags[0]} KEY=VALUE` (repeatable)"
    else:
        flag = " ".join(f"`{f}`" for f in opt.flags) or "(config only)"
    default = "required" if opt.spec.required else f"`{opt.default!r}`"
    return f"| {name} | {flag} | {default} | {opt.help.replace('|', '/')} |"
