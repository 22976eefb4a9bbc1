"""Processes the benchmarks start: a scheduler and workers of their own, and the ``PYTHONPATH`` they import with.

:func:`separate_scheduler` starts ``dask scheduler`` and ``dask worker --nworkers N`` (nannies in one process,
workers in their own) as subprocesses, so that the client process holds only the client; their CPU is
read from ``/proc`` (psutil) and reported apart.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

from .records import DASKGEN_SRC, HERE


def benchmark_pythonpath() -> str:
    """``PYTHONPATH`` for other processes that must import daskgen from ``$DASKGEN_SRC`` and this folder
    (a scheduler unpickles the floor's tasks by reference)."""
    return os.pathsep.join([str(DASKGEN_SRC), str(HERE), os.environ.get("PYTHONPATH", "")])


@contextlib.contextmanager
def importable_here() -> Iterator[None]:
    """While inside: processes this one starts (daskgen's scheduler process, batch jobs) import as above."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = benchmark_pythonpath()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


@contextlib.contextmanager
def separate_scheduler(n_workers: int, nthreads: int, work: Path) -> Iterator[tuple[str, dict[str, psutil.Process]]]:
    """A scheduler and ``n_workers`` workers (``nthreads`` each) in processes of their own.

    Yields the scheduler address and ``{"scheduler": ..., "nannies": ...}`` processes.  Both import
    daskgen from ``$DASKGEN_SRC`` (the scheduler runs daskgen's drain plugin and unpickles the tasks,
    workers run the engine) and can import ``benchmarks/`` (the floor's tasks).
    """
    from distributed import Client

    env = {**os.environ, "PYTHONPATH": benchmark_pythonpath()}
    sched_file = work / f"scheduler-{time.time_ns()}.json"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    sched = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "distributed.cli.dask_scheduler",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--no-dashboard",
            "--scheduler-file",
            str(sched_file),
        ],
        **quiet,
    )
    workers = None
    try:
        address = wait_for_address(sched_file, sched)
        workers = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "distributed.cli.dask_worker",
                address,
                "--nworkers",
                str(n_workers),
                "--nthreads",
                str(nthreads),
                "--no-dashboard",
                "--host",
                "127.0.0.1",
            ],
            **quiet,
        )
        with Client(address, timeout=60) as client:
            client.wait_for_workers(n_workers, timeout=120)
        yield address, {"scheduler": psutil.Process(sched.pid), "nannies": psutil.Process(workers.pid)}
    finally:
        for proc in (workers, sched):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def wait_for_address(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The address the scheduler ``proc`` writes into its scheduler file ``path``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"dask scheduler exited with status {proc.returncode}")
        with contextlib.suppress(OSError, ValueError, KeyError):
            return json.loads(path.read_text())["address"]
        time.sleep(0.1)
    raise SystemExit(f"dask scheduler did not write {path} within {timeout:.0f} s")
