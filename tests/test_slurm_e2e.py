"""End to end through a real SLURM (``.ci/slurm-setup.sh``: slurmctld + slurmd on loopback, 4 fake GPUs).

Every cluster here uses TLS with a per-run certificate (daskgen's default for SLURM): the worker
jobs read it from files in the test's folder.
``make_cluster`` submits daskgen worker jobs with ``sbatch`` through dask-jobqueue; the workers
join, pin one (fake) GPU each from SLURM's ``CUDA_VISIBLE_DEVICES``, run tasks that start
subprocesses, and a job that reaches its lifetime is replaced by a new SLURM job.
Without a usable SLURM node (no ``sinfo``/``sbatch``, or no node ``idle``/``mix``/``alloc``) these
tests skip on a developer machine and **fail** under ``CI=true`` (``.ci/slurm-setup.sh`` already
refuses to hand CI a node that is down, drained or not responding).
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
import sys
import time

import dask
import pytest

pytestmark = pytest.mark.slow


@functools.cache
def _slurm_problem() -> str | None:
    """Why SLURM cannot run these tests here, or None when a node is usable."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return "sinfo/sbatch not found"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%n %t"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"sinfo failed: {exc}"
    if out.returncode != 0:
        return f"sinfo exited with {out.returncode}: {out.stderr.strip()}"
    if not any(line.split()[-1] in ("idle", "mix", "alloc") for line in out.stdout.splitlines() if line.strip()):
        return f"no SLURM node is idle, mix or alloc (node states: {out.stdout.strip() or 'none'})"
    return None


@pytest.fixture(autouse=True)
def slurm_available():
    """Skip on a developer machine without SLURM; fail in CI (``CI=true``), where SLURM must be up."""
    problem = _slurm_problem()
    if problem is None:
        return
    message = f"needs a running SLURM (run .ci/slurm-setup.sh as root): {problem}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true: {message}", pytrace=False)
    pytest.skip(message)


@pytest.fixture(autouse=True)
def restore_dask_config():
    import dask_jobqueue  # noqa: F401 - its config defaults load on first import: take them into the snapshot

    saved = copy.deepcopy(dask.config.config)
    yield
    dask.config.config.clear()
    dask.config.config.update(saved)


def _spec(tmp_path, **extra):
    return {
        "kind": "slurm",
        "gpus_per_node": 4,
        "cores": 2,  # this test node has 2 CPUs; 4 workers share them
        "memory": "4GB",
        "walltime": "00:10:00",
        "threads_per_worker": 1,
        "dashboard_address": ":0",
        "log_directory": str(tmp_path / "logs"),
        "python": sys.executable,
        "tls_directory": str(tmp_path / "tls"),  # TLS is on by default: the per-run certificate goes here
        **extra,
    }


@pytest.mark.timeout(240)
def test_slurm_job_runs_one_pinned_worker_per_gpu(tmp_path, monkeypatch):
    # sbatch exports this process's environment to the job; a LocalCluster started earlier in this
    # process (other tests) left Dask's pre-spawn variables in it (distributed sets them in the parent).
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    from distributed import Client

    from daskgen.deploy import make_cluster

    def pin(dask_worker):
        import multiprocessing
        import os

        from daskgen.worker.gpu import pin_worker_gpu

        devices = pin_worker_gpu(dask_worker.name)
        return {
            "devices": devices,
            "job": os.environ.get("SLURM_JOB_ID"),
            "daemon": multiprocessing.current_process().daemon,
            "workers_per_node": os.environ.get("DASKGEN_WORKERS_PER_NODE"),
            "malloc_trim": os.environ.get("MALLOC_TRIM_THRESHOLD_"),
            "omp": os.environ.get("OMP_NUM_THREADS"),
        }

    def start_child():
        import multiprocessing
        import time

        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0.01,))
        child.start()
        child.join(10)
        return child.exitcode

    cluster, info = make_cluster(_spec(tmp_path))
    try:
        assert info.workers_per_node == 4
        assert cluster.scheduler_address.startswith("tls://")
        with Client(cluster) as client:
            client.wait_for_workers(4, timeout=180)
            assert all(a.startswith("tls://") for a in client.scheduler_info(n_workers=-1)["workers"])
            from distributed.security import Security

            with pytest.raises(OSError, match="TLS certificate does not match"):  # another run's certificate
                Client(cluster.scheduler_address, security=Security.temporary(), timeout="10s", set_as_default=False)
            with pytest.raises(OSError):  # plain TCP
                Client(cluster.scheduler_address.replace("tls://", "tcp://"), timeout="10s", set_as_default=False)
            workers = client.scheduler_info(n_workers=-1)["workers"].values()
            assert sorted(str(w["name"]) for w in workers) == [f"SLURMCluster-0-{i}" for i in range(4)]
            assert all(w["resources"] == {"GPU": 1} for w in workers)
            assert all(w["nthreads"] == 1 for w in workers)
            pinned = client.run(pin)
            assert sorted(p["devices"] for p in pinned.values()) == ["0", "1", "2", "3"]
            assert len({p["job"] for p in pinned.values()}) == 1  # one SLURM job holds all 4 workers
            assert all(p["daemon"] is False and p["workers_per_node"] == "4" for p in pinned.values())
            # the nanny preload dropped Dask's malloc trim threshold and kept the rest of pre-spawn-environ
            assert all(p["malloc_trim"] is None and p["omp"] == "1" for p in pinned.values()), pinned
            futures = [client.submit(start_child, pure=False, resources={"GPU": 1}) for _ in range(8)]
            assert client.gather(futures) == [0] * 8
    finally:
        cluster.close()


