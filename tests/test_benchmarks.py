"""Every benchmark script runs once at a tiny size, so the benchmarks cannot rot; records name their code.

The script runs check that each script finishes, prints its table and writes one complete record file
(command, commit, machine, versions) into the results folder it is given.  They never assert timings:
the numbers at this size mean nothing.  The other tests check the clean-tree logic of the records on a
scratch git repository, and that every figure quoted in the docs links to a record file that exists.
"""

from __future__ import annotations

import importlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import records
from daskgen.errors import ConfigError
from tests import cli_zygote
from tests.conftest import REPO, cli_env

BENCH = REPO / "benchmarks"


def tree_has_changes() -> bool:
    """Whether ``daskgen/`` or ``benchmarks/`` (records aside) of this checkout differ from its commit."""
    cmd = [
        "git",
        "-C",
        str(REPO),
        "status",
        "--porcelain",
        "--",
        "daskgen",
        "benchmarks",
        ":(exclude)benchmarks/results",
    ]
    return bool(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip())


def run_forked(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` in the repository with the CLI's environment, forked from the CLI zygote when it can be
    (tests/cli_zygote.py): a benchmark script is a ``daskgen`` run's client and its local clusters' workers."""
    proc = cli_zygote.popen(
        cmd, cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:  # a timeout, or the test's own: the script's whole process group goes
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_script(name: str, tmp_path: Path, *args: str, timeout: float = 480) -> tuple[str, str]:
    """Run ``benchmarks/<name>`` with a scratch results folder and workdir; return (stdout, the record's text)."""
    results = tmp_path / "results"
    cmd = [sys.executable, str(BENCH / name), "--results", str(results), "--workdir", str(tmp_path / "work"), *args]
    res = run_forked(cmd, timeout)
    assert res.returncode == 0, f"{name} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    (record,) = results.glob("*.md")
    stem = Path(name).stem
    assert re.fullmatch(rf"\d{{4}}-\d\d-\d\dT\d{{4}}-{stem}(-uncommitted)?\.md", record.name), record.name
    text = record.read_text()
    assert f"benchmarks/{name}" in text and "Machine:" in text and "Versions:" in text, text
    assert f"Commit: benchmarks/ at {records.git_head(REPO)}; daskgen code: working tree" in text, text
    marked = record.name.endswith("-uncommitted.md")
    assert marked == tree_has_changes() == ("**Not a record of a commit:**" in text), (record.name, text[:2000])
    return res.stdout, text


@pytest.mark.timeout(480)
def test_longtail(tmp_path):
    out, readme = run_script(
        "longtail.py",
        tmp_path,
        "--prompts",
        "64",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--length-mean",
        "16",
        "--max-new-tokens",
        "64",
        "--time-scale",
        "0.002",
        "--sweep",
        "1,2",
        "--partition-size",
        "8",
        "--sample-period",
        "0.01",
    )
    assert "| sync |" in out and "streaming (window" in out
    assert "| yes |" in out  # both sides generated the same tokens
    (png,) = (tmp_path / "results").glob("longtail-*.png")
    assert png.stat().st_size > 0 and f"]({png.name})" in readme


@pytest.mark.timeout(300)
def test_longtail_real(tmp_path, tiny_model):
    out, _ = run_script(
        "longtail_real.py",
        tmp_path,
        "--model",
        str(tiny_model),
        "--prompts",
        "6",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "4",
        "--partition-size",
        "2",
        "--sides",
        "static,sync,daskgen",
    )
    assert "static model.generate batches" in out and "daskgen (transformers engine)" in out
    assert "sync batches, same transformers engine" in out
    (png,) = (tmp_path / "results").glob("longtail_real-*.png")
    assert png.stat().st_size > 0


@pytest.mark.timeout(540)
def test_overhead(tmp_path, tiny_model):
    out, text = run_script(
        "overhead.py",
        tmp_path,
        "--repeats",
        "1",
        "--no-profile",
        "--engine-repeats",
        "1",
        "--engine-drivers",
        "direct,worker,daskgen",
        "--prompts",
        "32",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "32",
        "--length-mean",
        "8",
        "--partition-size",
        "16",
        "--model",
        str(tiny_model),
        "--engine-prompts",
        "4",
        "--engine-samples",
        "1",
        "--engine-max-new-tokens",
        "8",
        "--max-requests",
        "4",
        "--engine-partition-size",
        "2",
        "--writer-processes",
        "0,1",
    )
    assert "daskgen / direct write rate, writer processes 0" in out and "daskgen / direct tokens/s" in out
    assert "daskgen / direct write rate, writer processes 1" in out
    cpu_rows = table_rows(text, "run", "writer processes")  # the writer processes' CPU counts with their worker's
    assert [row["writer processes"] for row in cpu_rows] == ["0", "1"]
    in_writers = [float(row["of the workers' CPU: in writer processes"].replace(",", "")) for row in cpu_rows]
    assert in_writers[0] == 0 and in_writers[1] > 0
    assert all(any(k.startswith("worker processes' own CPU") for k in row) for row in cpu_rows)
    for row in cpu_rows:  # a worker's event-loop thread is part of its process; the client's thread of its process
        value = {key.split(" µs")[0]: float(cell.replace(",", "")) for key, cell in row.items() if "µs/sample" in key}
        loop, workers = value["of the worker processes' CPU: their event-loop threads"], value["workers' CPU"]
        own, client = value["of the client process: the run's own thread"], value["client process CPU"]
        assert 0 < loop < workers and 0 < own < client, row
        busy = row["a worker's event-loop thread busy (share of the run's time, mean over the workers)"]
        assert 0 < float(busy) < 1.5, row  # one thread: about one core at most
    assert (
        "The floor / direct write rate, writer processes 1" in out
        and "daskgen / the floor's rate, writer processes 1" in out
    )
    for writers in (0, 1):  # the floor in a thread of the worker, and through a writer process
        assert_floor_stores_what_daskgen_stores(tmp_path / "work", writers)
    assert "same engine on a Dask worker" in out
    assert "engine's host process" in out and "Median cores, the engine's own processes" in out  # where CPU went
    assert_same_tokens_on_every_side(text, sides=3)


def test_the_engine_parts_sides_alternate_from_one_repeat_to_the_next(monkeypatch):
    """The order of the engine part's sides in each repeat (its ``order`` column): as given, then reversed."""
    monkeypatch.syspath_prepend(str(BENCH))
    from overhead_engine import abba

    sides = ["direct", "worker", "daskgen"]
    assert [abba(sides, rep) for rep in range(3)] == [sides, sides[::-1], sides]


@pytest.mark.timeout(300)
def test_a_benchmark_script_is_forked_from_the_cli_zygote(monkeypatch):
    """:func:`run_forked` starts a script through the CLI zygote (docs/testing.md): with the session's environment,
    a script's ``--help`` is forked, not started in a fresh interpreter."""
    monkeypatch.setattr("tests.test_benchmarks.cli_env", lambda: dict(cli_zygote.BASE_ENV))
    before = cli_zygote.STARTS["forked"]
    done = run_forked([sys.executable, str(BENCH / "storage.py"), "--help"], 120)
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr[-2000:]
    assert cli_zygote.STARTS["forked"] == before + 1, dict(cli_zygote.STARTS)


def test_a_used_workdir_is_refused_before_any_run(tmp_path):
    """overhead.py in a ``--workdir`` an earlier run left stores in (they would be resumed, generating nothing to
    time): refused before any run, naming the folder, what it holds and the fix, and leaving the stores as they were."""
    tiny = "--part zarr --repeats 1 --no-profile --prompts 32 --n-samples 1 --max-new-tokens 8 --length-mean 4"
    tiny += " --partition-size 16 --writer-processes 0"
    work, results = tmp_path / "work", tmp_path / "second-results"
    for name in ("daskgen-0-0.zarr", "plan.zarr"):  # what the zarr part of such a run leaves, by name
        (work / name).mkdir(parents=True)
        (work / name / "zarr.json").write_text("{}")
    left = {path: path.stat().st_mtime_ns for path in work.rglob("*")}
    cmd = [sys.executable, str(BENCH / "overhead.py"), "--results", str(results), "--workdir", str(work), *tiny.split()]
    again = run_forked(cmd, 240)
    assert again.returncode == 1, again.stdout + again.stderr
    message = again.stderr.strip().splitlines()[-1]
    assert message == (
        f"--workdir {work} is not empty: it holds daskgen-0-0.zarr, plan.zarr. A benchmark writes fresh stores there "
        "(a store an earlier run left would be resumed instead of timed); give a new or empty folder, or empty this "
        f"one first (rm -r {work}/*)."
    ), again.stderr
    assert "Traceback" not in again.stderr and not results.exists(), "refused before any run: no record"
    assert {path: path.stat().st_mtime_ns for path in work.rglob("*")} == left, "the first run's stores are kept"


def assert_floor_stores_what_daskgen_stores(work: Path, writers: int) -> None:
    """The floor pipeline (``common/pipeline_floor.py``) generated and stored the same samples as daskgen's run of
    the same repeat, with ``writers`` writer processes: it does the same work, so its rate bounds daskgen's."""
    import numpy as np

    from daskgen.store import GenerationStore

    daskgen_store, floor_store = (
        GenerationStore.open(work / "daskgen-0-0.zarr"),
        GenerationStore.open(work / f"floor-0-{writers}.zarr"),
    )
    n = daskgen_store.layout.n_prompts
    names = ("prompt_ids", "prompt_length", "response_ids", "response_mask", "response_length", "finish_reason")
    ours, floors = (
        daskgen_store.read_region(0, n, (*names, "logprobs")),
        floor_store.read_region(0, n, (*names, "logprobs")),
    )
    for name in names:
        assert np.array_equal(ours[name], floors[name]), name
    assert np.array_equal(ours["logprobs"], floors["logprobs"], equal_nan=True)
    assert ours["response_length"].sum() > 0


def table_rows(text: str, *columns: str) -> list[dict[str, str]]:
    """The rows, as dicts, of the record's first Markdown table whose header begins with ``columns``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| " + " | ".join(columns) + " |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return rows


def assert_same_tokens_on_every_side(text: str, sides: int) -> None:
    """Every side of the engine comparison's one repeat generated the same number of tokens (the order the sides
    alternate in over repeats: ``test_the_engine_parts_sides_alternate_from_one_repeat_to_the_next``)."""
    rows = table_rows(text, "repeat", "driver", "order")
    assert len(rows) == sides and {row["repeat"] for row in rows} == {"1"}, rows
    assert len({row["tokens"] for row in rows}) == 1 and int(rows[0]["tokens"]) > 0, rows
    assert "95 % bootstrap interval" in text and "equal on every side in 1 of" in text


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "engine", [pytest.param("sglang", marks=pytest.mark.sglang), pytest.param("vllm", marks=pytest.mark.vllm)]
)
def test_the_engine_parts_settings_for_sglang_and_vllm_are_the_engines_own(engine, monkeypatch):
    """``overhead.py --part engine --engine sglang|vllm``: what the script gives these engines beyond what it gives
    transformers is their engine arguments, checked here against the engine's own (sglang's ``ServerArgs``, vLLM's
    ``AsyncEngineArgs``), as the engine checks them at start.  The rest of the part, both drivers and the record,
    is the same code for every engine and runs in ``test_overhead`` (the records of these engines name their
    commands in benchmarks/README.md)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import overhead_engine

    engine_args = overhead_engine.engine_config(
        overhead_engine.parse_args(["--engine", engine]), "m", Path("x")
    ).engine_args
    check_engine_args = importlib.import_module(f"daskgen.engines.{engine}.args").check_engine_args
    check_engine_args(engine_args)  # against the engine's own argument names (it imports the engine's package)
    with pytest.raises(ConfigError, match="not_an_arg"):  # the check can fail
        check_engine_args({**engine_args, "not_an_arg": 1})


@pytest.mark.timeout(450)
def test_follow(tmp_path):
    """Every part at a tiny size: the lag runs (both sides, alternating), catch-up reads, first batch, order."""
    out, text = run_script(
        "follow.py",
        tmp_path,
        *("--lag-prompts", "8", "--lag-repeats", "2", "--n-samples", "1", "--length-mean", "4"),
        *("--max-new-tokens", "16", "--max-batch", "8", "--partition-size", "2", "--store-prompts", "256"),
        *("--catchup-batch", "64", "--trainer-batch", "4", "--first-partition-size", "2"),
        *("--part", "lag,throughput,first-batch,order", "--order-prompts", "16", "--order-repeats", "1"),
        *("--order-windows", "4"),
        timeout=420,
    )
    lag = table_rows(text, "follower wakes by")
    assert [(row["follower wakes by"].split()[0], row["run"]) for row in lag] == [
        ("poll", "1"),
        ("poll", "2"),
        ("commit", "1"),
        ("commit", "2"),
    ], lag
    for row in lag:
        assert row["prompts"] == "8", row  # every prompt delivered once, in every run
        assert {"commit lag p99 s", "finish lag p50 s", "finish lag p99 s", "finish lag max s"} <= set(row), row
    reads = table_rows(text, "what is read")
    assert len(reads) == 7 and all(row["samples"] == "1,024" for row in reads), reads
    first = table_rows(text, "trainer waits for")
    assert [row["prompts generated"] for row in first] == ["4", "8"], first
    assert "Lag: a daskgen run of 8 prompts" in out
    orders = table_rows(text, "order")
    assert [row["order"].split()[0] for row in orders] == ["input", "commit", "window"], orders
    assert all(row["batches"] == "4" for row in orders), orders  # every prompt delivered, in batches of 4
    assert orders[1]["mean length, whole run"] == orders[2]["mean length, whole run"], "the same samples"


@pytest.mark.timeout(300)
def test_thread_slots(tmp_path):
    """One run per side at a tiny size: a worker of 2 threads; holding threads caps the requests running."""
    tiny = ("--prompts", "16", "--repeats", "1", "--time-scale", "0.2", "--length-mean", "8")
    rows = table_rows(text := run_script("thread_slots.py", tmp_path, *tiny, timeout=270)[1], "partitions", "run")
    labels = ["partitions hold a thread (true)", "partitions free their thread (false, default)", "median", "median"]
    assert [row["partitions"].split(":")[0] for row in rows] == labels, rows
    assert int(rows[0]["peak running"]) <= 2 * 4 * 2, "2 partitions of 4 prompts x 2 samples at most"
    assert "The same token count in every run: True." in text


@pytest.mark.timeout(480)
def test_storage(tmp_path):
    out, _ = run_script(
        "storage.py",
        tmp_path,
        "--prompts",
        "48",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "32",
        "--length-mean",
        "8",
        "--repeats",
        "1",
        "--workers",
        "1",
    )
    for name in ("daskgen store", "JSONL", "JSONL.gz", "pickled batches"):
        assert name in out
    assert "Store bytes / JSONL bytes" in out


@pytest.mark.timeout(300)
def test_resume(tmp_path):
    out, _ = run_script(
        "resume.py",
        tmp_path,
        "--prompts",
        "1000",
        "--repeats",
        "1",
        "--crash-prompts",
        "96",
        "--crash-partition-size",
        "8",
        "--crash-time-scale",
        "0.3",
    )
    assert "store level" in out
    assert "| **prompts regenerated although already done** | 0 |" in out


@pytest.mark.timeout(540)
def test_scaleout(tmp_path):
    out, _ = run_script(
        "scaleout.py",
        tmp_path,
        "--workers",
        "1",
        "--prompts-per-worker",
        "16",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--length-mean",
        "16",
        "--max-new-tokens",
        "64",
        "--time-scale",
        "0.002",
        "--partition-size",
        "8",
        "--client-prompts",
        "64",
        "--commit-rows",
        "2000",
        "--commit-samples",
        "5",
        "--full-speed-prompts",
        "128",
    )
    assert "scaling efficiency" in out and "Client saturation estimate" in out
    # the client part ran with the scheduler in the client process, in daskgen's scheduler process and in
    # processes started by hand, each with Dask's own floor (trivial tasks) measured on the same cluster
    assert "Scheduler in-process" in out and "Scheduler process" in out and "Scheduler separate" in out
    assert out.count("Dask floor: client CPU ms per trivial task") == 3
    assert out.count("scheduler process CPU ms per partition") == 2 and "| nanny process CPU ms per partition" in out
    assert out.count("Dask floor at full speed: client CPU ms per task") == 3
    # and each layout again with instant stand-in partitions: the client near saturation
    assert out.count("full speed: client CPU ms per partition") == 3 and out.count("(at full speed,") == 3


@pytest.mark.timeout(480)
def test_tail(tmp_path):
    out, _ = run_script(
        "tail.py",
        tmp_path,
        "--prompts",
        "64",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--partition-size",
        "8",
        "--max-new-tokens",
        "512",
        "--time-scale",
        "0.002",
    )
    assert "best emulated / measured" in out and out.count("| long tail") == 2 and "| light tail" in out
    assert "default + --length-hints, measured" in out


@pytest.mark.timeout(480)
def test_tail_emulated_only(tmp_path):
    out, _ = run_script(
        "tail.py",
        tmp_path,
        "--prompts",
        "64",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--partition-size",
        "8",
        "--max-new-tokens",
        "512",
        "--emulate-only",
    )
    assert "speed-up from hints" in out and "measured" not in out.split("| distribution")[1].split("\n")[0]


@pytest.mark.timeout(480)
def test_preemption(tmp_path):
    out, _ = run_script(
        "preemption.py",
        tmp_path,
        "--prompts",
        "48",
        "--n-samples",
        "1",
        "--max-new-tokens",
        "256",
        "--partition-size",
        "4",
        "--time-scale",
        "0.05",
        "--length-mean",
        "100",
    )
    assert "tokens regenerated" in out and "| SIGTERM at 50 % + resume |" in out


@pytest.mark.timeout(300)
def test_pack(tmp_path):
    out, _ = run_script("pack.py", tmp_path, "--prompts", "2000", "--repeats", "1", "--workers", "1")
    assert "| files |" in out and "values of the first 4,096 rows identical after packing: yes" in out


@pytest.mark.timeout(300)
def test_delta(tmp_path):
    out, _ = run_script("delta.py", tmp_path, "--models", "tiny", "--lrs", "1e-5", "--steps", "1", "--batch", "2")
    (row,) = [line for line in out.splitlines() if line.startswith("| tiny | 1e-05 | 1 |")]
    assert row.endswith("| yes |"), out  # the rebuild has the published fingerprint


@pytest.mark.timeout(300)
def test_cpu_threads(tmp_path):
    """Both thread counts generate the whole job (every sample its full length); ratios are over the first side."""
    out, text = run_script("cpu_threads.py", tmp_path, "--prompts", "2", "--max-new-tokens", "8", "--repeats", "2")
    rows = table_rows(text, "threads")
    assert [(row["threads"], row["tokens"]) for row in rows] == [("1", "32"), ("2", "32")], rows
    assert rows[0]["tokens/s / first side's"] == rows[0]["CPU per token / first side's"] == "1", rows
    assert float(rows[1]["CPU s"]) > 0 and "the order alternating" in out, out


@pytest.mark.timeout(300)
def test_object_store(tmp_path):
    out, _ = run_script(
        "object_store.py",
        tmp_path,
        "--prompts",
        "256",
        "--run-prompts",
        "64",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "16",
        "--partition-size",
        "32",
        "--workers",
        "1",
    )
    assert "s3:// (moto_server, loopback)" in out and "commit (per partition)" in out and "run wall s" in out


def git(repo: Path, *args: str) -> str:
    """Run git in ``repo`` (a scratch repository with a fixed identity); return its output."""
    ident = ["-c", "user.name=bench-test", "-c", "user.email=bench-test@example.invalid", "-c", "commit.gpgsign=false"]
    return subprocess.run(["git", "-C", str(repo), *ident, *args], capture_output=True, text=True, check=True).stdout


@pytest.fixture
def scratch_repo(tmp_path: Path) -> Path:
    """A git repository with ``daskgen/``, ``benchmarks/`` and ``benchmarks/results/``, all committed."""
    repo = tmp_path / "repo"
    for rel, text in {
        "daskgen/core.py": "A = 1\n",
        "benchmarks/bench.py": "B = 1\n",
        "benchmarks/results/r.md": "x\n",
    }.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    git(repo, "init", "-q")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "start")
    return repo


def test_provenance_clean_tree_names_the_commit(scratch_repo):
    head = git(scratch_repo, "rev-parse", "--short", "HEAD").strip()
    (scratch_repo / "benchmarks" / "results" / "new-record.md").write_text("a record is output, not code\n")
    (scratch_repo / "notes.txt").write_text("outside daskgen/ and benchmarks/\n")
    source = records.provenance(scratch_repo, scratch_repo)
    assert source.clean and source.changed == ()
    assert source.lines() == [
        f"Commit: benchmarks/ at {head}; daskgen code: working tree {scratch_repo} at commit {head}"
    ]


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("benchmarks/bench.py", "B = 2\n"),  # an edited benchmark script
        ("benchmarks/newrecords.py", "C = 1\n"),  # a benchmark script never committed
        ("daskgen/core.py", "A = 2\n"),  # edited daskgen code
        ("daskgen/extra.py", "D = 1\n"),  # daskgen code never committed
    ],
)
def test_provenance_marks_uncommitted_code(scratch_repo, rel, text):
    (scratch_repo / rel).write_text(text)
    source = records.provenance(scratch_repo, scratch_repo)
    assert not source.clean and source.changed == (rel,)
    (commit_line, warning) = source.lines()
    assert warning.startswith("**Not a record of a commit:**") and rel in warning
    record = records.Record("t", started=0.0)
    assert record.file_name("bench", source).endswith("-bench-uncommitted.md")


def test_provenance_of_a_snapshot_still_checks_the_scripts(scratch_repo, tmp_path):
    snap = tmp_path / "snap"
    (snap / "daskgen").mkdir(parents=True)
    (snap / ".git-commit").write_text("abc1234\n")
    assert records.provenance(scratch_repo, snap).clean
    assert "snapshot" in records.provenance(scratch_repo, snap).daskgen
    (scratch_repo / "daskgen" / "core.py").write_text("A = 2\n")  # not the code that runs: daskgen is the snapshot
    assert records.provenance(scratch_repo, snap).clean
    (scratch_repo / "benchmarks" / "bench.py").write_text("B = 2\n")
    assert records.provenance(scratch_repo, snap).changed == ("benchmarks/bench.py",)


def test_a_records_command_names_the_settings_that_change_daskgen(monkeypatch):
    """The command line a record shows carries ``DASKGEN_SRC`` and every ``DASK_DASKGEN__*`` setting it ran with."""
    monkeypatch.setenv("DASK_DASKGEN__WORKER_GC__THRESHOLD", "10000")
    monkeypatch.setenv("DASKGEN_SRC", "/tmp/some checkout")
    monkeypatch.setenv("DASK_DISTRIBUTED__WORKER__DAEMON", "False")  # not daskgen's: not shown
    monkeypatch.delenv("DASK_DASKGEN__LOCAL_CPU_THREADS")  # the test session's own (tests/conftest.py)
    monkeypatch.setattr(sys, "argv", [str(BENCH / "overhead.py"), "--repeats", "2"])
    line = records.command_line()
    env = "DASKGEN_SRC='/tmp/some checkout' DASK_DASKGEN__WORKER_GC__THRESHOLD=10000"
    assert line == f"{env} python benchmarks/overhead.py --repeats 2"


def test_a_record_names_the_file_system_of_its_stores(tmp_path):
    """A record says where its stores were and on what file system: a RAM disk and a disk give different times."""
    assert records.file_system(Path("/proc/self")) == "proc"  # the deepest mount holding the path, not "/"
    assert records.file_system(Path("/")) not in ("proc", "unknown")
    rec = records.Record("t")
    rec.workdir = tmp_path
    text = rec.render(tmp_path, records.provenance(REPO, REPO))
    assert f"Stores: in {tmp_path} ({records.file_system(tmp_path)} file system)." in text


def test_no_git_checkout_is_not_a_commit(tmp_path):
    (tmp_path / "daskgen").mkdir()
    assert not records.provenance(tmp_path, tmp_path).clean


RECORD_LINK = re.compile(r"\]\(((?:\.\./)*(?:benchmarks/)?results/[^)#\s]+)\)")


def test_figures_link_to_record_files_that_exist():
    """Every link to a record in the docs resolves, and the current-figures table quotes only clean records."""
    docs = [REPO / "README.md", BENCH / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    links = [(doc, link) for doc in docs for link in RECORD_LINK.findall(doc.read_text())]
    assert len(links) >= 10, links
    missing = [f"{doc.name}: {link}" for doc, link in links if not (doc.parent / link).is_file()]
    assert not missing, missing
    quoted = [link for doc, link in links if doc == BENCH / "README.md"]
    assert quoted and not [link for link in quoted if "-uncommitted" in link], quoted
    for link in quoted:
        assert "uncommitted changes" not in (BENCH / link).read_text(), link  # both the old and the new marking


@pytest.mark.timeout(300)
def test_export(tmp_path):
    out, record = run_script("export.py", tmp_path, "--prompts", "128", "--n-samples", "2", "--partition-size", "16")
    for step in (
        "export parquet, no text",
        "export jsonl, no text",
        "export tensordict",
        "export zip",
        "report (HTML)",
    ):
        assert f"| {step}" in out, step
    assert "| length_stats() + throughput() |" in record


@pytest.mark.timeout(300)
def test_checksums(tmp_path):
    out, record = run_script("checksums.py", tmp_path, "--prompts", "256", "--repeats", "1")
    for measure in ("whole run", "engines ready to last commit", "full response_ids column"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {measure}"))
        ratio = float(row.rstrip(" |").rsplit("|", 1)[1])
        assert 0 < ratio < 100, row  # both sides ran and were timed (no figure is asserted)
    assert "checksummed (A)" in record and "no checksum (B)" in record


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_refresh(tmp_path, tiny_model):
    out, record = run_script(
        "refresh.py",
        tmp_path,
        *("--model", str(tiny_model), "--workers", "1", "--prompts", "400", "--policies", "continue"),
        *("--interval", "3", "--steady", "1", "--versions", "1", "--bin", "1"),
    )
    assert "### `refresh: continue`" in out and "| steady 1 |" in out and "| after publish 1 |" in out
    (version_row,) = table_rows(record, "version")
    assert (version_row["version"], version_row["workers loaded"]) == ("1", "1")  # the worker loaded version 1
    (cost,) = table_rows(record, "publish", "policy", "version")  # the pause, of it the wait for the step in progress
    kinds = ("pause s", "step wait s", "pause without the step wait s")
    pause, wait, rest = (float(cost[f"{k}, slowest worker"]) for k in kinds)
    assert 0 <= wait < pause and rest == pytest.approx(pause - wait, abs=0.01 * pause), cost  # one worker
    ratios = (
        float(cost[k].replace(",", ""))
        for k in ("pause without the step wait / load from memory", "pause / load from memory")
    )
    assert 0 < next(ratios) <= next(ratios), cost
    (carried,) = table_rows(record, "version", "requests continued, all workers")  # what the refresh interrupted
    requests, tokens = (
        int(carried["requests continued, all workers"]),
        int(carried["tokens to prefill again, all workers"].replace(",", "")),
    )
    # each request carries at least its prompt; at this size the worker may load the version between two of its
    # partitions, with nothing in flight to interrupt (the refresh tests check what a refresh interrupts)
    assert tokens > requests if requests else tokens == 0, carried
    rate = float(re.search(r"one torch thread: ([0-9,]+) prompt tokens/s", record).group(1).replace(",", ""))
    assert float(carried["their prefill at the engine's rate (s)"]) == pytest.approx(tokens / rate, rel=0.01), carried


@pytest.mark.timeout(300)
def test_refresh_check_loads_weights_in_place(tiny_model):
    from benchmarks.refresh_check import refresh_check

    prompts = [[1, 2, 3, 4, 5], [17, 230, 4051, 88], [900, 12, 7], [3000, 3001, 3002, 3003, 3004, 3005]]
    result = refresh_check("transformers", str(tiny_model), {"device": "cpu"}, prompts, 12)
    assert result["refreshed_equal_fresh"] == len(prompts) and result["changed_by_refresh"] >= 1, result


@pytest.mark.timeout(1500)
@pytest.mark.parametrize(
    "engine",
    [
        pytest.param("transformers", marks=pytest.mark.proves("transformers", "refresh_with_lora")),
        pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.proves("vllm", "refresh_with_lora")]),
    ],
)
def test_a_refresh_under_adapters_applies_them_to_the_new_weights(tiny_model, engine):
    """``validate_gpu.py --lora --refresh``'s step on a CPU: after the engine holding an adapter loads new weights in
    place, its adapter and base answers equal a fresh engine's on the new weights with the same adapter (that an
    adapter's answers equal it merged into its weights is the conformance suite's ``test_feature_lora``)."""
    from benchmarks.refresh_lora_check import refresh_lora_check

    if engine == "vllm":
        from tests.test_engine_vllm import _SharedVLLM, tiny_model_path

        model, args = tiny_model_path(), dict(_SharedVLLM.engine_args)
    else:
        model, args = str(tiny_model), {"device": "cpu"}
    prompts = [[1, 2, 3, 4, 5], [17, 230, 4051, 88], [900, 12, 7], [3000, 3001, 3002, 3003, 3004, 3005]]
    result = refresh_lora_check(engine, model, args, prompts, 12)
    assert result["lora_equal_fresh_new"] == result["base_equal_new"] == len(prompts), result
    assert result["lora_changed_by_refresh"] >= 1, result


@pytest.mark.timeout(300)
def test_prefix_dispatch(tmp_path):
    args = ("--questions", "8", "--systems", "2", "--repeats", "1", "--cache-tokens", "4096", "--max-new-tokens", "4")
    out, record = run_script("prefix_dispatch.py", tmp_path, *args)
    heavy = next(line for line in out.splitlines() if line.startswith("| prefix-heavy, shuffled"))
    assert "A order; B prefix" in heavy, heavy  # the prefix side went by prefix (no figure is asserted)
    plain = next(line for line in out.splitlines() if line.startswith("| no shared prefix"))
    assert "A order; B order" in plain, plain  # auto kept input order without shared prefixes
    assert "prompt tokens computed" in record
    busy = [float(x) for x in heavy.split(" | ")[-2].split(";")]  # the busiest engine's model s, both sides
    assert "busiest engine's model s" in record and min(busy) > 0, heavy


@pytest.mark.timeout(300)
def test_worker_path(tmp_path):
    """The worker's result path, stage by stage, in one process: every stage ran and was timed (no figure is
    asserted), the regions the writer process wrote are the ones the worker wrote itself."""
    out, record = run_script("worker_path.py", tmp_path, "--prompts", "256", "--repeats", "2")
    for stage in ("engine alone", "generation", "placement", "hand-over to a writer process: the worker's side"):
        row = next(line for line in out.splitlines() if line.startswith(f"| {stage} |"))
        values = [float(v) for v in row.strip(" |").split("|")[1:]]
        assert len(values) == 3 and all(v > 0 for v in values), row
    assert "daskgen's own work per sample on a worker besides its engine" in record
    assert "equals every region handed over: True." in record


@pytest.mark.timeout(480)
def test_images(tmp_path):
    """One run per side at a tiny size: the engine worker preprocesses every image itself, or a CPU worker does
    them all; the store holds each distinct image once; the samples of a prompt reference one pixel array."""
    args = ("--prompts", "4", "--sides", "0:1,1:1", "--distinct", "2", "--prompts-shared", "4", "--n-samples", "2")
    _, record = run_script("images.py", tmp_path, *args, timeout=450)
    engine_side, cpu_side = table_rows(record, "preprocessed on", "run")
    assert (engine_side["images, engine worker"], engine_side["images, CPU workers"]) == ("4", "0"), engine_side
    assert (cpu_side["images, engine worker"], cpu_side["images, CPU workers"]) == ("0", "4"), cpu_side
    assert engine_side["prompts"] == cpu_side["prompts"] == "4"
    stored, once, per_sample, _ = table_rows(record, "what", "objects")
    assert stored["objects"] == once["objects"] == "2" and stored["bytes"] == once["bytes"], (stored, once)
    assert per_sample["objects"] == "8" and "Deduplication ratio" in record
    shared, copies, _ = table_rows(record, "side", "held (tracemalloc) bytes")
    referenced = [int(row["bytes of the pixel arrays referenced"].replace(",", "")) for row in (shared, copies)]
    assert referenced[1] == 4 * referenced[0], referenced  # 4 prompts x 2 samples over 2 distinct images
    assert "A node of 8 GPUs and 100 cores, on paper" in record
