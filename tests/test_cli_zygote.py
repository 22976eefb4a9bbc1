"""The tests' launcher of ``daskgen`` commands (tests/cli_zygote.py) behaves as a fresh ``python -m daskgen``.

Every CLI test relies on it: a command forked from the zygote must see the test's environment (Dask settings
included), working directory and streams, report its own exit status, and be a process of its own that signals
reach (and, with a new session, its own process group).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from daskgen.client.interrupt import EXIT_INTERRUPTED
from tests import cli_zygote
from tests.conftest import cli_env, popen_cli, run_cli, write_prompts
from tests.test_run import _wait_for_some_done

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def session_env(monkeypatch):
    """``run_cli`` and ``popen_cli`` with the session's environment (the zygote's), whatever earlier tests of this
    process left in ``os.environ``: their commands are forked."""
    monkeypatch.setattr("tests.conftest.cli_env", lambda: dict(cli_zygote.BASE_ENV))


def test_a_forked_command_gets_the_tests_dask_settings_and_exit_status(tmp_path):
    """A health timeout given as a DASK_ variable reaches the forked command's config: a fresh interpreter and
    the fork refuse the same bad value the same way, naming it, before any store is made."""
    assert not cli_zygote.Zygote.get(cli_env()).blocking({**cli_zygote.BASE_ENV, "DASK_DASKGEN__HEALTH_TIMEOUT": "x"})
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    args = ("run", "--prompts", prompts, "--store", tmp_path / "o.zarr", "--engine", "simulated", "--model", "sim")
    env = {"DASK_DASKGEN__HEALTH_TIMEOUT": "not-a-duration"}
    forked = run_cli(*args, env=env)
    fresh = subprocess.run(
        [sys.executable, "-m", "daskgen", *map(str, args)],
        capture_output=True, text=True, timeout=120, env={**cli_env(), **env},
    )  # fmt: skip
    assert forked.returncode == fresh.returncode != 0
    assert "found 'not-a-duration'" in forked.stderr and forked.stderr == fresh.stderr
    assert not (tmp_path / "o.zarr").exists()


def test_a_forked_command_runs_in_the_tests_directory_as_its_own_process_group(tmp_path, monkeypatch):
    """Relative paths resolve in the test's working directory; the command leads a session of its own, which a
    SIGKILL to its group ends (status -9, seen by poll and wait)."""
    monkeypatch.chdir(tmp_path)
    write_prompts(tmp_path / "p.jsonl", 2)
    done = run_cli("run", "--prompts", "p.jsonl", "--store", "o.zarr", "--engine", "simulated", "--model", "sim",
                   "--max-new-tokens", "4", "--n-workers", "1", "--no-progress")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "o.zarr").is_dir()
    proc = popen_cli("follow", "o.zarr", "--wait")
    assert isinstance(proc, cli_zygote.ZygotePopen) and proc.pid != os.getpid()
    assert os.getpgid(proc.pid) == proc.pid and proc.poll() is None
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    proc.stdout.close()


def test_an_environment_read_at_import_time_starts_a_fresh_interpreter():
    """A difference the interpreter or a library reads at import (here PYTHONHASHSEED) is never forked."""
    proc = cli_zygote.popen(
        [sys.executable, "-m", "daskgen", "--help"], {**cli_env(), "PYTHONHASHSEED": "7"}, stdout=subprocess.DEVNULL
    )
    assert not isinstance(proc, cli_zygote.ZygotePopen)
    assert proc.wait(timeout=60) == 0


def _workers_of(proc: subprocess.Popen, n: int, timeout: float = 90) -> tuple[list, list, list]:
    """``(spawned, servers, forked)`` once a running command has ``n`` Dask workers: its children spawned by
    multiprocessing, its children forked from the zygote (a fork server), and theirs (workers forked from one)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        with contextlib.suppress(psutil.Error):
            children = psutil.Process(proc.pid).children()
            spawned = [c for c in children if "multiprocessing.spawn" in " ".join(c.cmdline())]
            servers = [c for c in children if "cli_zygote.py" in " ".join(c.cmdline())]
            forked = [g for c in servers for g in c.children() if "cli_zygote.py" in " ".join(g.cmdline())]
            if len(spawned) + len(forked) >= n:
                return spawned, servers, forked
        time.sleep(0.2)
    raise AssertionError(f"{n} workers of the command did not start within {timeout} s")


