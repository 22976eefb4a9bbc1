"""Cluster building: generated SLURM/PBS job scripts, dask config defaults, validation, and a real LocalCluster.

No batch system is needed: job scripts are rendered offline, and ``make_cluster`` for SLURM/PBS
runs against fake ``sbatch``/``qsub`` commands that record what they were asked to submit.
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path

import dask
import pytest

from daskgen.deploy import (
    CLUSTER_KEYS,
    DEPLOYMENTS,
    KINDS,
    ClusterInfo,
    LocalDeployment,
    PBSDeployment,
    SLURMDeployment,
    apply_cli_overrides,
    deployment,
    jobqueue_kwargs,
    make_cluster,
    parse_cluster_spec,
    parse_walltime,
    render_job_script,
    worker_lifetime,
)
from daskgen.deploy.keys import class_keys
from daskgen.deploy.spec import keys_table
from daskgen.errors import ConfigError
from tests.conftest import wait_for_jobs
from tests.test_scheduler_process import scheduler_pid_and  # pickled by value

ADDRESS = "tcp://10.1.2.3:8786"
SLURM = {
    "kind": "slurm",
    "nodes": 2,
    "gpus_per_node": 4,
    "cpus_per_gpu": 8,
    "memory": "480GB",
    "walltime": "04:00:00",
    "partition": "gpu",
    "account": "proj42",
    "local_directory": "$TMPDIR",
    "job_script_prologue": ["module load cuda/12.4", "source ~/miniforge3/bin/activate daskgen"],
    "job_extra_directives": ["--exclusive"],
}
PBS = {
    "kind": "pbs",
    "gpus_per_node": 4,
    "cpus_per_gpu": 8,
    "memory": "480GB",
    "walltime": "04:00:00",
    "queue": "gpuq",
    "account": "proj42",
    "job_script_prologue": "module load cuda\nconda activate daskgen\n",
}


@pytest.fixture(autouse=True)
def restore_dask_config():
    """make_cluster sets a few process-wide dask settings; give every test a clean copy back."""
    import dask_jobqueue  # noqa: F401 - its config defaults load on first import: take them into the snapshot

    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


def lines(script: str) -> list[str]:
    return [line for line in script.splitlines() if line.strip()]


def worker_command(script: str) -> list[str]:
    (cmd,) = [line for line in lines(script) if "distributed.cli.dask_worker" in line]
    return cmd.split()


def arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# --------------------------------------------------------------------------- SLURM script


def test_slurm_job_script_line_by_line():
    script = render_job_script(SLURM, ADDRESS)
    header = [line for line in lines(script) if line.startswith("#SBATCH")]
    assert header == [
        "#SBATCH -J dask-worker",
        "#SBATCH -p gpu",
        "#SBATCH -A proj42",
        "#SBATCH -n 1",
        "#SBATCH --cpus-per-task=32",  # 8 CPUs per GPU x 4 GPUs
        "#SBATCH --mem=448G",  # 480 GB in GiB, as SLURM counts
        "#SBATCH -t 04:00:00",
        "#SBATCH --exclusive",
        "#SBATCH --gres=gpu:4",
        "#SBATCH --signal=B:TERM@120",  # the exec'd `dask worker` drains its workers before walltime
    ]
    body = [line for line in lines(script) if not line.startswith("#")]
    # 4h walltime: keep 10 min free, spread retirements over 10 min -> 3h40..3h50 after start.
    assert body[:7] == [
        "unset DASKGEN_LOCAL_RANK",
        "export DASK_DISTRIBUTED__WORKER__DAEMON=False",
        "export DASKGEN_WORKERS_PER_NODE=4",
        "export DASKGEN_GPUS_PER_WORKER=1",
        "DASKGEN_WORKER_LIFETIME=$(( 13800 - (RANDOM * 32768 + RANDOM) % 601 ))",
        "module load cuda/12.4",
        "source ~/miniforge3/bin/activate daskgen",
    ]
    cmd = worker_command(script)
    assert cmd[0] == "exec", "the batch shell must become `dask worker` so that SLURM's signal reaches it"
    assert cmd[2:5] == ["-m", "distributed.cli.dask_worker", ADDRESS]
    assert arg(cmd, "--name") == "daskgen-${SLURM_JOB_ID}"
    assert arg(cmd, "--nworkers") == "4"  # one worker process per GPU
    assert arg(cmd, "--nthreads") == "4"  # partitions in flight per worker
    assert arg(cmd, "--resources") == "GPU=1"
    assert arg(cmd, "--lifetime") == "${DASKGEN_WORKER_LIFETIME}s"
    assert arg(cmd, "--local-directory") == "$TMPDIR"
    assert arg(cmd, "--memory-limit") == "111.76GiB"  # job memory split between the 4 workers
    assert "--nanny" in cmd
    assert arg(cmd, "--preload-nanny") == "daskgen.worker.nanny"  # keeps glibc's malloc defaults
    assert "--lifetime-stagger" not in cmd  # stagger is drawn once per job, in the prologue


def test_slurm_lifetime_line_is_valid_bash(tmp_path):
    script = render_job_script({**SLURM, "walltime": "01:00:00"}, ADDRESS)
    (line,) = [x for x in lines(script) if x.startswith("DASKGEN_WORKER_LIFETIME=")]
    probe = tmp_path / "probe.sh"
    probe.write_text(f"{line}\necho $DASKGEN_WORKER_LIFETIME\n")
    values = {int(os.popen(f"bash {probe}").read()) for _ in range(5)}
    assert all(3060 <= v <= 3240 for v in values)  # 1 h - 6 min margin, minus up to 3 min stagger


def test_user_gpu_directive_is_not_duplicated():
    spec = {**SLURM, "job_extra_directives": ["--gres=gpu:a100:4", "--qos=high"]}
    directives = [x for x in lines(render_job_script(spec, ADDRESS)) if x.startswith("#SBATCH --")]
    assert "#SBATCH --gres=gpu:a100:4" in directives
    assert "#SBATCH --gres=gpu:4" not in directives
    spec["job_extra_directives"] = ["--gpus-per-node=4"]
    assert "--gres" not in render_job_script(spec, ADDRESS)


def test_tensor_parallel_workers():
    cmd = worker_command(render_job_script({**SLURM, "gpus_per_worker": 2}, ADDRESS))
    assert arg(cmd, "--nworkers") == "2"
    assert arg(cmd, "--resources") == "GPU=2"
    with pytest.raises(ConfigError, match="not a multiple"):
        render_job_script({**SLURM, "gpus_per_worker": 3}, ADDRESS)


def test_single_gpu_jobs_have_one_worker_and_no_nworkers():
    script = render_job_script({**SLURM, "gpus_per_node": 1, "threads_per_worker": 3}, ADDRESS)
    cmd = worker_command(script)
    assert "--nworkers" not in cmd and arg(cmd, "--nthreads") == "3"
    assert "export DASKGEN_WORKERS_PER_NODE=1" in lines(script)
    assert "#SBATCH --cpus-per-task=8" in lines(script)


def test_cpu_only_nodes():
    spec = {"kind": "slurm", "workers_per_node": 2, "cores": 16, "memory": "64GB", "walltime": "02:00:00"}
    script = render_job_script(spec, ADDRESS)
    cmd = worker_command(script)
    assert arg(cmd, "--nworkers") == "2"
    assert "--resources" not in cmd
    assert "gres" not in script and "DASKGEN_GPUS_PER_WORKER" not in script
    assert "#SBATCH --cpus-per-task=16" in lines(script)


def test_user_lifetime_and_resources_win():
    spec = {**SLURM, "worker_extra_args": ["--lifetime", "3h", "--resources", "GPU=1,NVLINK=1"]}
    cmd = worker_command(render_job_script(spec, ADDRESS))
    assert cmd.count("--lifetime") == 1 and arg(cmd, "--lifetime") == "3h"
    assert cmd.count("--resources") == 1 and arg(cmd, "--resources") == "GPU=1,NVLINK=1"


def test_explicit_lifetime_and_lifetime_off():
    script = render_job_script({**SLURM, "lifetime": "2h", "lifetime_stagger": "5m"}, ADDRESS)
    assert "DASKGEN_WORKER_LIFETIME=$(( 7200 - (RANDOM * 32768 + RANDOM) % 301 ))" in lines(script)
    cmd = worker_command(render_job_script({**SLURM, "lifetime": "2h", "lifetime_stagger": 0}, ADDRESS))
    assert arg(cmd, "--lifetime") == "7200s"
    script = render_job_script({**SLURM, "lifetime": False}, ADDRESS)
    assert "--lifetime" not in script and "DASKGEN_WORKER_LIFETIME" not in script


def test_worker_extra_args_extend_not_replace():
    spec = {**SLURM, "interface": "ib0", "worker_extra_args": ["--death-timeout", "120"]}
    cmd = worker_command(render_job_script(spec, ADDRESS))
    assert arg(cmd, "--interface") == "ib0"
    assert "120" in cmd and arg(cmd, "--resources") == "GPU=1"


# --------------------------------------------------------------------------- PBS script


def test_pbs_job_script_line_by_line():
    script = render_job_script(PBS, ADDRESS)
    header = [line for line in lines(script) if line.startswith("#PBS")]
    assert header == [
        "#PBS -N dask-worker",
        "#PBS -q gpuq",
        "#PBS -A proj42",
        "#PBS -l select=1:ncpus=32:ngpus=4:mem=448GB",
        "#PBS -l walltime=04:00:00",
    ]
    body = [line for line in lines(script) if not line.startswith("#")]
    assert body[:7] == [
        "unset DASKGEN_LOCAL_RANK",
        "export DASK_DISTRIBUTED__WORKER__DAEMON=False",
        "export DASKGEN_WORKERS_PER_NODE=4",
        "export DASKGEN_GPUS_PER_WORKER=1",
        "DASKGEN_WORKER_LIFETIME=$(( 13800 - (RANDOM * 32768 + RANDOM) % 601 ))",
        "module load cuda",
        "conda activate daskgen",
    ]
    cmd = worker_command(script)
    assert arg(cmd, "--name") == "daskgen-${PBS_JOBID}"
    assert arg(cmd, "--nworkers") == "4" and arg(cmd, "--resources") == "GPU=1"
    assert arg(cmd, "--lifetime") == "${DASKGEN_WORKER_LIFETIME}s"


def test_pbs_resource_spec_from_user_wins():
    spec = {**PBS, "resource_spec": "select=1:ncpus=64:ngpus=4:gpu_type=a100:mem=500gb"}
    assert "#PBS -l select=1:ncpus=64:ngpus=4:gpu_type=a100:mem=500gb" in lines(render_job_script(spec, ADDRESS))


def test_pbs_bare_number_walltime_is_seconds():
    assert parse_walltime("3600", "pbs") == 3600
    assert parse_walltime("60", "slurm") == 3600


# --------------------------------------------------------------------------- dask config defaults


def test_jobqueue_config_defaults_are_honoured():
    config = {
        "jobqueue.slurm.account": "from-config",
        "jobqueue.slurm.queue": "config-partition",
        "jobqueue.slurm.memory": "200GB",
        "jobqueue.slurm.walltime": "02:00:00",
        "jobqueue.slurm.job-cpu": 48,
        "jobqueue.slurm.job-script-prologue": ["module load site-default"],
        "jobqueue.slurm.job-extra-directives": ["--constraint=a100"],
        "jobqueue.slurm.worker-extra-args": ["--no-dashboard"],
        "jobqueue.slurm.log-directory": None,
    }
    with dask.config.set(config):
        script = render_job_script(
            {"kind": "slurm", "gpus_per_node": 4, "job_script_prologue": ["conda activate x"]}, ADDRESS
        )
    got = lines(script)
    for expected in (
        "#SBATCH -A from-config",
        "#SBATCH -p config-partition",
        "#SBATCH --mem=187G",
        "#SBATCH -t 02:00:00",
        "#SBATCH --cpus-per-task=48",
        "#SBATCH --constraint=a100",
        "#SBATCH --gres=gpu:4",
    ):
        assert expected in got, expected
    # configured prologue first, then the run's own lines
    assert got.index("module load site-default") < got.index("conda activate x")
    cmd = worker_command(script)
    assert "--no-dashboard" in cmd
    assert arg(cmd, "--resources") == "GPU=1"
    # lifetime derived from the configured 2 h walltime: 2 h - 10 min margin (12 min clamped to 10)
    assert any(x.startswith("DASKGEN_WORKER_LIFETIME=$(( 6600 - ") for x in got)


def test_spec_overrides_config():
    with dask.config.set({"jobqueue.slurm.account": "from-config", "jobqueue.slurm.walltime": "02:00:00"}):
        got = lines(render_job_script(SLURM, ADDRESS))
    assert "#SBATCH -A proj42" in got and "#SBATCH -t 04:00:00" in got
    assert "#SBATCH -A from-config" not in got


def test_unset_keys_take_the_jobqueue_config():
    kwargs = jobqueue_kwargs({"kind": "slurm", "gpus_per_node": 2, "memory": "100GB"})
    for key in ("queue", "account", "local_directory", "interface"):  # unset in dask-jobqueue's defaults too
        assert key not in kwargs
    assert kwargs["job_name"] == dask.config.get("jobqueue.slurm.name")
    with dask.config.set({"jobqueue.slurm.account": "site", "jobqueue.slurm.interface": "ib0"}):
        configured = jobqueue_kwargs({"kind": "slurm", "memory": "4GB"})
    assert (configured["account"], configured["interface"]) == ("site", "ib0")
    assert kwargs["walltime"] == dask.config.get("jobqueue.slurm.walltime")  # also sets the workers' lifetime
    assert kwargs["processes"] == 2 and kwargs["cores"] == 8
    # the python is jobqueue's (config, else this interpreter), exec'd so the batch shell's signal reaches it
    import sys

    assert kwargs["python"] == f"exec {sys.executable}"
    with dask.config.set({"jobqueue.slurm.python": "/opt/env/bin/python"}):
        assert jobqueue_kwargs({"kind": "slurm", "memory": "4GB"})["python"] == "exec /opt/env/bin/python"
    assert "python" not in jobqueue_kwargs({"kind": "pbs", "memory": "4GB"})


def test_lifetime_from_dask_jobqueue_default_walltime_in_a_fresh_process():
    # dask-jobqueue's own defaults (walltime 00:30:00) exist only once it is imported.
    import subprocess
    import sys

    code = (
        "from daskgen.deploy import jobqueue_kwargs; "
        "print(jobqueue_kwargs({'kind': 'slurm', 'gpus_per_node': 4, 'memory': '100GB'})['worker_extra_args'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert "'--lifetime'" in out.stdout


def test_memory_is_required():
    with pytest.raises(ConfigError, match="cluster.memory is required"):
        render_job_script({"kind": "slurm", "gpus_per_node": 4}, ADDRESS)


# --------------------------------------------------------------------------- validation


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        parse_cluster_spec({"kind": "slurm", "gpus_per_nodes": 4})
    msg = str(err.value)
    assert "gpus_per_nodes" in msg
    for key in CLUSTER_KEYS:
        assert f"  {key}:" in msg


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"kind": "sge"}, "kind must be one of"),
        ({"kind": "slurm", "gpus_per_node": "4"}, "gpus_per_node must be an integer"),
        ({"kind": "slurm", "nodes": 0}, "nodes must be an integer >= 1"),
        ({"kind": "slurm", "walltime": 1800}, "quote it in YAML"),
        ({"kind": "slurm", "job_extra_directives": [1]}, "list of strings"),
        ({"kind": "slurm", "lifetime": "soon"}, "duration"),
        ({"kind": "slurm", "queue": "a", "partition": "b"}, "differ"),
        ({"kind": "slurm", "cores": 8, "cpus_per_gpu": 2}, "not both"),
    ],
)
def test_invalid_values(spec, match):
    with pytest.raises(ConfigError, match=match):
        parse_cluster_spec(spec)


def test_keys_of_other_kinds_are_accepted_and_reported():
    spec = parse_cluster_spec({**SLURM, "kind": "local"})
    assert spec.kind == "local" and spec.get("walltime") == "04:00:00"


@pytest.mark.parametrize(
    ("text", "kind", "seconds"),
    [
        ("04:00:00", "slurm", 14400),
        ("30:00", "slurm", 1800),
        ("1-12", "slurm", 129600),
        ("2-00:30", "slurm", 174600),
        ("1-00:00:10", "slurm", 86410),
        ("48:00:00", "pbs", 172800),
    ],
)
def test_parse_walltime(text, kind, seconds):
    assert parse_walltime(text, kind) == seconds


def test_parse_walltime_rejects_garbage():
    with pytest.raises(ConfigError):
        parse_walltime("4h", "slurm")
    with pytest.raises(ConfigError):
        parse_walltime("1-00:00:00", "pbs")


def test_worker_lifetime_defaults():
    assert worker_lifetime(3600) == (3240, 180)  # retire 51-54 min into a 1 h job
    assert worker_lifetime(24 * 3600) == (85800, 600)
    assert worker_lifetime(600) == (480, 60)
    with pytest.raises(ConfigError, match="too short"):
        worker_lifetime(200)


def test_cli_overrides():
    merged = apply_cli_overrides({"kind": "slurm", "max_workers": 4}, kind="pbs", max_workers=16)
    assert merged == {"kind": "pbs", "max_workers": 16}
    assert apply_cli_overrides(None) == {}


def test_in_flight_window():
    info = ClusterInfo("slurm", 4, 3, 1, 0, 16, True)
    assert info.in_flight_window == 48
    assert "adaptive 0..16 workers" in str(info)


# --------------------------------------------------------------------------- one deployment class per kind


SHARED_KEYS = {
    "dashboard_address", "gpus_per_worker", "local_directory", "max_workers", "min_workers",
    "scheduler_process", "threads_per_worker", "tls",
}  # fmt: skip
BATCH_KEYS = SHARED_KEYS | {
    "account", "cores", "cpus_per_gpu", "gpus_per_node", "interface", "job_directives_skip",
    "job_extra_directives", "job_name", "job_script_prologue", "lifetime", "lifetime_margin", "lifetime_stagger",
    "log_directory", "memory", "nodes", "python", "queue", "tls_directory", "walltime", "worker_extra_args",
    "workers_per_node",
}  # fmt: skip
#: The documented ``cluster:`` keys of each kind: a key added to or dropped from a class fails here first.
KEYS_BY_KIND = {
    "local": SHARED_KEYS | {"memory_limit", "n_workers", "preprocess_workers"},
    "slurm": BATCH_KEYS | {"partition"},
    "pbs": BATCH_KEYS | {"resource_spec"},
}


@pytest.mark.parametrize("kind", KINDS)
def test_the_keys_of_a_kind_are_its_class_signature(kind):
    cls = DEPLOYMENTS[kind]
    assert set(class_keys(cls)) == KEYS_BY_KIND[kind] and cls.kind == kind
    assert {key for key, spec in CLUSTER_KEYS.items() if kind in spec.kinds} == KEYS_BY_KIND[kind] | {"kind"}
    assert all(key.help for key in class_keys(cls).values())


def test_a_key_without_help_is_refused():
    class Bare:
        def __init__(self, *, size: int = 1) -> None:
            pass

    with pytest.raises(TypeError, match="document 'size' in the docstring"):
        class_keys(Bare)


def test_types_and_defaults_come_from_the_signatures():
    assert (CLUSTER_KEYS["nodes"].default, CLUSTER_KEYS["nodes"].type_name()) == (1, "integer >= 1")
    assert CLUSTER_KEYS["job_script_prologue"].is_list
    assert CLUSTER_KEYS["tls"].type_name() == "true/false"
    assert CLUSTER_KEYS["partition"].kinds == ("slurm",) and CLUSTER_KEYS["resource_spec"].kinds == ("pbs",)
    assert CLUSTER_KEYS["workers_per_node"].jobqueue == ("processes",)


def test_the_docs_table_is_the_one_generated_from_the_signatures():
    docs = (Path(__file__).parents[1] / "docs" / "hpc.md").read_text()
    assert keys_table() in docs, "docs/hpc.md: paste the output of daskgen.deploy.spec.keys_table()"


def test_batch_classes_name_their_system_in_class_attributes():
    assert (SLURMDeployment.submit_command, SLURMDeployment.job_id_variable) == ("sbatch", "SLURM_JOB_ID")
    assert (PBSDeployment.submit_command, PBSDeployment.job_id_variable) == ("qsub", "PBS_JOBID")
    assert SLURMDeployment(memory="4GB").cluster_base().__name__ == "SLURMCluster"
    assert PBSDeployment(memory="4GB").cluster_base().__name__ == "PBSCluster"


def test_keywords_fall_back_to_the_jobqueue_config():
    config = {
        "jobqueue.slurm.memory": "200GB",
        "jobqueue.slurm.walltime": "02:00:00",
        "jobqueue.slurm.job-script-prologue": ["module load site-default"],
        "jobqueue.pbs.resource-spec": "select=1:ncpus=4",
    }
    with dask.config.set(config):
        slurm = SLURMDeployment(gpus_per_node=2, job_script_prologue=["conda activate x"])
        assert (slurm.memory, slurm.walltime) == ("200GB", "02:00:00")
        assert slurm.job_script_prologue == ["module load site-default", "conda activate x"]  # extended
        assert slurm.lifetime == worker_lifetime(7200)  # from the configured walltime
        given = SLURMDeployment(memory="8GB", walltime="01:00:00", partition="gpu")
        assert (given.memory, given.walltime, given.jobqueue_kwargs()["queue"]) == ("8GB", "01:00:00", "gpu")
        assert PBSDeployment(memory="4GB").jobqueue_kwargs()["resource_spec"] == "select=1:ncpus=4"
    with pytest.raises(ConfigError, match="differ"):
        SLURMDeployment(memory="4GB", queue="a", partition="b")


def test_deployment_builds_the_class_of_the_kind_from_its_keys_only(monkeypatch):
    monkeypatch.setenv("TMPDIR", "/scratch")  # SLURM's local_directory, expanded by a local deployment
    built = deployment({**SLURM, "kind": "pbs", "partition": None, "resource_spec": "select=1:ncpus=8"})
    assert isinstance(built, PBSDeployment) and built.resource_spec == "select=1:ncpus=8"
    local = deployment({**SLURM, "kind": "local", "n_workers": 2})
    assert isinstance(local, LocalDeployment) and local.n_workers == 2
    with pytest.raises(ConfigError, match="for kind slurm or pbs, not local"):
        jobqueue_kwargs({"kind": "local"})


def test_a_missing_submit_command_is_a_clear_error_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch here
    with pytest.raises(ConfigError, match="submits jobs with sbatch, which is not on PATH"):
        make_cluster({**SLURM, "tls_directory": str(tmp_path / "tls")})
    assert not (tmp_path / "tls").exists()  # no certificate written, no scheduler started


# --------------------------------------------------------------------------- make_cluster with a fake batch system


@pytest.mark.timeout(60)
def test_make_cluster_slurm_submits_one_job_per_node(fake_batch):
    cluster, info = make_cluster({**SLURM, "dashboard_address": ":0"})
    try:
        assert (info.kind, info.workers_per_node, info.min_workers, info.max_workers) == ("slurm", 4, 8, 8)
        assert not info.adaptive and "retire" in str(info)
        scripts = wait_for_jobs(fake_batch, 2)
        names = sorted(arg(worker_command(s), "--name") for s in scripts)
        assert names == ["SLURMCluster-0", "SLURMCluster-1"]  # workers become SLURMCluster-<job>-<gpu>
        assert cluster.scheduler_address.startswith("tls://") and "TLS with a per-run certificate" in str(info)
        (run_dir,) = (fake_batch.parent / "tls").iterdir()  # private per-run folder: cert.pem, key.pem
        for script in scripts:
            assert "#SBATCH --gres=gpu:4" in lines(script)
            cmd = worker_command(script)
            assert arg(cmd, "--nworkers") == "4"
            assert cmd[4] == cluster.scheduler_address
            assert arg(cmd, "--protocol") == "tls://"
            assert (arg(cmd, "--tls-ca-file"), arg(cmd, "--tls-cert"), arg(cmd, "--tls-key")) == (
                str(run_dir / "cert.pem"),
                str(run_dir / "cert.pem"),
                str(run_dir / "key.pem"),
            )
        durations = dask.config.get("distributed.scheduler.default-task-durations")
        assert durations["daskgen-partition"] == "60s"
        # batch clusters run the scheduler in a process of its own (TLS from the run's files), with this config
        assert f"scheduler in process {cluster.scheduler.process.pid}" in str(info)
        from distributed import Client

        with Client(cluster, timeout="20s") as client:
            key = "distributed.scheduler.default-task-durations"
            pid, on_scheduler = client.run_on_scheduler(scheduler_pid_and, key)
        assert pid != os.getpid() and on_scheduler["daskgen-partition"] == "60s"
    finally:
        cluster.close()
    assert not run_dir.exists()  # the certificate is removed with the cluster


@pytest.mark.timeout(60)
def test_make_cluster_insecure_warns_and_has_no_tls(fake_batch, caplog):
    with caplog.at_level("WARNING", logger="daskgen.deploy.security"):
        cluster, info = make_cluster({**SLURM, "nodes": 1, "tls": False, "dashboard_address": ":0"})
    try:
        assert "anyone who can reach its scheduler" in caplog.text and "TLS off" in str(info)
        assert cluster.scheduler_address.startswith("tcp://")
        (script,) = wait_for_jobs(fake_batch, 1)
        assert not any(flag.startswith(("--tls", "--protocol")) for flag in worker_command(script))
        assert not (fake_batch.parent / "tls").exists()
    finally:
        cluster.close()


@pytest.mark.timeout(60)
def test_make_cluster_pbs_adaptive(fake_batch):
    cluster, info = make_cluster({**PBS, "min_workers": 4, "max_workers": 12, "dashboard_address": ":0"})
    try:
        assert info.adaptive and (info.min_workers, info.max_workers) == (4, 12)
        (script,) = wait_for_jobs(fake_batch, 1)  # the minimum: one 4-GPU job
        assert "#PBS -l select=1:ncpus=32:ngpus=4:mem=448GB" in lines(script)
    finally:
        cluster.close()


# --------------------------------------------------------------------------- real clusters


def _start_child_process() -> tuple[bool, int | None]:
    """Runs on a worker: an engine-like subprocess start, impossible in a daemonic process."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.01,))
    child.start()
    child.join(10)
    return multiprocessing.current_process().daemon, child.exitcode


