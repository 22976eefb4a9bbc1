"""A run whose workers are all gone stops with an error instead of waiting for ever (docs/reliability.md, case 20).

Real parts: ``daskgen run`` processes, a real LocalCluster (the run's own, or one started here and passed as
``--scheduler-address``), real stores.  The engine that closes its worker is a labelled test double.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from daskgen import store
from daskgen.engines.base import GenerationRequest, GenerationResult
from daskgen.engines.simulated import SimulatedEngine
from tests.conftest import on_scheduler, popen_cli, run_cli, runs_cluster, simulated_run, write_prompts
from tests.test_run import _wait_for_some_done

pytestmark = pytest.mark.timeout(180)

#: Engine checks every second instead of every 30 s, so that a stop comes within seconds.
QUICK_CHECKS = {"DASK_DASKGEN__ENGINE_CHECK_INTERVAL": "1s"}
#: A local cluster forgets a closed worker process this soon after it left (15 s by default): the check sees none.
FORGET_SOON = {"DASK_DISTRIBUTED__DEPLOY__LOST_WORKER_TIMEOUT": "0.1s"}


class ClosesItsWorker(SimulatedEngine):
    """Test double: the simulated engine, whose worker closes with its nanny at its sixth request (as a worker
    whose scheduler connection broke, or one retired by an operator, does): the worker process is gone for good."""

    def __init__(self, model: str = "simulated", **engine_args) -> None:
        super().__init__(model, **engine_args)
        self.requests = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.requests += 1
        if self.requests == 6:
            from distributed import get_worker

            asyncio.get_running_loop().create_task(get_worker().close(nanny=True, reason="test: closed for good"))
            await asyncio.sleep(3600)
        return await super().generate(request)


def _not_failed(path) -> store.GenerationStore:
    status = store.GenerationStore.open(path).read_status()
    assert not (status == store.FAILED).any(), "a worker that left fails no row"
    return status


@pytest.mark.parametrize("forgotten", [False, True], ids=["closed", "forgotten"])
def test_a_fixed_local_cluster_whose_workers_closed_stops_the_run_at_once(tmp_path, forgotten):
    """The worker process closes with its nanny; the next engine check finds the nanny closed, or (after
    ``distributed.deploy.lost-worker-timeout``) no longer in the cluster: the run stops (exit 2)."""
    prompts = write_prompts(tmp_path / "p.jsonl", 16)
    out = tmp_path / "out.zarr"
    run = [a.replace("simulated", "tests.test_workers_gone:ClosesItsWorker", 1) for a in simulated_run()]
    env = {**QUICK_CHECKS, **(FORGET_SOON if forgotten else {})}
    res = run_cli("run", "--prompts", prompts, "--store", out, *run, env=env, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "every worker of the run's cluster has closed and none will start again" in res.stderr, res.stderr[-2000:]
    assert "rerun the same command to resume" in res.stderr
    status = _not_failed(out)
    assert (status == store.DONE).sum() < 16


def test_a_run_whose_only_worker_left_an_external_scheduler_stops_after_the_engine_start_timeout(tmp_path):
    """The worker is retired by an operator mid-run: the run waits ``daskgen.engine-start-timeout`` (here 3 s) for
    another to join, then stops (exit 2) keeping what was committed."""
    prompts = write_prompts(tmp_path / "p.jsonl", 40)
    out = tmp_path / "out.zarr"
    slow = simulated_run(partition_size=2, n_samples=1)
    slow[slow.index("time_scale=0")] = "time_scale=1"  # with one request at a time: 20 partitions of ~0.3 s
    slow += ["--engine-arg", "max_batch=1"]
    with runs_cluster() as (cluster, client):
        run = on_scheduler(slow, cluster.scheduler_address)
        env = {**QUICK_CHECKS, "DASK_DASKGEN__ENGINE_START_TIMEOUT": "3s"}
        proc = popen_cli("run", "--prompts", prompts, "--store", out, *run, env=env)
        try:
            done = _wait_for_some_done(out, proc, minimum=2)
            client.retire_workers(list(client.scheduler_info()["workers"]), close_workers=True)
            output, _ = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, output
    assert "no worker with an engine has been connected to the scheduler for" in output, output[-2000:]
    assert "no worker with an engine is connected to the scheduler: the run waits up to 3 s" in output
    status = _not_failed(out)
    assert done.sum() <= (status == store.DONE).sum() < 40, "what was committed before the worker left stays done"
