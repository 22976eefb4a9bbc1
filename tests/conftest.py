"""Shared fixtures (a tiny real model, prompt files, a helper that runs the real CLI) and the lane check.

The lane check (``--lane-expects N``, used by ``.ci/run`` and ``.ci/sglang-lane``) fails the session
when fewer than ``N`` tests ran, when a selected test did not run (skipped, xfailed, or never reached),
or when anything was skipped at all: a test that cannot run in a lane is deselected by marker
(``gpu``, ``sglang``, ``not_applicable``), which the summary lists with the reason.  Under pytest-xdist
(``-n N``) the controller checks: the workers report what they selected and deselected.

Test modules import what ``.[dev]`` installs plainly, never with ``importorskip``; a package only
some tests need (dask-jobqueue, gguf) is imported inside the code under test, so a lane without it
(the sglang lane's venv) still collects every module and a test that needs it fails loudly.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from tests import cli_zygote, module_order

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with the real SmolLM2 tokenizer and chat template (built locally)."""
    from daskgen.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model") / "model", seed=0)


@pytest.fixture(autouse=True)
def dask_default_scheduler_as_it_was(request: pytest.FixtureRequest) -> Iterator[None]:
    """Each test leaves Dask's default scheduler setting as it found it, and a test that changed it is named.

    A ``distributed.Client`` made the default sets ``scheduler`` (and ``shuffle``) in Dask's config and puts back what
    it found when it closes; clients closed in the other order than they were made (one way) leave the setting
    pointing at a client that is gone, and every later test of the same pytest process that computes a Dask
    collection would fail with "Requested dask.distributed scheduler but no Client active".  The setting is put
    back, with a warning that names the test (shown in the lane's summary).

    A client whose start failed with other than an ``OSError`` (a ``tls://`` address without a certificate raises
    ``TypeError``) stays the process's default client, connected to nothing: every later computation of a Dask
    collection in the process would wait for it forever.  A test that leaves a default client it did not find fails,
    and the client is closed."""
    import warnings

    import dask.config

    keys = ("scheduler", "shuffle")
    before = {key: dask.config.config[key] for key in keys if key in dask.config.config}
    client_before = default_client_or_none()
    yield
    after = {key: dask.config.config[key] for key in keys if key in dask.config.config}
    if after != before:
        warnings.warn(f"{request.node.nodeid} left Dask's settings {after} (were {before}); put back", stacklevel=1)
        for key in keys:
            dask.config.config.pop(key, None)
        dask.config.config.update(before)
    left = default_client_or_none()
    if left is not None and left is not client_before:
        with contextlib.suppress(Exception):
            left.close(timeout=5)
        pytest.fail(f"{request.node.nodeid} left a default Dask client ({left.status}); later computations use it")


def default_client_or_none() -> object | None:
    """The process's default ``distributed.Client``, if there is one."""
    from distributed import default_client

    try:
        return default_client()
    except ValueError:
        return None


@functools.cache
def tiny_model_once(prefix: str) -> str:
    """The same tiny Llama, built once per ``prefix`` into a temporary folder removed at exit.

    For class-level setup (``setup_class``) where fixtures are not available; a distinct prefix
    gives a folder name unique to the module (tests find server processes by the model path).
    """
    from daskgen.models import build_tiny_model

    folder = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return str(build_tiny_model(Path(folder) / "tiny", seed=0))


def simulated_run(*, max_new_tokens: int = 16, partition_size: int = 4, n_samples: int = 2) -> list[str]:
    """``daskgen run`` options of a quick real run: the instant simulated engine on a one-worker LocalCluster."""
    return [
        *("--engine", "simulated", "--engine-arg", "time_scale=0", "--model", "sim"),
        *("--max-new-tokens", str(max_new_tokens), "--max-prompt-tokens", "128"),
        *("--partition-size", str(partition_size), "--n-samples", str(n_samples)),
        *("--n-workers", "1", "--no-progress"),
    ]


def on_scheduler(run: list[str], address: str) -> list[str]:
    """The ``daskgen run`` options ``run`` (e.g. :func:`simulated_run`'s) against the scheduler at ``address``: without
    the size of a cluster of the run's own (``--n-workers``)."""
    at = run.index("--n-workers") if "--n-workers" in run else len(run)
    return [*run[:at], *run[at + 2 :], "--scheduler-address", address]


