"""GPU pinning of one Dask worker per GPU, with fake CUDA_VISIBLE_DEVICES layouts (no GPU needed)."""

from __future__ import annotations

import os
import stat

import pytest

from daskgen.errors import ConfigError
from daskgen.worker.gpu import (
    ENV_GPUS_PER_WORKER,
    ENV_LOCAL_RANK,
    ENV_ORIGINAL_DEVICES,
    ENV_PINNED_DEVICES,
    ENV_WORKERS_PER_NODE,
    GpuPinningError,
    choose_gpu,
    count_visible_gpus,
    export_local_rank,
    local_rank_from_name,
    parse_visible_devices,
    pin_gpu,
    pin_worker_gpu,
)

UUIDS = "GPU-1a2b3c4d-0000-0000-0000-000000000000,GPU-5e6f7a8b-1111-1111-1111-111111111111"


@pytest.fixture
def no_nvidia_smi(monkeypatch, tmp_path):
    """A PATH without nvidia-smi."""
    monkeypatch.setenv("PATH", str(tmp_path))


@pytest.fixture
def fake_nvidia_smi(monkeypatch, tmp_path):
    """An nvidia-smi on PATH that lists 4 GPUs (and one MIG line that must not count)."""
    script = tmp_path / "nvidia-smi"
    lines = [f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd)" for i in range(4)]
    lines.insert(1, "  MIG 1g.10gb     Device  0: (UUID: MIG-00000000-1111-2222-3333-444444444444)")
    script.write_text("#!/bin/sh\ncat <<'EOF'\n" + "\n".join(lines) + "\nEOF\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", ()),
        ("0,1,2,3", ("0", "1", "2", "3")),
        (" 2, 3 ", ("2", "3")),
        (UUIDS, tuple(UUIDS.split(","))),
        ("MIG-abc", ("MIG-abc",)),
        ("-1", ()),
        ("0,1,-1,2", ("0", "1")),
        ("NoDevFiles", ()),
    ],
)
def test_parse_visible_devices(value, expected):
    assert parse_visible_devices(value) == expected


@pytest.mark.parametrize(
    ("name", "rank"),
    [
        ("SLURMCluster-3-1", 1),
        ("PBSCluster-12-0", 0),
        ("daskgen-4711.pbs01-3", 3),
        (2, 2),
        ("2", 2),
        ("tcp://10.0.0.1:40000", None),
        ("worker-a", None),
    ],
)
def test_local_rank_from_name(name, rank):
    assert local_rank_from_name(name) == rank


@pytest.mark.parametrize("rank", range(4))
def test_one_worker_per_gpu_from_name_suffix(rank):
    a = choose_gpu(f"SLURMCluster-7-{rank}", "0,1,2,3", workers_per_node=4)
    assert a.devices == str(rank)
    assert a.local_rank == rank
    assert a.visible == ("0", "1", "2", "3")


def test_slurm_renumbered_devices_are_taken_by_position():
    # SLURM may hand a job GPUs 4-7 of the node: worker 1 gets the second entry, "5".
    assert choose_gpu("SLURMCluster-0-1", "4,5,6,7").devices == "5"


def test_uuid_layout_is_kept_verbatim():
    a = choose_gpu("X-0-1", UUIDS)
    assert a.devices == UUIDS.split(",")[1]
    assert "local rank 1" in a.describe()


def test_unset_uses_physical_gpu_count():
    a = choose_gpu("X-0-2", None, physical_gpus=4)
    assert a.devices == "2"
    assert "nvidia-smi" in a.reason


@pytest.mark.parametrize("value", [None, "", "-1"])
def test_no_gpu_is_a_noop(value):
    a = choose_gpu("X-0-3", value, physical_gpus=0)
    assert a.devices is None
    assert a.local_rank is None
    assert "nothing to do" in a.describe()


def test_too_few_gpus_names_the_worker_and_the_devices():
    with pytest.raises(GpuPinningError) as err:
        choose_gpu("SLURMCluster-0-2", "0,1")
    msg = str(err.value)
    assert "'SLURMCluster-0-2'" in msg and "local rank 2" in msg and "0,1" in msg
    assert isinstance(err.value, ConfigError)


def test_node_capacity_checked_for_every_worker():
    # 4 workers on a 2-GPU allocation: even rank 0 fails, so the misconfiguration is seen at once.
    with pytest.raises(GpuPinningError, match="4 workers per node .* need 4 GPUs, but only 2"):
        choose_gpu("SLURMCluster-0-0", "0,1", workers_per_node=4)


def test_single_worker_job_ignores_the_job_number_in_its_name():
    # dask-jobqueue with processes=1 names the worker after the job: "SLURMCluster-5" is job 5, rank 0.
    assert choose_gpu("SLURMCluster-5", "0", workers_per_node=1).devices == "0"
    with pytest.raises(GpuPinningError):
        choose_gpu("SLURMCluster-5", "0,1")


def test_explicit_rank_wins_over_name():
    assert choose_gpu("SLURMCluster-0-0", "0,1,2,3", local_rank=3).devices == "3"


def test_nameless_worker_needs_a_rank_unless_one_share_is_visible():
    assert choose_gpu("tcp://10.0.0.1:4000", "GPU-x").devices == "GPU-x"
    with pytest.raises(GpuPinningError, match="DASKGEN_LOCAL_RANK"):
        choose_gpu("tcp://10.0.0.1:4000", "0,1")


