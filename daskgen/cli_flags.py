"""The options of a ``daskgen`` command, derived from declared options (:mod:`daskgen.declare`).

:func:`options_command` registers ``func(arguments..., **values)`` as a typer command whose options
are the flags of the given options tables, with their declared defaults; only the flags given on the
command line reach ``func`` (the others are left to the ``--config`` file and the declared defaults).
:func:`given` turns the values the command received back into keyword arguments of one table.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from daskgen.declare import Declared, declared, own_parameters
from daskgen.errors import DaskgenError

F = TypeVar("F", bound=Callable[..., Any])


def options_command(app: typer.Typer, *tables: type) -> Callable[[F], F]:
    """Register ``func`` on ``app``: its own parameters (typer arguments), then the flags of ``tables``.

    ``func`` is called with its arguments and the flags given on the command line only (a flag left at
    its default is left out, so that the ``--config`` file can set it).
    """

    def register(func: F) -> F:
        @functools.wraps(func)
        def command(ctx: typer.Context, **values: Any) -> Any:
            return func(**{k: v for k, v in values.items() if _source(ctx, k) != "DEFAULT"})

        context = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        flags = [_parameter(opt) for table in tables for opt in declared(table) if opt.flags]
        command.__signature__ = inspect.Signature([context, *own_parameters(func), *flags])  # type: ignore[attr-defined]
        app.command()(command)
        return func

    return register


def _source(ctx: typer.Context, name: str) -> str:
    """Where the value of ``name`` came from: ``COMMANDLINE``, ``ENVIRONMENT``, ``DEFAULT``, ...

    By name: typer may carry its own copy of click, whose ``ParameterSource`` is another enum.
    """
    source = ctx.get_parameter_source(name)
    return "" if source is None else source.name


def _parameter(opt: Declared) -> inspect.Parameter:
    info = typer.Option(
        *opt.flags,
        help=opt.help + (" Repeatable." if opt.spec.pairs else ""),
        rich_help_panel=opt.spec.group or None,
        metavar="KEY=VALUE" if opt.spec.pairs else None,
    )
    default = None if opt.spec.pairs else opt.default
    annotation = Annotated[opt.cli_type if default is not None else opt.cli_type | None, info]  # type: ignore[valid-type]
    return inspect.Parameter(opt.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def given(table: type, values: dict[str, Any]) -> dict[str, Any]:
    """The options of ``table`` that were given in ``values`` (KEY=VALUE flags as a mapping, paths as text)."""
    out = {}
    for opt in declared(table):
        value = values.get(opt.name)
        if value is None or (opt.spec.pairs and not value):
            continue
        if opt.spec.pairs:
            value = key_values(value, opt.flags[0])
        elif isinstance(value, Path) and opt.base_type is not Path:
            value = str(value)
        out[opt.name] = value
    return out


def key_values(pairs: list[str], flag: str) -> dict[str, Any]:
    """``["a=1", "b=x"]`` as ``{"a": 1, "b": "x"}`` (each value read as YAML)."""
    import yaml

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise DaskgenError(f"{flag} expects KEY=VALUE, found {pair!r}")
        out[key] = yaml.safe_load(value)
    return out
