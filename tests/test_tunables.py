"""Tunables live in the ``daskgen:`` section of Dask's config (daskgen/daskgen.yaml), read where used."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import dask
import pytest
import yaml

import daskgen
from daskgen import store, tunables
from daskgen.errors import ConfigError
from daskgen.store.records.lock import StoreLock


def test_shipped_defaults_are_in_dask_config() -> None:
    shipped = yaml.safe_load((Path(daskgen.__file__).parent / "daskgen.yaml").read_text())["daskgen"]
    assert dask.config.get("daskgen.health-timeout") == shipped["health-timeout"] == "60s"
    assert tunables.seconds("health-timeout") == 60.0 and tunables.seconds("sglang.monitor-interval") == 0.5
    assert store.layout.coarse_chunk() == 65536


def test_values_are_read_where_used_so_config_set_applies(tmp_path: Path) -> None:
    with dask.config.set({"daskgen.coarse-chunk": 4, "daskgen.lock.stale-after": "2m"}):
        layout = store.Layout(10, 1, 2, 2, 5, 0)
        assert layout.array_specs()["status"].chunks == (4,)
        assert StoreLock(tmp_path).stale_after == 120.0
    assert store.Layout(10, 1, 2, 2, 5, 0).array_specs()["status"].chunks == (10,)


def test_environment_and_user_yaml_override_the_shipped_defaults(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("daskgen:\n  lock:\n    heartbeat-interval: 7s\n")
    env = {**os.environ, "DASK_DASKGEN__HEALTH_TIMEOUT": "3s", "DASK_CONFIG": str(tmp_path)}
    code = (
        "from daskgen import tunables; "
        "print(tunables.seconds('health-timeout'), tunables.seconds('lock.heartbeat-interval'), "
        "tunables.seconds('lock.stale-after'))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout
    assert out.split() == ["3.0", "7.0", "300.0"]


def test_a_renamed_environment_variable_warns_with_its_replacement() -> None:
    with pytest.warns(FutureWarning, match="DASK_DASKGEN__ENGINE_START_TIMEOUT=3s"):
        found = tunables.warn_renamed_env({"DASKGEN_ENGINE_START_TIMEOUT": "3", "PATH": "/bin"})
    assert found == ["DASKGEN_ENGINE_START_TIMEOUT"]
    assert tunables.warn_renamed_env({"DASK_DASKGEN__HEALTH_TIMEOUT": "3s"}) == []


def test_workers_daskgen_starts_run_without_dasks_stack_sampling_unless_asked() -> None:
    from daskgen.client.cluster import worker_settings

    assert worker_settings() == {"distributed.worker.daemon": False, "distributed.worker.profile.enabled": False}
    with dask.config.set({"daskgen.worker-profile": True}):
        assert worker_settings() == {"distributed.worker.daemon": False}


@pytest.mark.timeout(120)
def test_worker_processes_of_a_run_start_with_the_profiler_setting(tmp_path) -> None:
    """The setting reaches the worker processes a run starts (a LocalCluster's nannies pass the client's config)."""
    from daskgen.client.cluster import connect
    from daskgen.config import RunConfig

    config = RunConfig(model="sim", store=str(tmp_path / "s.zarr"), engine="simulated", n_workers=1, progress=False)
    with connect(config) as (client, _):
        client.wait_for_workers(1)
        seen = client.run(lambda: dask.config.get("distributed.worker.profile.enabled"))
    assert list(seen.values()) == [False]


def test_a_setting_of_the_wrong_kind_or_unknown_is_refused_naming_it() -> None:
    """``check_settings`` (a run's plan calls it first) holds every set ``daskgen.*`` key against the kind of its
    shipped default, and refuses keys daskgen does not have, suggesting the closest one; the message names the
    key, what it must be, what was found and the environment variable that sets it."""
    tunables.check_settings()
    bad = {
        "health-timeout": ("soon", "a duration", "HEALTH_TIMEOUT"),
        "policy.poll-interval": ("[1]", "a duration", "POLICY__POLL_INTERVAL"),
        "abort-requeue-limit": ("ten", "a whole number", "ABORT_REQUEUE_LIMIT"),
        "worker-profile": ("yes", "true or false", "WORKER_PROFILE"),
        "prefix.min-saving": ("half", "a number", "PREFIX__MIN_SAVING"),
        "export.block-bytes": ("big", "a size", "EXPORT__BLOCK_BYTES"),
    }
    for key, (value, expected, env) in bad.items():
        with dask.config.set({f"daskgen.{key}": value}), pytest.raises(ConfigError) as info:
            tunables.check_settings()
        message = str(info.value)
        assert f"daskgen.{key} must be {expected}" in message and f"found {value!r}" in message, message
        assert f"DASK_DASKGEN__{env}" in message
    for key, value in {
        "health-timeout": 30,
        "abort-requeue-limit": 3,
        "prefix.min-saving": 1,
        "local-cpu-threads": 2,
    }.items():
        with dask.config.set({f"daskgen.{key}": value}):
            tunables.check_settings()  # a number of seconds; an int where a float goes; any value of a null default
    with (
        dask.config.set({"daskgen.health-timout": "5s"}),
        pytest.raises(ConfigError, match="did you mean daskgen.health-timeout"),
    ):
        tunables.check_settings()
    with (
        dask.config.set({"daskgen.policy.poll-intervall": "5s"}),
        pytest.raises(ConfigError, match="policy.poll-interval"),
    ):
        tunables.check_settings()
