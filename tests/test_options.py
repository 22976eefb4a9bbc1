"""Each option is declared once (daskgen/run_options.py, daskgen/stream/options.py): the CLI, the Python
entry points and the option table of docs/usage.md agree with the declarations, name for name and default for default.

``python -m tests.test_options`` rewrites that option table from the declarations.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import daskgen
from daskgen.cli import app
from daskgen.declare import declared, markdown_table, names
from daskgen.run_options import RunCommand, RunOptions
from daskgen.settings import cluster_section
from daskgen.stream.options import FollowOptions, SinkOptions

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
BLOCK = re.compile(r"(<!-- run-options: begin[^\n]*-->\n)(.*?)(<!-- run-options: end -->)", re.S)


def command_params(name: str) -> dict[str, object]:
    """The click parameters of ``daskgen NAME`` by name (without ``--help``)."""
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params if p.name != "help"}


@pytest.mark.parametrize(
    ("command", "tables"), [("run", (RunOptions, RunCommand)), ("follow", (FollowOptions, SinkOptions))]
)
def test_command_flags_are_the_declared_ones(command, tables):
    params = command_params(command)
    flagged = [opt for table in tables for opt in declared(table) if opt.flags]
    arguments = {name for name, p in params.items() if p.param_type_name == "argument"}
    assert set(params) - arguments == {opt.name for opt in flagged}, "a flag without a declaration, or one missing"
    for opt in flagged:
        param = params[opt.name]
        spelled = [*param.opts, *param.secondary_opts]
        expected = [f for flag in opt.flags for f in flag.split("/")]
        assert sorted(spelled) == sorted(expected), opt.name
        assert param.default == (None if opt.spec.pairs else opt.default), opt.name
        assert param.help.startswith(opt.spec.help), opt.name


def test_existing_flag_spellings_still_work():
    params = command_params("run")
    spelled = {f for p in params.values() for f in [*p.opts, *p.secondary_opts]}
    for flag in (
        "--config",
        "--scheduler-address",
        "--tls-ca",
        "--tls-cert",
        "--tls-key",
        "--cluster",
        "--insecure",
        "--no-progress",
        "--show",
        "--retry-failed",
        "--skip-overlong",
        "--length-hints",
        "--engine-arg",
        "--agent-arg",
        "--logprobs",
        "--no-logprobs",
        "--keep-partial",
        "--no-keep-partial",
        "--window",
    ):
        assert flag in spelled, flag


@pytest.fixture
def captured(monkeypatch):
    """``daskgen run`` with the run replaced: the RunConfig it would run with."""
    import daskgen.client.runner as runner

    seen = {}

    class Summary:
        interrupted, failed = False, 0

        def line(self):
            return "done"

    def fake_run(config, **kwargs):
        seen["config"], seen["command"] = config, kwargs.get("command")
        return Summary()

    monkeypatch.setattr(runner, "run", fake_run)

    def invoke(*args):
        res = CliRunner().invoke(app, ["run", *map(str, args)])
        assert res.exit_code == 0, (res.output, res.exception)
        return seen.pop("config")

    invoke.command = lambda: seen["command"]
    return invoke


#: Values that pass validation where the type's generic sample would not.
SAMPLES = {"window": ("3", 3), "deadline": ("90m", "90m"), "grace": ("30s", "30s"), "top_p": ("0.5", 0.5),
           "response_format": ('{"regex": "x"}', {"regex": "x"}), "refresh": ("drain", "drain"),
           "dispatch": ("order", "order"), "image_storage": ("reference", "reference")}  # fmt: skip


def sample(opt, samples=SAMPLES):
    """A non-default value of ``opt`` on the command line, and what the config holds then."""
    if opt.name in samples:
        return [opt.flags[0], samples[opt.name][0]], samples[opt.name][1]
    if opt.spec.pairs:
        return [opt.flags[0], "a=1", opt.flags[0], "b=[x]"], {"a": 1, "b": ["x"]}
    if opt.cli_type in (list[str], list[int]):  # a repeatable flag
        return [opt.flags[0], "7", opt.flags[0], "8"], ["7", "8"] if opt.cli_type == list[str] else [7, 8]
    on, off = opt.flags[0].split("/") if opt.switch else (opt.flags[0], None)
    if opt.switch:
        return ([on], True) if opt.default is False else ([off], False)
    value = {int: 7, float: 0.5, str: "x", Path: "x"}[opt.cli_type]
    return [opt.flags[0], value], str(value) if opt.cli_type is Path else value


def test_every_run_flag_reaches_the_config_and_unset_ones_leave_it(captured, tmp_path):
    adapter = tmp_path / "lora"  # adapters must be LoRA adapter folders
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    samples = {**SAMPLES, "adapters": (f"x={adapter}", {"x": str(adapter)}), "adapter": ("x", "x")}
    args, expected = [], {}
    for opt in declared(RunOptions):
        if opt.flags:
            given, expected[opt.name] = sample(opt, samples)
            args += given
    config = captured(*args).to_dict()  # the options' canonical form (window a number, JSON text an object)
    assert {k: config[k] for k in expected} == expected
    cfg = tmp_path / "run.yaml"
    cfg.write_text("n_samples: 3\nprogress: false\nengine_args: {a: 1}\ncluster: {kind: slurm, cores: 4}\n")
    from_file = captured("--config", cfg, "--model", "m")
    assert (from_file.n_samples, from_file.progress, from_file.engine_args, from_file.model) == (
        3,
        False,
        {"a": 1},
        "m",
    )
    assert from_file.top_p == RunOptions().top_p
    flags_only = captured("--config", cfg, "--cluster", "pbs", "--insecure")
    merged = cluster_section(flags_only, captured.command())
    assert merged == {"kind": "pbs", "cores": 4, "tls": False, "threads_per_worker": 65}  # auto window: 64 + 1
    assert flags_only.cluster == {"kind": "slurm", "cores": 4}, "the options stay as given; the flags merge once"


def test_generate_takes_every_run_option():
    signature = inspect.signature(daskgen.generate)
    first, *keywords = signature.parameters.values()
    assert first.name == "prompts" and first.kind is first.POSITIONAL_OR_KEYWORD
    assert all(p.kind is p.KEYWORD_ONLY for p in keywords)
    assert [p.name for p in keywords] == [n for n in names(RunOptions) if n != "prompts"]
    for opt in declared(RunOptions):
        if opt.name != "prompts":
            param = signature.parameters[opt.name]
            assert param.default == (param.empty if opt.spec.required else opt.default), opt.name
            assert f"\n{opt.name}:\n" in daskgen.generate.__doc__, opt.name
    with pytest.raises(TypeError, match="model"):
        daskgen.generate("prompts.jsonl", store="out.zarr")


def test_follow_takes_every_follow_option():
    signature = inspect.signature(daskgen.follow)
    store, *keywords = signature.parameters.values()
    assert store.name == "store"
    assert {p.name: p.default for p in keywords} == {o.name: o.default for o in declared(FollowOptions)}
    assert all(f"\n{name}:\n" in daskgen.follow.__doc__ for name in names(FollowOptions))


def usage_block() -> str:
    match = BLOCK.search(USAGE.read_text())
    assert match, "docs/usage.md has no run-options block"
    return match[2]


def test_usage_option_table_is_the_declared_one():
    assert usage_block() == markdown_table(RunOptions, RunCommand), "run `python -m tests.test_options`"


def test_usage_line_uses_declared_flags():
    usage = USAGE.read_text().split("## Running", 1)[1].split("```", 2)[1]
    spelled = {f for t in (RunOptions, RunCommand) for o in declared(t) for flag in o.flags for f in flag.split("/")}
    used = set(re.findall(r"--[a-z][a-z-]*", usage))
    assert used and used <= spelled, used - spelled


if __name__ == "__main__":
    text = USAGE.read_text()
    USAGE.write_text(BLOCK.sub(lambda m: m[1] + markdown_table(RunOptions, RunCommand) + m[3], text))
