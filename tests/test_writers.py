"""Writer processes (``daskgen.writer-processes``): partitions' regions written beside the worker's event loop.

Real runs on a LocalCluster of worker processes with the instant simulated engine: a run whose workers write
through writer processes (their regions handed over in shared memory) stores exactly what a run writing in
the worker's own thread stores; a writer process killed before the run is replaced and nothing is lost;
writer processes die with their worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import dask
import numpy as np
import psutil
import pytest

from daskgen.client.runner import run
from daskgen.config import RunConfig
from daskgen.engines.base import FinishReason
from daskgen.errors import ConfigError
from daskgen.store.generation_store import GenerationStore
from daskgen.worker.writers.pool import writer_processes
from tests.conftest import runs_cluster

pytestmark = pytest.mark.timeout(240)

ROWS = 48
DONE = (FinishReason.STOP, FinishReason.LENGTH)
PROBE = "daskgen.testing.probes:ProbeEngine"
COMPARED = ("response_ids", "response_length", "logprobs", "finish_reason", "prompt_ids", "response_mask")


def config(store: str, scheduler: str | None = None, **settings: object) -> RunConfig:
    """A run of the instant simulated engine (unless ``settings`` say otherwise): ROWS prompts x 2 samples,
    partitions of 4."""
    return RunConfig(
        model="sim",
        store=store,
        **(
            {"engine": "simulated", "engine_args": {"time_scale": 0.0, "length_dist": "lognormal", "length_mean": 12}}
            | settings
        ),
        n_samples=2,
        max_new_tokens=48,
        max_prompt_tokens=64,
        partition_size=4,
        logprobs=True,
        temperature=1.0,
        seed=7,
        n_workers=2,
        progress=False,
        scheduler_address=scheduler,
    )


def prompts() -> list[str]:
    return [f"Question {i}: what is {i} plus {i * 3}?" for i in range(ROWS)]


def writers_of(dask_worker) -> dict[str, object]:
    """``client.run`` target: the worker's writer pool counters and its live child processes."""
    plugin = dask_worker.plugins.get("daskgen-engine")  # None until the run registered it
    pool = plugin.writers if plugin is not None else None
    children = [p.pid for p in psutil.Process().children() if p.is_running()]
    if pool is None:
        return {"processes": 0, "written": 0, "replaced": 0, "shared": 0, "children": children}
    counts = {"written": pool.written, "replaced": pool.replaced, "shared": pool.blocks.shared}
    return {"processes": pool.processes, **counts, "children": children}


def kill_writers(dask_worker) -> list[int]:
    """``client.run`` target: SIGKILL every child process of the worker (its writer processes); their pids."""
    children = psutil.Process().children()
    for child in children:
        child.send_signal(signal.SIGKILL)
    psutil.wait_procs(children, timeout=30)
    return [child.pid for child in children]


def test_writer_processes_store_what_the_worker_thread_stores(tmp_path):
    in_thread = run(config(str(tmp_path / "thread.zarr")), prompts())
    with runs_cluster(**{"daskgen.writer-processes": 1}) as (cluster, client):
        in_process = run(config(str(tmp_path / "process.zarr"), cluster.scheduler_address), prompts())
        seen = client.run(writers_of)
    assert in_thread.ok and in_process.ok
    (worker,) = seen.values()
    assert worker["processes"] == 1 and len(worker["children"]) == 1
    assert worker["written"] == ROWS // 4  # every partition went through the writer process
    assert worker["shared"] == ROWS // 4  # its arrays in shared memory (daskgen.worker.writers.shared_regions)
    a = GenerationStore.open(str(tmp_path / "thread.zarr")).read_region(0, ROWS, COMPARED)
    b = GenerationStore.open(str(tmp_path / "process.zarr")).read_region(0, ROWS, COMPARED)
    for name in COMPARED:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert np.isin(b["finish_reason"], DONE).all() and b["response_length"].sum() > 0