def _slow_run(tmp_path, *env: str) -> subprocess.Popen:
    prompts = write_prompts(tmp_path / "p.jsonl", 256)  # minutes of simulated time: still going when a test stops it
    return popen_cli(
        "run", "--prompts", prompts, "--store", tmp_path / "o.zarr", "--engine", "simulated", "--model", "sim",
        "--engine-arg", "time_scale=1", "--max-new-tokens", "64", "--partition-size", "4", "--n-workers", "2",
        "--no-progress", env=dict(kv.split("=", 1) for kv in env),
    )  # fmt: skip


def test_a_forked_commands_workers_are_forked_from_its_fork_server_in_its_process_group(tmp_path):
    """A forked command's Dask workers are forked (not spawned) from its fork server, its one forked child; all are in
    the command's process group, and a SIGTERM to the group drains the run (the server outlives it until the workers
    have left) and leaves no process behind."""
    import psutil

    proc = _slow_run(tmp_path)
    assert isinstance(proc, cli_zygote.ZygotePopen)
    try:
        spawned, servers, workers = _workers_of(proc, 2)
        assert not spawned and len(servers) == 1 and len(workers) == 2
        assert all(os.getpgid(p.pid) == proc.pid for p in [*servers, *workers])
        _wait_for_some_done(tmp_path / "o.zarr", proc, minimum=4)
        os.killpg(proc.pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=90)
        assert proc.returncode == EXIT_INTERRUPTED, output[-3000:]
        _, alive = psutil.wait_procs([*servers, *workers], timeout=30)  # their streams closed: they are exiting
        assert not alive, alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_workers_that_need_another_openmp_thread_count_than_the_zygotes_are_spawned(tmp_path, monkeypatch):
    """torch's OpenMP runtime reads its thread count once, when loaded (in the zygote): a command whose workers get
    another (the ``local-cpu-threads`` tunable) is forked, but its workers are fresh interpreters."""
    assert cli_zygote.BASE_ENV["OMP_NUM_THREADS"] == "1"  # the zygote's, which it loads torch with
    assert cli_zygote.worker_forkserver_fits({"OMP_NUM_THREADS": "1"})
    assert not cli_zygote.worker_forkserver_fits({"OMP_NUM_THREADS": "2"})
    with monkeypatch.context() as switch:
        switch.setenv("DASKGEN_TESTS_FORK_WORKERS", "0")  # every worker spawned
        assert not cli_zygote.worker_forkserver_fits({"OMP_NUM_THREADS": "1"})
    proc = _slow_run(tmp_path, "DASK_DASKGEN__LOCAL_CPU_THREADS=2")
    assert isinstance(proc, cli_zygote.ZygotePopen)
    try:
        spawned, servers, forked = _workers_of(proc, 2)
        assert len(spawned) == 2 and not forked and not servers
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)


#: A script that sets a variable, then starts a cluster and prints what its worker sees.
ENV_OF_A_WORKER = """
import json, os
import dask
from distributed import Client, LocalCluster
if __name__ == "__main__":
    os.environ["DASKGEN_TEST_MARK"] = "set after start"
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        Client(cluster) as client,
    ):
        ((mark, parent),) = client.run(lambda: (os.environ.get("DASKGEN_TEST_MARK"), os.getppid())).values()
    print(json.dumps({"mark": mark, "forked": parent != os.getpid()}))
"""