def test_gpus_per_worker_slices_contiguous_groups():
    assert choose_gpu("J-0-1", "0,1,2,3,4,5,6,7", gpus_per_worker=4).devices == "4,5,6,7"
    assert choose_gpu("J-0-0", "0,1,2,3", gpus_per_worker=2, workers_per_node=2).devices == "0,1"
    with pytest.raises(GpuPinningError, match="needs GPU\\(s\\) 4..5"):
        choose_gpu("J-0-2", "0,1,2,3", gpus_per_worker=2)


def test_pin_gpu_reads_and_writes_the_environment(no_nvidia_smi):
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", ENV_WORKERS_PER_NODE: "4"}
    a = pin_gpu("SLURMCluster-0-2", environ=env)
    assert a.devices == "2"
    assert env["CUDA_VISIBLE_DEVICES"] == "2"
    assert env[ENV_ORIGINAL_DEVICES] == "0,1,2,3"


def test_pin_gpu_is_idempotent(no_nvidia_smi):
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    pin_gpu("W-0-3", environ=env)
    again = pin_gpu("W-0-3", environ=env)  # plugin re-registered in the same worker process
    assert again.devices == "3" and env["CUDA_VISIBLE_DEVICES"] == "3"


def test_pin_gpu_env_rank_and_gpus_per_worker(no_nvidia_smi):
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", ENV_LOCAL_RANK: "1", ENV_GPUS_PER_WORKER: "2"}
    assert pin_gpu("anything", environ=env).devices == "2,3"


def test_pin_gpu_bad_env_value(no_nvidia_smi):
    with pytest.raises(GpuPinningError, match="DASKGEN_WORKERS_PER_NODE must be an integer"):
        pin_gpu("W-0-0", environ={"CUDA_VISIBLE_DEVICES": "0", ENV_WORKERS_PER_NODE: "four"})


def test_pin_gpu_without_gpus_leaves_env_alone(no_nvidia_smi):
    env: dict[str, str] = {}
    assert pin_gpu("W-0-0", environ=env).devices is None
    assert env == {}


def test_pin_gpu_unset_devices_uses_nvidia_smi(fake_nvidia_smi):
    env: dict[str, str] = {ENV_WORKERS_PER_NODE: "4"}
    assert pin_gpu("W-0-3", environ=env).devices == "3"
    assert env[ENV_ORIGINAL_DEVICES] == "<unset>"
    assert pin_gpu("W-0-3", environ=env).devices == "3"


def test_stale_markers_from_the_submitting_shell_are_ignored(no_nvidia_smi):
    # sbatch copies the client's environment: markers from an earlier pinning must not win
    # over the CUDA_VISIBLE_DEVICES the batch system gave this job.
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2,3", ENV_ORIGINAL_DEVICES: "0,1", ENV_PINNED_DEVICES: "1"}
    assert pin_gpu("SLURMCluster-0-3", environ=env).devices == "3"
    assert env[ENV_ORIGINAL_DEVICES] == "0,1,2,3"


@pytest.fixture
def clean_os_environ():
    """pin_worker_gpu writes os.environ: restore it exactly (variables it adds included)."""
    saved = dict(os.environ)
    for key in (ENV_ORIGINAL_DEVICES, ENV_PINNED_DEVICES, ENV_LOCAL_RANK, ENV_WORKERS_PER_NODE):
        os.environ.pop(key, None)
    yield
    os.environ.clear()
    os.environ.update(saved)


def test_pin_worker_gpu_uses_os_environ(no_nvidia_smi, clean_os_environ):
    os.environ["CUDA_VISIBLE_DEVICES"] = "0,1"
    assert pin_worker_gpu("SLURMCluster-1-1") == "1"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_count_visible_gpus(fake_nvidia_smi):
    assert count_visible_gpus({}) == 4  # unset: physical GPUs, MIG line not counted
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": "1,3"}) == 2  # nvidia-smi ignores this variable
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_count_visible_gpus_without_nvidia_smi(no_nvidia_smi):
    assert count_visible_gpus({}) == 0
    assert count_visible_gpus({"CUDA_VISIBLE_DEVICES": UUIDS}) == 2


def test_export_local_rank_sets_the_rank_the_name_gives():
    env = {"DASKGEN_WORKERS_PER_NODE": "2", "DASKGEN_LOCAL_RANK": ""}
    assert export_local_rank("job-1", env) == 1 and env["DASKGEN_RESOLVED_LOCAL_RANK"] == "1"
    assert env["DASKGEN_LOCAL_RANK"] == ""  # not an explicit rank for another worker of the same process
    assert export_local_rank("job-0", env) == 0 and env["DASKGEN_RESOLVED_LOCAL_RANK"] == "0"
    assert export_local_rank("job-0", {**env, "DASKGEN_LOCAL_RANK": "3"}) == 3  # an explicit rank wins
    assert export_local_rank("tcp://10.0.0.1:4000", {"DASKGEN_WORKERS_PER_NODE": "1"}) == 0
    nameless = {"DASKGEN_RESOLVED_LOCAL_RANK": "1"}
    assert export_local_rank("tcp://10.0.0.1:4000", nameless) is None and nameless == {}