@pytest.mark.timeout(300)
def test_slurm_job_retires_before_walltime_and_is_replaced(tmp_path):
    from distributed import Client

    from daskgen.deploy import make_cluster

    def job_id():
        import os

        return os.environ.get("SLURM_JOB_ID")

    with dask.config.set({"distributed.deploy.lost-worker-timeout": "1s", "distributed.adaptive.interval": "500ms"}):
        cluster, info = make_cluster(_spec(tmp_path, gpus_per_node=2, lifetime="25s", lifetime_stagger=0))
        try:
            with Client(cluster) as client:
                client.wait_for_workers(2, timeout=180)
                first = set(client.run(job_id).values())
                assert len(first) == 1
                jobs = set(first)
                deadline = time.monotonic() + 200
                while len(jobs) < 2 and time.monotonic() < deadline:
                    time.sleep(1)
                    # a worker retiring while the broadcast reaches it answers with a closed comm: skip it
                    answers = client.run(job_id, on_error="return").values()
                    jobs.update(j for j in answers if isinstance(j, str))
                assert len(jobs) >= 2, f"no replacement job after the first retired: {jobs}"
                client.wait_for_workers(2, timeout=60)
        finally:
            cluster.close()


@pytest.mark.timeout(420)
def test_slurm_worker_job_signalled_hands_back_its_partial_responses(tmp_path, monkeypatch):
    """``scancel --signal=TERM --batch`` (what ``#SBATCH --signal=B:TERM@120`` does before walltime): the job's
    exec'd ``dask worker`` drains its workers through the nanny preload; a replacement job continues their
    partial responses token-exactly and the run completes."""
    import os

    import numpy as np
    import xarray as xr
    import yaml

    from tests.conftest import popen_cli, write_prompts
    from tests.test_run import _wait_for_some_done

    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    prompts = write_prompts(tmp_path / "p.jsonl", 24)
    out = tmp_path / "out.zarr"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"cluster": _spec(tmp_path, gpus_per_node=2)}))
    env = {"DASK_DISTRIBUTED__DEPLOY__LOST_WORKER_TIMEOUT": "1s", "DASK_DISTRIBUTED__ADAPTIVE__INTERVAL": "500ms"}
    proc = popen_cli(
        "run",
        "--config",
        config,
        "--cluster",
        "slurm",
        "--engine",
        "simulated",
        "--model",
        "sim",
        "--prompts",
        prompts,
        "--store",
        out,
        "--partition-size",
        "2",
        "--max-new-tokens",
        "600",
        "--max-prompt-tokens",
        "128",
        "--engine-arg",
        "length_dist=uniform",
        "--engine-arg",
        "length_mean=300",
        "--engine-arg",
        "time_scale=1.0",
        "--logprobs",
        "--no-progress",
        env=env,
    )
    try:
        _wait_for_some_done(out, proc, minimum=2, timeout=240)
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, timeout=30).stdout.split()
        assert len(jobs) == 1, jobs
        subprocess.run(["scancel", "--signal=TERM", "--batch", jobs[0]], check=True, timeout=30)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    assert proc.returncode == 0, output
    assert "24 done, 0 failed, 0 pending" in output
    continued = xr.open_zarr(out).continued_tokens.values
    assert (continued > 0).any(), "the signalled job's in-flight responses must be continued, not restarted"
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").glob("*"))
    assert "draining worker" in logs
    assert np.isin(xr.open_zarr(out).finish_reason.values[continued > 0], (0, 1)).all()