def _worker_env() -> dict[str, str | None]:
    return {k: os.environ.get(k) for k in ("DASKGEN_WORKERS_PER_NODE", "OMP_NUM_THREADS")}


@pytest.mark.timeout(60)
def test_local_cluster_workers_can_start_subprocesses():
    from distributed import Client

    with dask.config.set({"daskgen.local-cpu-threads": None}):  # the default (the test session sets 1)
        cluster, info = make_cluster({"kind": "local", "n_workers": 1, "threads_per_worker": 2})
    try:
        assert (info.kind, info.max_workers, info.threads_per_worker) == ("local", 1, 2)
        with Client(cluster) as client:
            assert client.submit(_start_child_process, pure=False).result(timeout=30) == (False, 0)
            (nthreads,) = client.nthreads().values()
            assert nthreads == 2
            (env,) = client.run(_worker_env).values()
            assert env["DASKGEN_WORKERS_PER_NODE"] == "1"
            assert int(env["OMP_NUM_THREADS"]) == max(1, os.cpu_count() or 1)
    finally:
        cluster.close()


def test_local_cpu_threads_share_the_cores_unless_the_tunable_sets_them():
    from daskgen.deploy.local import cpu_threads_per_worker

    cores = os.cpu_count() or 1
    with dask.config.set({"daskgen.local-cpu-threads": None}):
        assert [cpu_threads_per_worker(n) for n in (1, 2, cores + 1)] == [cores, max(1, cores // 2), 1]
    with dask.config.set({"daskgen.local-cpu-threads": 3}):
        assert cpu_threads_per_worker(1) == cpu_threads_per_worker(4) == 3
        kwargs = LocalDeployment(n_workers=2).cluster_kwargs()
        assert kwargs["env"]["OMP_NUM_THREADS"] == kwargs["env"]["MKL_NUM_THREADS"] == "3"


@pytest.mark.timeout(60)
def test_local_cluster_adaptive_and_ignored_keys(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # SLURM's local_directory, $TMPDIR, is this folder here
    cluster, info = make_cluster({**SLURM, "kind": "local", "min_workers": 0, "max_workers": 2})
    try:
        assert info.adaptive and info.max_workers == 2
        assert "ignored for kind local" in str(info) and "walltime" in str(info)
        assert cluster.new_spec["options"]["local_directory"] == str(tmp_path)
    finally:
        cluster.close()


def test_a_local_clusters_folder_expands_variables_and_names_an_unset_one(tmp_path, monkeypatch):
    """``local_directory: $TMPDIR`` is the folder a job's shell would give, never a folder named ``$TMPDIR``."""
    monkeypatch.setenv("DASKGEN_TEST_SCRATCH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cases = {
        "$DASKGEN_TEST_SCRATCH/w": tmp_path / "w",
        "${DASKGEN_TEST_SCRATCH}": tmp_path,
        "~/scratch": tmp_path / "home" / "scratch",
        "/plain/path": Path("/plain/path"),
    }
    for given, folder in cases.items():
        assert LocalDeployment(local_directory=given).options["local_directory"] == str(folder), given
    assert LocalDeployment().options["local_directory"] is None  # Dask's default
    monkeypatch.delenv("DASKGEN_UNSET_SCRATCH", raising=False)
    with pytest.raises(
        ConfigError, match=r"'\$DASKGEN_UNSET_SCRATCH/x': the environment variable DASKGEN_UNSET_SCRATCH is not set"
    ):
        LocalDeployment(local_directory="$DASKGEN_UNSET_SCRATCH/x")


def wait_until(predicate, what: str, timeout: float = 180.0):
    """Poll ``predicate`` (a look at real cluster state) until it returns something truthy; generous timeout."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.1)
    return value


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multi_worker_jobs_are_replaced_once_all_their_workers_left():
    """A job of 2 worker processes ends (its workers retire) and the cluster submits a replacement job.

    Uses dask-jobqueue's LocalCluster (jobs are local processes) with daskgen's job reaper; plain
    dask-jobqueue never replaces such a job because no worker carries the job's name.  The job's end is
    triggered once both of its workers have joined, as a worker lifetime would end it.
    """
    from dask_jobqueue.local import LocalCluster as JobQueueLocalCluster
    from distributed import Client

    from daskgen.deploy import JobReaperMixin, job_of_worker

    cls = type("LocalJobsCluster", (JobReaperMixin, JobQueueLocalCluster), {})
    with dask.config.set({"distributed.deploy.lost-worker-timeout": "0.5s"}):
        cluster = cls(cores=2, processes=2, memory="1GB", scheduler_options={"dashboard_address": ":0"})
        try:
            cluster.adapt(minimum=2, maximum=2, interval="200ms", worker_key=job_of_worker)
            with Client(cluster) as client:

                def workers() -> dict:
                    return client.scheduler_info(n_workers=-1)["workers"]

                first = wait_until(lambda: len(workers()) >= 2 and dict(workers()), "the first job's 2 workers")
                assert len({str(w["name"]).rsplit("-", 1)[0] for w in first.values()}) == 1  # one job
                client.retire_workers(list(first))  # the whole job leaves, as at the end of its lifetime
                wait_until(lambda: len(set(workers()) - set(first)) >= 2, "2 workers of a replacement job")
        finally:
            cluster.close()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_workers_join_and_retire_mid_run_without_losing_prompts(tmp_path):
    """Elasticity on a LocalCluster from make_cluster: a worker joins mid-run (and gets the engine
    plugin), the original worker retires, and every prompt still ends up done exactly as asked."""
    import threading

    from distributed import Client

    from daskgen.client.runner import run
    from daskgen.config import RunConfig
    from daskgen.worker.plugin import plugin_status
    from tests.conftest import write_prompts

    log = tmp_path / "calls.log"
    config = RunConfig(
        prompts=str(write_prompts(tmp_path / "p.jsonl", 120)),
        model="sim",
        store=str(tmp_path / "out.zarr"),
        engine="daskgen.testing.engines:RecordingEngine",
        max_new_tokens=16,
        max_prompt_tokens=128,
        engine_args={
            "inner": "simulated",
            "log_path": str(log),
            "time_scale": 1.0,
            "length_dist": "fixed",
            "length_mean": 16,
        },
        partition_size=2,
        window=3,  # three partitions in flight per worker: most wait, some for the worker that joins
        progress=False,
    )
    cluster, _ = make_cluster({"kind": "local", "n_workers": 1, "threads_per_worker": 3})
    try:
        config.scheduler_address = cluster.scheduler_address
        with Client(cluster) as client:
            (first,) = client.scheduler_info()["workers"]
            outcome: dict = {}
            runner = threading.Thread(target=lambda: outcome.update(summary=run(config)), daemon=True)
            runner.start()
            wait_until(lambda: log.exists() and log.read_text().count("\n") >= 4, "the first generate calls")
            cluster.scale(2)  # a worker joins mid-run ...
            (second,) = wait_until(lambda: set(client.scheduler_info()["workers"]) - {first}, "a second worker")

            def second_ready() -> bool:
                return client.run(plugin_status, workers=[second])[second]["state"] == "ready"

            wait_until(second_ready, "a ready engine on the late worker")
            client.retire_workers([first])  # ... and the first one leaves
            retired_while_running = runner.is_alive()
            runner.join(300)
    finally:
        cluster.close()
    summary = outcome["summary"]
    assert retired_while_running, "the run ended before the cluster changed; make it longer"
    assert (summary.done, summary.failed, summary.pending) == (120, 0, 0)
    pids = {line.split()[1] for line in log.read_text().splitlines()}
    assert len(pids) == 2  # both workers generated


@pytest.mark.timeout(180)
def test_nanny_preload_keeps_glibc_malloc_defaults_in_a_real_worker(monkeypatch):
    """A real nanny started with the preload spawns a worker without ``MALLOC_TRIM_THRESHOLD_``
    (Dask's default exports it) and with the rest of ``pre-spawn-environ``."""
    import asyncio

    # A nanny started in a process exports Dask's pre-spawn variables into that process's os.environ (an earlier
    # test's in-process cluster may have): the workers spawned here would inherit the variable from this process,
    # which is not what the nanny exports.  A `dask worker` command starts from its own environment.
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)

    from distributed import Client, Nanny, Scheduler

    def env() -> tuple[str | None, str | None]:
        return os.environ.get("MALLOC_TRIM_THRESHOLD_"), os.environ.get("OMP_NUM_THREADS")

    async def main() -> dict:
        async with Scheduler(dashboard_address=":0") as scheduler:
            address = scheduler.address
            async with (
                Nanny(address, nthreads=1, preload_nanny=["daskgen.worker.nanny"]),
                Nanny(address, nthreads=1) as plain,
                Client(address, asynchronous=True) as client,
            ):
                await client.wait_for_workers(2)
                found = await client.run(env)
                return {addr: (v, addr == plain.worker_address) for addr, v in found.items()}

    dask_default = {"MALLOC_TRIM_THRESHOLD_": 65536, "OMP_NUM_THREADS": 1}  # local runs change it process-wide
    with dask.config.set({"distributed.nanny.pre-spawn-environ": dask_default}):
        found = asyncio.run(asyncio.wait_for(main(), 120))
    by_kind = {"plain" if plain else "preloaded": v for v, plain in found.values()}
    assert by_kind == {"plain": ("65536", "1"), "preloaded": (None, "1")}, found
