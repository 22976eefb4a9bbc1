"""A sampling setting is declared once, in the option table (daskgen/run_options.py): the per-row keys and their
ranges, the store's identity and the off values are read from it, and the engine contract's
:class:`~daskgen.engines.base.SamplingParams` agrees with it field for field."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from daskgen.cli import app
from daskgen.config import IDENTITY_KEYS, LATER_IDENTITY_KEYS, RunConfig
from daskgen.declare import LATER, declared
from daskgen.engines.base import SHAPING_OFF, SamplingParams
from daskgen.errors import ConfigError
from daskgen.input.sampling import KEYS, OFF, run_settings
from daskgen.run_options import RunOptions
from daskgen.worker.samples.row_sampling import row_params
from tests.test_sampling import EDGES

OPTIONS = {opt.name: opt for opt in declared(RunOptions)}
FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
#: SamplingParams fields that are no run option: set per request by the worker.
REQUEST_ONLY = {"continued", "images"}  # set per request: a continuation's tokens so far, the row's images
#: How a table type reads as a SamplingParams annotation (lists travel as tuples).
AS_FIELD = {"float": "float", "int": "int", "bool": "bool", "list[str]": "tuple[str, ...]",
            "list[int]": "tuple[int, ...]"}  # fmt: skip


def type_text(annotation: object) -> str:
    return str(annotation).replace("<class '", "").replace("'>", "").replace(" | None", "")


def test_the_derived_lists_are_read_from_the_table():
    assert list(KEYS) == [name for name, opt in OPTIONS.items() if opt.spec.row is not None]
    assert {name: r.text for name, r in KEYS.items()} == {n: o.spec.row.text for n, o in OPTIONS.items() if o.spec.row}
    assert tuple(name for name, opt in OPTIONS.items() if opt.spec.identity) == IDENTITY_KEYS
    assert {n: o.default for n, o in OPTIONS.items() if o.spec.identity == LATER} == LATER_IDENTITY_KEYS
    assert SHAPING_OFF == OFF == {name: opt.spec.off for name, opt in OPTIONS.items() if opt.spec.off is not None}


def test_every_sampling_params_field_is_a_run_option_or_set_per_request():
    assert set(FIELDS) - set(OPTIONS) == REQUEST_ONLY, "a SamplingParams field without a run option"


@pytest.mark.parametrize("key", sorted(KEYS))
def test_every_per_row_key_is_a_sampling_params_field_of_the_same_type_and_default(key):
    """A key a row may set reaches the engine as the SamplingParams field of its name, with the table's type and
    default (lists as tuples; the run ``seed`` is no request's: each sample gets its own, None until then)."""
    assert key in FIELDS, f"per-row key {key!r} is no SamplingParams field: add it to the engine contract"
    opt, field = OPTIONS[key], FIELDS[key]
    assert AS_FIELD[type_text(opt.type)] == type_text(field.type), (opt.type, field.type)
    if key == "seed":
        assert field.default is None
    elif opt.spec.row.kind == "list":
        assert opt.default is None and field.default == ()
    else:
        assert field.default == opt.default and type(field.default) is type(opt.default)


@pytest.mark.parametrize("name", sorted(set(FIELDS) - REQUEST_ONLY - set(KEYS)))
def test_run_level_sampling_params_fields_agree_with_the_table(name):
    """logprobs, top_logprobs, adapter, response_format: run settings (a row sets the last two in columns of their
    own) with the same default as the request field."""
    opt, field = OPTIONS[name], FIELDS[name]
    assert opt.spec.row is None
    assert field.default == opt.default, (name, field.default, opt.default)


@pytest.mark.parametrize("name", sorted(set(FIELDS) - REQUEST_ONLY))
def test_what_reaches_the_engine_is_part_of_the_store_identity(name):
    assert name in IDENTITY_KEYS, f"{name!r} changes what is generated: declare it with identity=True (or LATER)"


@pytest.mark.parametrize("key", sorted(SHAPING_OFF))
def test_an_off_value_is_the_default_of_the_setting_and_of_the_request(key):
    assert OPTIONS[key].default == SHAPING_OFF[key] == FIELDS[key].default
    assert key in KEYS, "a setting with an off value is one a row may set"
    assert f"({SHAPING_OFF[key]:g} = off)" in KEYS[key].text


@pytest.mark.parametrize("key", sorted(set(KEYS) - {"seed"}))
def test_row_params_carry_every_per_row_key_and_keep_the_run_level_fields(key):
    defaults = run_settings(RunOptions())
    value = next(v for v in EDGES[key][1] if v != OPTIONS[key].default and v not in ([], ""))
    value = [value] if key == "stop" and isinstance(value, str) else value
    run = SamplingParams(logprobs=True, top_logprobs=3, adapter="a")
    params = row_params({**defaults, key: value}, (99,), run)
    expected = tuple(value) if isinstance(value, list) else value
    if key == "stop_token_ids":
        expected = (*expected, 99) if 99 not in expected else expected
    assert getattr(params, key) == expected
    assert (params.logprobs, params.top_logprobs, params.adapter) == (True, 3, "a")
    others = {k for k in KEYS if k not in (key, "seed", "stop_token_ids")}
    assert all(getattr(params, k) == getattr(row_params(defaults, (99,), run), k) for k in others)


def test_a_new_identity_setting_at_its_default_stays_out_of_the_identity():
    identity = RunConfig().identity()
    assert set(LATER_IDENTITY_KEYS).isdisjoint(identity)
    assert set(IDENTITY_KEYS) - set(LATER_IDENTITY_KEYS) <= set(identity)
    assert RunConfig(top_logprobs=2).identity()["top_logprobs"] == 2


@pytest.mark.parametrize(
    ("name", "bad", "choices", "unset"),
    [
        ("refresh", "drian", "'drain', 'continue'", " (or unset: off)"),
        ("dispatch", "prefixes", "'auto', 'prefix', 'order'", ""),
    ],
)
def test_a_choice_setting_is_checked_and_listed_from_its_type(name, bad, choices, unset):
    with pytest.raises(ConfigError) as info:
        RunConfig(**{name: bad})
    assert str(info.value) == f"setting {name!r} must be one of {choices}{unset}, found {bad!r}."
    assert OPTIONS[name].help.endswith(f"One of: {choices.replace(chr(39), '')}.")
    res = CliRunner().invoke(app, ["run", f"--{name}", bad])
    assert res.exit_code == 2 and bad in res.output, res.output


PACKAGE = Path(__file__).resolve().parents[1] / "daskgen"
#: Where a per-row key is named besides its declaration, the engines and the conformance suite: a rule of its own.
OWN_RULES = {
    "max_new_tokens": "the store's response width and the row limit against the run's",
    "min_new_tokens": "at most max_new_tokens (input/sampling.py)",
    "stop": "the stop rule and a sample's stop reason",
    "stop_token_ids": "the stop rule and the tokenizer's end ids",
    "seed": "per-sample seeds",
    "temperature": "examples in messages and docstrings",
}


@pytest.mark.parametrize("key", sorted(set(KEYS) - set(OWN_RULES)))
def test_a_sampling_setting_is_named_only_by_its_declaration_and_the_engines(key):
    """What docs/architecture.md ("Adding a sampling setting") promises: input/, config, client/, worker/ and the
    CLI read a setting from the table; only the engines (engines/, the conformance suite in testing/) name it."""
    assert set(OWN_RULES) < set(KEYS)
    homes = {PACKAGE / "run_options.py", PACKAGE / "engines", PACKAGE / "testing"}
    named = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == home or home in path.parents for home in homes)
        and re.search(rf"\b{key}\b", path.read_text())
    ]
    assert named == [], f"{key!r} is named outside its declaration and the engines: {named}"