def test_a_forked_worker_gets_the_environment_its_command_has_when_it_starts_it(tmp_path):
    """A command that sets a variable before it starts a cluster (a benchmark's object-store endpoint) gives it to
    the cluster's workers, forked from a server that started before the variable was set, as a spawned one
    inherits it."""
    script = tmp_path / "env_of_a_worker.py"
    script.write_text(ENV_OF_A_WORKER)
    proc = cli_zygote.popen(
        [sys.executable, str(script)], cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert isinstance(proc, cli_zygote.ZygotePopen)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert json.loads(out.splitlines()[-1]) == {"mark": "set after start", "forked": True}


#: What a test process may import, each run in a fresh interpreter that prints the variables the import set.
IMPORTS = {
    "torchs_compiler": "from torch._inductor.runtime.cache_dir_utils import cache_dir\ncache_dir()",
    "verls_dataproto": "import verl.protocol",
}
SETS = (
    "import json, os\nbefore = dict(os.environ)\n{}\n"
    "print(json.dumps({{k: v for k, v in os.environ.items() if before.get(k) != v}}))"
)


@pytest.mark.parametrize("imports", list(IMPORTS))
def test_variables_libraries_set_when_a_test_imports_them_do_not_stop_the_fork(imports):
    """torch sets its compiler cache folder in ``os.environ`` when its compiler is imported, verl and ray set theirs
    when they are: the commands a test process starts after such an import are still forked."""
    code = SETS.format(IMPORTS[imports])
    # the session's environment without its run-time settings, those libraries' variables among them
    unset = {k: v for k, v in cli_zygote.BASE_ENV.items() if not cli_zygote.RUNTIME_ENV.match(k)}
    done = subprocess.run([sys.executable, "-c", code], env=unset, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    set_by_import = json.loads(done.stdout.splitlines()[-1])
    assert set_by_import, "the import set no variable: nothing to check"
    env = {**cli_zygote.BASE_ENV, **set_by_import}
    assert cli_zygote.Zygote.get(env).blocking(env) == [], set_by_import
    proc = cli_zygote.popen([sys.executable, "-m", "daskgen", "--help"], env, stdout=subprocess.DEVNULL)
    assert isinstance(proc, cli_zygote.ZygotePopen)
    assert proc.wait(timeout=60) == 0


def test_variables_an_engine_set_in_the_test_process_are_not_a_commands(monkeypatch):
    """A test process that ran an engine or a worker in-process (sglang's and vLLM's imports set variables, daskgen's
    engine plugin the worker's rank and memory limit) starts its commands with the session's values of them: the
    command is forked as from the shell that started the tests, and its workers set them for themselves."""
    from tests.conftest import SESSION_ENV

    set_here = {"SGLANG_RUN_ID": "x", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "DASKGEN_WORKER_MEMORY_LIMIT": "7",
                "LD_PRELOAD": "/nonexistent/libx.so", "DASKGEN_TEST_SGLANG_KEY": "k"}  # fmt: skip
    for name, value in set_here.items():
        monkeypatch.setenv(name, value)
    env = cli_env()  # the function itself (this module's autouse fixture patches the one run_cli calls)
    for name in set_here:
        if name.startswith("DASKGEN_TEST_"):  # a test's own setting for the engines it starts: passed on
            assert env[name] == set_here[name]
        else:
            assert env.get(name) == SESSION_ENV.get(name), name
    assert cli_zygote.Zygote.get(env).blocking(env) == []
    proc = cli_zygote.popen([sys.executable, "-m", "daskgen", "--help"], env, stdout=subprocess.DEVNULL)
    assert isinstance(proc, cli_zygote.ZygotePopen)
    assert proc.wait(timeout=60) == 0


def test_the_lane_check_fails_when_most_commands_start_fresh_interpreters_and_names_why():
    """The session counts its commands' starts (tests/conftest.py): most forked passes, most fresh (of enough
    commands) is a finding that names the variables that differed."""
    from collections import Counter

    from tests.conftest import cli_start_problems

    assert cli_start_problems(Counter({"forked": 30, "PATH": 4})) == []
    assert cli_start_problems(Counter()) == []
    assert cli_start_problems(Counter({"forked": 2, "TRITON_CACHE_DIR": 8})) == []  # too few commands to judge
    (problem,) = cli_start_problems(Counter({"forked": 2, "TORCHINDUCTOR_CACHE_DIR": 60, "PATH": 3}))
    assert "63 of 65 daskgen commands started a fresh interpreter" in problem
    assert "TORCHINDUCTOR_CACHE_DIR (60), PATH (3)" in problem and "RUNTIME_ENV" in problem