@contextlib.contextmanager
def runs_cluster(env: dict[str, str] | None = None, **config: object) -> Iterator[tuple[object, object]]:
    """A LocalCluster of one worker process (4 threads) and a client of it, for ``daskgen run --scheduler-address``;
    ``config``: Dask settings the worker starts with (e.g. ``{"daskgen.policy.poll-interval": "600s"}``); ``env``:
    environment variables its worker process gets on top of this process's."""
    import dask
    from distributed import Client, LocalCluster

    with (
        dask.config.set({"distributed.worker.daemon": False, **config}),
        LocalCluster(n_workers=1, threads_per_worker=4, processes=True, dashboard_address=":0", env=env) as cluster,
        Client(cluster) as client,
    ):
        client.wait_for_workers(1)
        yield cluster, client


def write_prompts(path: Path, n: int, *, chat: bool = True, words: int = 0) -> Path:
    """``n`` prompt rows with ids; chat rows by default; with ``words``, each question followed by that many numbered
    words (about 3.6 tokens each with the SmolLM2 tokenizer)."""
    filler = "".join(f" w{j}" for j in range(words))
    with path.open("w") as fh:
        for i in range(n):
            text = f"Question {i}: what is {i} plus {i % 7}?{filler}"
            row = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
            fh.write(json.dumps({**row, "id": f"q{i}"}) + "\n")
    return path


#: This process's environment before any test ran (or imported an engine).
SESSION_ENV = dict(os.environ)