def test_a_writer_process_that_died_is_replaced_and_nothing_is_lost(tmp_path):
    """Half the partitions are written, the worker's writer process is killed while the other half waits at the
    probe engine's gate, then the gate opens: the pool is replaced once and every row is stored."""
    from concurrent.futures import ThreadPoolExecutor

    held = list(range(ROWS // 2, ROWS, 4))  # the first row of each partition of the second half
    with runs_cluster(**{"daskgen.writer-processes": 1}) as (cluster, client):
        probe = {
            "events_path": str(tmp_path / "events.log"),
            "gate_path": str(tmp_path / "gate"),
            "gate_rows": held,
            "gate_sample": 0,
            "max_batch": 16,
            "time_scale": 0.0,
        }
        cfg = config(str(tmp_path / "s.zarr"), cluster.scheduler_address, engine=PROBE, engine_args=probe)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(run, cfg, prompts())
            try:
                deadline = time.monotonic() + 120
                while next(iter(client.run(writers_of).values()))["written"] < ROWS // 8:
                    assert time.monotonic() < deadline and not running.done(), "the open half was not written"
                    time.sleep(0.1)
                (killed,) = client.run(kill_writers).values()
            finally:
                (tmp_path / "gate").touch()
            summary = running.result(timeout=180)
        (worker,) = client.run(writers_of).values()
    assert summary.ok and len(killed) == 1
    assert worker["replaced"] == 1 and worker["written"] == ROWS // 4
    assert killed[0] not in worker["children"] and len(worker["children"]) == 1
    stored = GenerationStore.open(str(tmp_path / "s.zarr")).read_region(0, ROWS, ("finish_reason", "response_length"))
    assert np.isin(stored["finish_reason"], DONE).all() and (stored["response_length"] > 0).all()


WORKER_SCRIPT = """
import asyncio, os, pathlib, signal, sys, time
from daskgen.worker.writers.pool import WriterPool

def busy(marker):  # a long write: the writer process is not waiting for work when its worker dies
    pathlib.Path(marker, str(os.getpid())).touch()
    time.sleep(300)

async def main(folder):
    pool = WriterPool(2)
    writes = [asyncio.ensure_future(pool.run(busy, folder)) for _ in range(2)]
    while len(os.listdir(folder)) < 2 and not any(w.done() for w in writes):
        await asyncio.sleep(0.05)
    print(" ".join(os.listdir(folder)), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
"""


def test_writer_processes_die_with_their_worker(tmp_path):
    """A worker killed while its writer processes write: they die with it (no write outlives its worker)."""
    script, busy = tmp_path / "worker.py", tmp_path / "busy"
    script.write_text(WORKER_SCRIPT)
    busy.mkdir()
    cmd = [sys.executable, str(script), str(busy)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout is not None and proc.stdin is not None
    pids = [int(pid) for pid in proc.stdout.readline().split()]
    assert len(pids) == 2, "both writer processes should be writing"
    writers = [psutil.Process(pid) for pid in pids]
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    _gone, alive = psutil.wait_procs(writers, timeout=30)
    for process in alive:
        process.kill()
    assert not alive, f"writer processes outlived their worker: {[p.pid for p in alive]}"


@pytest.mark.parametrize("value", [-1, "two", 1.5, True])
def test_writer_processes_setting_is_checked(value):
    with dask.config.set({"daskgen.writer-processes": value}), pytest.raises(ConfigError) as info:
        writer_processes()
    assert "daskgen.writer-processes must be a whole number >= 0" in str(info.value)
    assert repr(value) in str(info.value)


def test_writer_processes_default_is_zero():
    assert writer_processes() == 0


BLOCK_SCRIPT = """
import asyncio, os, signal, sys, time
import numpy as np
from daskgen.worker.writers.pool import WriterPool

class Slow:  # a store whose region write takes long: the writer process reads the block when its worker dies
    def write_region(self, start, arrays):
        print("writing", flush=True)
        time.sleep(300)

def blocks():
    return {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}

async def main():
    before = blocks()
    pool = WriterPool(1)
    write = asyncio.ensure_future(pool.write_region(Slow(), 0, {"response_ids": np.arange(4096)}))
    while not blocks() - before and not write.done():
        await asyncio.sleep(0.01)
    print(" ".join(blocks() - before), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    os.kill(os.getpid(), signal.SIGKILL)

if __name__ == "__main__":
    asyncio.run(main())
"""


def test_a_killed_workers_shared_memory_is_removed(tmp_path):
    """A worker killed while its writer process reads a region's block: the block does not outlive them (the
    worker's resource tracker removes it; Linux shows POSIX shared memory in /dev/shm)."""
    script = tmp_path / "worker.py"
    script.write_text(BLOCK_SCRIPT)
    cmd = [sys.executable, str(script)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert proc.stdout is not None and proc.stdin is not None
    names = proc.stdout.readline().split()
    assert len(names) == 1, "the region should be in one shared-memory block"
    assert proc.stdout.readline().strip() == "writing"  # the writer process holds the block
    proc.stdin.write("\n")
    proc.stdin.flush()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while os.path.exists(f"/dev/shm/{names[0]}"):
        assert time.monotonic() < deadline, f"shared-memory block {names[0]} outlived its worker"
        time.sleep(0.1)