@pytest.mark.timeout(420)
def test_slurm_run_serves_the_daskgen_dashboard_page(tmp_path):
    """A run on SLURM (TLS, the scheduler in its own process): the progress line prints the page's address,
    the page in a browser shows the run going while SLURM jobs generate, and the store keeps the run's
    engine record with both workers."""
    import yaml

    from tests.browser import artifacts_dir, chromium, number, wait_until_shown
    from tests.conftest import popen_cli
    from tests.test_dashboard import N_PROMPTS, _finish, _read_until, _run_args, _store_truth, _wait_state

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"cluster": _spec(tmp_path, gpus_per_node=2)}))
    store, gate = tmp_path / "out.zarr", tmp_path / "gate"
    proc = popen_cli(*_run_args(tmp_path, store, "--config", config, "--cluster", "slurm"))
    try:
        url = _read_until(proc, "daskgen: live view at ", timeout=240).split("live view at ", 1)[1].strip()
        with chromium() as browser:
            browser.get(url)
            shown = wait_until_shown(
                browser, lambda v: number(v["done"]) > 0 and number(v["engine-tps"]) > 0, timeout=240
            )
            assert number(shown["pending"]) > 0 and shown["state"] == "generating"
            browser.save_screenshot(str(artifacts_dir() / "dashboard-slurm.png"))
        # the second worker's engine may still be loading when the first shows progress: wait for both to report
        _wait_state(url, lambda state: len(state["workers"]) == 2, timeout=180)
        _finish(proc, gate, timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    from daskgen.store import read_store_attrs

    record = read_store_attrs(store).runs[-1]["engines"]
    assert record["engine_tokens"] == record["committed_tokens"] == _store_truth(store)["tokens"]
    assert len(record["workers"]) == 2 and record["series"]["committed_prompts"][-1] == N_PROMPTS


@pytest.mark.timeout(420)
def test_a_slurm_cpu_job_preprocesses_the_images_for_the_engine_worker(tmp_path, monkeypatch):
    """docs/hpc.md's layout for image runs: CPU-only SLURM jobs rendered with ``render_job_script`` and
    ``--resources daskgen-preprocess=1`` beside the engine workers, on a scheduler started by hand.  The images are
    read, stored and preprocessed in the SLURM job's worker, the engine worker preprocesses none, and the answer
    equals the model's own."""
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)  # see test_slurm_job_runs_one_pinned_worker_per_gpu
    from daskgen.deploy import render_job_script
    from daskgen.input.image_refs import template_messages
    from daskgen.models import build_tiny_vl_model
    from daskgen.testing.images import sample_image_paths
    from daskgen.worker.images import image_metrics
    from daskgen.worker.plugin import plugin_status
    from tests.conftest import run_cli, runs_cluster
    from tests.test_images import QUESTION, answers, image_part, reference_generate, run_args, user, write_rows

    model, photo = build_tiny_vl_model(), sample_image_paths(tmp_path / "images")["grace_hopper"]
    cpu_job = {
        "kind": "slurm",
        "cores": 1,
        "memory": "2GB",
        "walltime": "00:10:00",
        "python": sys.executable,
        "log_directory": str(tmp_path / "logs"),
        "worker_extra_args": ["--resources", "daskgen-preprocess=1"],
    }
    rows = [{"messages": user(image_part(photo), {"type": "text", "text": QUESTION})}]
    prompts, out = write_rows(tmp_path / "p.jsonl", rows), tmp_path / "out.zarr"
    with runs_cluster() as (cluster, client):
        script = tmp_path / "cpu-job.sh"
        script.write_text(render_job_script(cpu_job, cluster.scheduler_address))
        submitted = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True)
        job = submitted.stdout.strip().split(";")[0]
        try:
            client.wait_for_workers(2, timeout=180)
            result = run_cli(*run_args(prompts, out, model)[:-3], "--no-progress",
                             "--scheduler-address", cluster.scheduler_address)  # fmt: skip
            assert result.returncode == 0, result.stdout + result.stderr
            metrics, states = client.run(image_metrics), client.run(plugin_status)
            names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        finally:
            subprocess.run(["scancel", job], check=False)
    (slurm_worker,) = [a for a, name in names.items() if str(name) == f"daskgen-{job}"]
    assert states[slurm_worker]["state"] == "preprocess" and metrics[slurm_worker]["images"] == 1, (states, metrics)
    (engine_worker,) = set(names) - {slurm_worker}
    assert metrics[engine_worker].get("images", 0) == 0, "the engine worker preprocessed nothing itself"
    assert answers(out, 1) == [reference_generate(model, template_messages(rows[0]["messages"]), [photo], 6)[1]]