def cli_env() -> dict[str, str]:
    """The environment of a command a test starts: this process's, except the variables an engine run here set
    (``cli_zygote.ENGINE_SET_ENV``), which keep the session's values."""
    env = {k: v for k, v in os.environ.items() if not cli_zygote.ENGINE_SET_ENV.match(k)}
    env.update((k, v) for k, v in SESSION_ENV.items() if cli_zygote.ENGINE_SET_ENV.match(k))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1", TQDM_DISABLE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run_cli(*args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python -m daskgen ARGS`` (extra environment in ``env``) and capture its output (tests/cli_zygote.py)."""
    command = [sys.executable, "-m", "daskgen", *map(str, args)]
    with cli_zygote.popen(
        command, {**cli_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def popen_cli(
    *args: str, env: dict[str, str] | None = None, stdout: int | IO[Any] = subprocess.PIPE
) -> subprocess.Popen:
    """Start ``python -m daskgen ARGS`` in its own process group (so a test can kill the whole tree); its output and
    errors go to ``stdout`` (a pipe unless given, e.g. an open file a long run cannot fill)."""
    return cli_zygote.popen(
        [sys.executable, "-m", "daskgen", *map(str, args)],
        {**cli_env(), **(env or {})},
        stdout=stdout,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@pytest.fixture
def fake_batch(tmp_path, monkeypatch):
    """sbatch/qsub that store the submitted script and print a job id; scancel/qdel that succeed."""
    spool = tmp_path / "spool"
    spool.mkdir()
    bindir = tmp_path / "bin"
    bindir.mkdir()
    # $$: unique per submission; copied under a hidden name and renamed, so a reader never sees a half-written job
    submit = f'#!/bin/sh\ncp "$1" {spool}/.job-$$.part && mv {spool}/.job-$$.part {spool}/job-$$.sh\necho "%s"\n'
    scripts = {
        "sbatch": submit % "Submitted batch job $$",
        "qsub": submit % "$$.pbs-server",
        "scancel": "#!/bin/sh\nexit 0\n",
        "qdel": "#!/bin/sh\nexit 0\n",
    }
    for name, text in scripts.items():
        path = bindir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    import dask

    tls = str(tmp_path / "tls")  # per-run certificates of make_cluster go here instead of ~/.daskgen/tls
    with dask.config.set({"jobqueue.slurm.shared-temp-directory": tls, "jobqueue.pbs.shared-temp-directory": tls}):
        yield spool


def wait_for_jobs(spool: Path, n: int, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = sorted(spool.glob("job-*.sh"))
        if len(files) >= n:
            return [f.read_text() for f in files]
        time.sleep(0.2)
    raise AssertionError(f"expected {n} submitted jobs, found {len(list(spool.iterdir()))}")


# --------------------------------------------------------------------------- lane check (CI)

NOT_APPLICABLE = "not_applicable"
_NOT_APPLICABLE_KEY = pytest.StashKey[list]()
_LANE_SUMMARY_KEY = pytest.StashKey[list]()  # what the lane check counted
_LANE_PROBLEMS_KEY = pytest.StashKey[list]()  # what it found wrong (the lane fails)
_XDIST_SELECTED_KEY = pytest.StashKey[list]()
_CLI_STARTS_KEY = pytest.StashKey[collections.Counter]()  # the lane's daskgen commands (tests/cli_zygote.py)
_MODULE_SECONDS: dict[str, float] = {}  # module -> seconds of its tests' setup, call and teardown in this pytest run


def pytest_configure(config: pytest.Config) -> None:
    """One torch CPU thread per test process, and per worker of the local clusters the tests start.

    The lanes run two or three test processes on two cores, each starting Dask workers and engines, and models this
    small gain little from a second thread, which spins between operations, CPU taken from the other processes.
    The OpenMP threads an engine sizes for itself (vLLM's CPU worker takes one per core it binds) wait passively
    (``OMP_WAIT_POLICY=PASSIVE``): they sleep between operations instead of spinning on a core the other lane needs.
    Set here, before collection imports torch, and only in pytest's own processes (worker processes that import
    this module keep the config their nanny gave them); the CLI runs, their workers and servers inherit the
    variables.  tests/test_deploy.py checks the default (the cores shared out) with the tunable unset.
    """
    import dask.config

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    threads = os.environ.setdefault("DASK_DASKGEN__LOCAL_CPU_THREADS", "1")
    dask.config.set({"daskgen.local-cpu-threads": int(threads)})
    # A nanny started in this process sets the hash seed here when none is (distributed.nanny): set from the start,
    # the seed of every process the tests start is the same all session, the CLI zygote's too (tests/cli_zygote.py).
    os.environ.setdefault("PYTHONHASHSEED", "6640")
    cli_zygote.BASE_ENV.update(cli_env())  # the CLI zygote's environment: the session's, before any test's changes


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--store-module-seconds",
        action="store_true",
        help="write each module's measured seconds into tests/module_seconds.json (the main lane's order)",
    )
    parser.addoption(
        "--lane-expects",
        type=int,
        default=None,
        metavar="N",
        help="fail unless at least N tests ran and every selected test ran (no skips); for CI lanes",
    )


@pytest.hookimpl(trylast=True)  # after `-m`, so only checks the lane would have run are listed
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the checks a conformance class declares not applicable (``not_applicable = {name: reason}``)."""
    keep, dropped = [], []
    for item in items:
        declared = getattr(getattr(item, "cls", None), NOT_APPLICABLE, None) or {}
        if item.name in declared:
            item.add_marker(pytest.mark.not_applicable(declared[item.name]))
        marker = item.get_closest_marker(NOT_APPLICABLE)
        (dropped if marker else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        config.stash[_NOT_APPLICABLE_KEY] = [(i.nodeid, i.get_closest_marker(NOT_APPLICABLE).args[0]) for i in dropped]
    # the longest modules first (tests/module_order.py): each xdist process then ends near the same time; in a
    # conformance class, the checks that shut its shared engine down last (``runs_last``), so it starts once
    order = module_order.longest_first([item.nodeid for item in keep], module_order.read_seconds())
    last = [item.name in getattr(getattr(item, "cls", None), "runs_last", ()) for item in keep]
    order = module_order.named_last(order, last, [item.parent.nodeid for item in keep])
    items[:] = [keep[i] for i in order]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``--store-module-seconds``, in the controller (or a run without xdist): sum each module's seconds."""
    module = module_order.module_of(report.nodeid)
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids: list[str]) -> None:
    """Under xdist: the controller learns the selected tests from the workers (each collects them all)."""
    node.config.stash[_XDIST_SELECTED_KEY] = list(ids)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """Under xdist: the controller gathers the checks each worker deselected as not applicable."""
    reported = getattr(node, "workeroutput", {}).get(NOT_APPLICABLE, [])
    known = node.config.stash.setdefault(_NOT_APPLICABLE_KEY, [])
    known.extend(tuple(entry) for entry in reported if tuple(entry) not in known)
    starts = node.config.stash.setdefault(_CLI_STARTS_KEY, collections.Counter())
    starts.update(getattr(node, "workeroutput", {}).get("cli_starts", {}))


#: The fewest ``daskgen`` commands a lane starts for the lane check to judge how they started (the main lane starts
#: about 280; an engine lane about ten, whose in-process engines set their libraries' variables in the test process).
CLI_STARTS_CHECKED = 50


def cli_start_problems(starts: collections.Counter) -> list[str]:
    """The lane check's finding when most of a lane's ``daskgen`` commands (at least :data:`CLI_STARTS_CHECKED`)
    started a fresh interpreter instead of being forked from the CLI zygote: a variable the session's processes set
    after it started (each is named) would otherwise silently multiply the suite's CPU time."""
    fresh = sum(n for key, n in starts.items() if key != "forked")
    if fresh <= starts["forked"] or fresh + starts["forked"] < CLI_STARTS_CHECKED:
        return []
    return [
        f"{fresh} of {fresh + starts['forked']} daskgen commands started a fresh interpreter instead of being forked "
        f"from the CLI zygote; the variables that differed from the zygote's environment: {fresh_reasons(starts)}. "
        "Add a variable read only when used to RUNTIME_ENV in tests/cli_zygote.py, or keep the test processes from "
        "setting it"
    ]


def fresh_reasons(starts: collections.Counter) -> str:
    """``VARIABLES (count), ...``: what differed for the commands that started a fresh interpreter, most first."""
    return ", ".join(f"{key} ({n})" for key, n in starts.most_common() if key != "forked") or "none"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    expected = session.config.getoption("--lane-expects")
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: the controller checks the lane
        workeroutput[NOT_APPLICABLE] = session.config.stash.get(_NOT_APPLICABLE_KEY, [])
        workeroutput["cli_starts"] = dict(cli_zygote.STARTS)
        return
    if session.config.getoption("--store-module-seconds") and _MODULE_SECONDS:
        module_order.store_seconds(_MODULE_SECONDS)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if (
        expected is None
        or reporter is None
        or exitstatus in (pytest.ExitCode.NO_TESTS_COLLECTED, pytest.ExitCode.INTERRUPTED)
    ):
        return
    stats = reporter.stats
    ran = {r.nodeid for key in ("passed", "failed") for r in stats.get(key, []) if r.when == "call"}
    selected = session.config.stash.get(_XDIST_SELECTED_KEY, None)
    if selected is None:
        selected = [item.nodeid for item in session.items]
    problems = []
    if len(ran) < expected:
        problems.append(f"{len(ran)} tests ran, this lane expects at least {expected} (--lane-expects)")
    for key in ("skipped", "xfailed", "xpassed"):
        for report in stats.get(key, []):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else getattr(report, "wasxfail", "")
            problems.append(f"{key}: {report.nodeid} ({reason}); deselect it by marker instead")
    missing = [nodeid for nodeid in selected if nodeid not in ran]
    if missing:
        problems.append(f"{len(missing)} selected test(s) did not run: {', '.join(missing[:20])}")
    starts = session.config.stash.get(_CLI_STARTS_KEY, None) or cli_zygote.STARTS
    problems.extend(cli_start_problems(starts))
    session.config.stash[_LANE_SUMMARY_KEY] = [
        f"lane check: {len(selected)} selected, {len(ran)} ran (at least {expected} expected)",
        f"daskgen commands: {starts['forked']} forked from the CLI zygote; fresh interpreters, by what differed: "
        f"{fresh_reasons(starts)}",
    ]
    session.config.stash[_LANE_PROBLEMS_KEY] = problems
    if problems and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    not_applicable = config.stash.get(_NOT_APPLICABLE_KEY, [])
    if not_applicable:
        terminalreporter.section("deselected: not applicable")
        for nodeid, reason in not_applicable:
            terminalreporter.line(f"{nodeid}: {reason}")
    summary, problems = config.stash.get(_LANE_SUMMARY_KEY, []), config.stash.get(_LANE_PROBLEMS_KEY, [])
    if summary:
        terminalreporter.section("lane check", red=bool(problems), green=not problems)
        for line in [*summary, *problems]:
            terminalreporter.line(line)
        if problems:
            terminalreporter.line("lane check FAILED", red=True)
