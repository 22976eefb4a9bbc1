"""A run's settings are resolved once (daskgen.config.resolve) into a frozen RunSettings that the plan holds: the
cluster section gets the command line's flags in one place, and the client's planning and driving modules read the
settings instead of deriving them again from RunConfig."""

from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from daskgen.config import RunConfig
from daskgen.engines.simulated import SimulatedEngine
from daskgen.errors import ConfigError
from daskgen.run_options import RunCommand
from daskgen.settings import RunSettings, cluster_section, resolve
from daskgen.worker.rounds import VerifyPolicy

CLIENT = Path(__file__).resolve().parents[1] / "daskgen" / "client"
#: RunConfig's methods that derive something (each has its value in RunSettings).
DERIVING = [
    name
    for name, member in vars(RunConfig).items()
    if inspect.isfunction(member) and not name.startswith("_") and name not in ("require", "to_dict")
]


def options(tmp_path: Path, **more) -> RunConfig:
    return RunConfig(model="sim", store=str(tmp_path / "s.zarr"), engine="simulated", **more)


def test_resolve_derives_every_setting_once_into_a_frozen_object(tmp_path):
    config = options(tmp_path, keep_columns="a, b", response_format={"regex": "x+"}, grace="2m", deadline="90m")
    settings = resolve(config, [{"prompt": "p"}])
    assert settings.engine_cls is SimulatedEngine and settings.simulated
    assert settings.location == config.location()
    assert settings.kept_columns == ("a", "b")
    assert settings.structured is not None and settings.structured.as_dict() == {"regex": "x+"}
    assert settings.grace_s == 120 and settings.deadline_at == pytest.approx(settings.started + 5400)
    assert settings.identity == config.identity() and settings.verify is None
    assert "storage_options" not in settings.record and settings.record["model"] == "sim"
    assert settings.stop_ids == (settings.tokenizer.eos_token_id,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.kept_columns = ()  # type: ignore[misc]


def test_resolve_refuses_before_anything_is_created(tmp_path):
    with pytest.raises(ConfigError, match=r"missing required setting\(s\) \['prompts'\]: pass --prompts"):
        resolve(options(tmp_path))
    with pytest.raises(ConfigError, match="until_correct/stop_when need a verifier"):
        resolve(options(tmp_path, until_correct=1), [])
    with pytest.raises(ConfigError, match="round_size=3 must be >= 1 and divide n_samples=4"):
        resolve(options(tmp_path, verifier="tests.verifiers:even_first_token", n_samples=4, round_size=3), [])
    assert not (tmp_path / "s.zarr").exists()


def test_the_verify_policy_is_built_from_the_options():
    config = RunConfig(verifier="tests.verifiers:even_first_token", n_samples=4, round_size=2, until_correct=1)
    policy = VerifyPolicy.of(config)
    assert policy == VerifyPolicy("tests.verifiers:even_first_token", round_size=2, until_correct=1)
    assert config.verify_policy() == policy


def test_the_command_lines_flags_meet_the_cluster_section_in_one_place():
    config = RunConfig(cluster={"kind": "slurm", "cores": 4}, min_workers=1, max_workers=3, n_workers=2, window=5)
    merged = cluster_section(config, RunCommand(cluster_kind="pbs", insecure=True))
    assert merged == {"kind": "pbs", "cores": 4, "tls": False, "min_workers": 1, "max_workers": 3,
                      "threads_per_worker": 6}  # fmt: skip
    assert config.cluster == {"kind": "slurm", "cores": 4}, "the options stay as given"
    local = cluster_section(RunConfig(n_workers=2, cluster={"threads_per_worker": 2}))
    assert local == {"threads_per_worker": 2, "n_workers": 2}, "n_workers for a local cluster; its own slots kept"
    assert cluster_section(RunConfig())["threads_per_worker"] == 65  # window auto: at most 64 partitions + 1


@pytest.mark.parametrize("module", sorted(p.name for p in CLIENT.glob("*.py")))
def test_the_client_reads_the_settings_and_derives_nothing_again(module):
    """After resolve, nothing in client/ calls RunConfig's deriving methods (the runner's grace period, needed before
    the settings exist to catch signals while they are resolved, and generate's return value aside)."""
    allowed = {
        "runner.py": {"grace_seconds", "location"},
        "engines.py": {"grace_seconds", "location"},  # start_engines given options only (no plan: benchmarks)
    }.get(module, set())
    text = (CLIENT / module).read_text()
    called = {name for name in DERIVING if re.search(rf"\b(config|cfg|options)\.{name}\(", text)} - allowed
    assert not called, f"client/{module} derives {sorted(called)} again: read them from RunSettings"
    assert not re.search(r"\bresolve_engine_class\b", text), "the engine class is RunSettings.engine_cls"


def test_the_plan_holds_the_settings(tmp_path):
    from daskgen.client.plan import Plan, make_plan

    settings = resolve(options(tmp_path), [{"prompt": "a"}, {"prompt": "b"}])
    plan = make_plan(settings)
    assert isinstance(plan, Plan) and plan.settings is settings and isinstance(plan.settings, RunSettings)
    assert (plan.config, plan.tokenizer, plan.template) == (settings.options, settings.tokenizer, settings.template)
    assert plan.store.attrs.identity == settings.identity and plan.store.attrs.config == settings.record


def test_only_the_cluster_section_merges_flags_into_a_section():
    package = CLIENT.parent
    callers = [
        str(p.relative_to(package))
        for p in sorted(package.rglob("*.py"))
        if re.search(r"\bapply_cli_overrides\(", p.read_text()) and p.name not in ("spec.py",)
    ]
    assert callers == ["settings.py"], callers


def test_the_options_stay_as_given_and_the_settings_hold_their_canonical_form(tmp_path):
    given = {"grace": 90, "deadline": 60, "window": "3", "temperature": 1, "response_format": '{"regex": "x+"}'}
    config = options(tmp_path, **given)
    assert {k: getattr(config, k) for k in given} == given, "checking the options rewrites none of them"
    settings = resolve(config, [])
    assert (settings.window, settings.grace_s, settings.structured.as_dict()) == (3, 90, {"regex": "x+"})
    record = settings.record
    assert (record["grace"], record["deadline"], record["window"], record["response_format"]) == (
        "90s",
        "60s",
        3,
        {"regex": "x+"},
    )
    assert isinstance(record["temperature"], float) and settings.identity["temperature"] == 1.0
