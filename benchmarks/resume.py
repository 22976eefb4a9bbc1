"""Benchmark 4: resume cost — knowing the pending set of a 1M-prompt store, and a crash-and-resume run.

Part ``pending`` — a store of ``--prompts`` (default 1,000,000) prompts made by ``plan.prepare`` from a
real JSONL input (so attrs, coordinates and chunking are what a run writes), then ``status`` set for 70%
of the partitions as a crashed run leaves it: everything before the crash point done except a few
partitions that were in flight, plus a few done beyond it.  (``status`` is written in one go instead of
by 11k client commits, and data chunks stay unwritten: finding the pending set reads neither.)  Timed:

* **store level** — what a resume needs from the store: read the attrs, compare them with the run's,
  read the ``status`` mask, list the pending rows and the partitions that have any;
* **xarray** — ``daskgen.open_store(path).status`` loaded and counted (a user checking progress);
* **runner level** — ``plan.prepare`` on the same, unchanged input (reuses the scan the first run stored),
  and again after ``touch``-ing it (reads, validates and tokenizes every prompt, fingerprints the input,
  then the store part), and ``plan.pending_tasks``.

Part ``crash`` — the real CLI (``python -m daskgen run``) with the ``simulated`` engine wrapped in
daskgen's labelled test double ``RecordingEngine`` (it logs every generate call), killed with SIGKILL
(the whole process tree) once ``--kill-at`` of the prompts are committed, then the same command again.
Counted: prompts the second run generated that were already done at the kill (must be 0), prompts it
had to generate, and whether the rows done before the crash are byte-identical afterwards.

    python benchmarks/resume.py                    # ~2-3 minutes
    python benchmarks/resume.py --prompts 100000 --crash-prompts 512 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records

from daskgen.config import RunConfig

MAX_SHOWN = 5

TITLE = "Resume: pending set of a 1M-prompt store, crash and resume"


def write_input(path: Path, n: int) -> None:
    """``n`` short prompt rows with ids, as JSONL."""
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"r{i}", "prompt": f"Item {i}: classify {i * 2654435761 % 100003}."}) + "\n")


def pending_config(a: argparse.Namespace, store: Path, prompts: Path) -> RunConfig:
    """Settings of the 1M-prompt store (simulated engine: a byte tokenizer, no model needed)."""
    return RunConfig(
        prompts=str(prompts),
        store=str(store),
        model="simulated-resume",
        engine="simulated",
        n_samples=4,
        max_new_tokens=1024,
        max_prompt_tokens=64,
        partition_size=a.partition_size,  # temperature 1, seed 0: RunConfig's defaults
        progress=False,
    )


def mark_done(store_path: Path, n: int, partition: int, fraction: float, seed: int = 0) -> np.ndarray:
    """Set ``status`` (and ``committed_at``) as a run that crashed at ``fraction`` of its partitions leaves it."""
    import zarr

    rng = np.random.default_rng(seed)
    n_parts = -(-n // partition)
    cut = round(fraction * n_parts)
    done = np.zeros(n_parts, dtype=bool)
    done[:cut] = True
    window = min(16, cut, n_parts - cut)
    if window:
        done[rng.choice(np.arange(cut - 4 * window, cut), window, replace=False)] = False  # were in flight
        done[rng.choice(np.arange(cut, min(n_parts, cut + 4 * window)), window, replace=False)] = True
    status = np.repeat(done.astype("int8"), partition)[:n]
    zarr.open_array(str(store_path / "status"), mode="r+")[:] = status
    now = time.time()
    zarr.open_array(str(store_path / "committed_at"), mode="r+")[:] = np.where(status == 1, now, np.nan)
    return status


def store_level_pending(store_path: Path, wanted: Any) -> tuple[int, int]:
    """Attrs check + status read + pending rows and partitions: (pending rows, partitions to run)."""
    from daskgen import store
    from daskgen.store.resumable import check_resumable

    opened = store.GenerationStore.open(store_path)
    check_resumable(opened, wanted)
    layout = opened.layout
    status = opened.read_status()
    pending = np.flatnonzero(status == store.PENDING)
    partitions = np.unique(pending // layout.partition_size)
    return len(pending), len(partitions)


def xarray_pending(store_path: Path) -> int:
    """Pending rows through the user-facing xarray view."""
    from daskgen import open_store

    return int((open_store(store_path).status.values == 0).sum())


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, float, Any]:
    """(median, first, value) of ``repeats`` timed calls."""
    times, value = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times[0], value


def part_pending(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """The 1M-prompt store: time to the pending set at store, xarray and runner level."""
    from daskgen import store
    from daskgen.client.plan import pending_tasks, prepare

    prompts = work / "prompts.jsonl"
    store_path = work / "big.zarr"
    t0 = time.perf_counter()
    write_input(prompts, a.prompts)
    t_input = time.perf_counter() - t0
    config = pending_config(a, store_path, prompts)
    t0 = time.perf_counter()
    prepare(config)
    t_create = time.perf_counter() - t0
    status = mark_done(store_path, a.prompts, a.partition_size, a.done_fraction)
    wanted = store.read_store_attrs(store_path)
    expect = int((status == 0).sum())

    med, first, (n_pending, n_parts) = median_time(lambda: store_level_pending(store_path, wanted), a.repeats)
    xmed, xfirst, x_pending = median_time(lambda: xarray_pending(store_path), a.repeats)
    t0 = time.perf_counter()
    prepare(config)  # unchanged input: the scan stored by the first prepare is reused
    t_prepare = time.perf_counter() - t0
    os.utime(prompts)  # a touched input is scanned again
    t0 = time.perf_counter()
    plan = prepare(config)
    t_rescan = time.perf_counter() - t0
    t0 = time.perf_counter()
    next(iter(pending_tasks(plan, plan.store.read_status())))
    t_first = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows_in_tasks = sum(len(t.rows) for t in pending_tasks(plan, plan.store.read_status()))
    t_tasks = time.perf_counter() - t0
    if not (n_pending == x_pending == rows_in_tasks == expect):
        raise SystemExit(
            f"pending counts disagree: store {n_pending}, xarray {x_pending}, tasks {rows_in_tasks}, expected {expect}"
        )
    status_objects = len(list((store_path / "status").rglob("c/*")))
    n_all = -(-a.prompts // a.partition_size)
    rec.note(
        f"Part pending: {a.prompts:,} prompts, partitions of {a.partition_size} ({n_all:,} partitions), "
        f"{1 - expect / a.prompts:.1%} done, {expect:,} pending rows in {n_parts:,} partitions; "
        f"`status` is {status_objects} chunk object(s). Setup: writing the JSONL {t_input:.1f} s, first "
        f"`prepare` (validate + tokenize + create the store) {t_create:.1f} s."
    )
    rec.table(
        ["step", "median s", "first call s", f"target ≤ {a.target_ms:g} ms"],
        [
            ["store level: attrs check + status read + pending rows/partitions", med, first, med * 1000 <= a.target_ms],
            ["xarray: open_store(path).status == 0", xmed, xfirst, xmed * 1000 <= a.target_ms],
            [
                f"plan.prepare, unchanged {a.prompts:,}-row input (stored scan reused; then the store part)",
                t_prepare,
                t_prepare,
                t_prepare * 1000 <= a.target_ms,
            ],
            [
                "plan.prepare after `touch`-ing the input (reads, validates, tokenizes, fingerprints it; then the "
                "store part)",
                t_rescan,
                t_rescan,
                t_rescan * 1000 <= a.target_ms,
            ],
            ["plan.pending_tasks: first partition task ready", t_first, t_first, None],
            [
                "plan.pending_tasks: all partition tasks built (re-reads and tokenizes pending rows)",
                t_tasks,
                t_tasks,
                None,
            ],
        ],
    )


# --------------------------------------------------------------------------- crash and resume


def cli_env() -> dict[str, str]:
    """Environment for the CLI subprocesses (repository importable, no progress bars)."""
    env = dict(os.environ)
    env.update(PYTHONUNBUFFERED="1", TQDM_DISABLE="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(records.DASKGEN_SRC), env.get("PYTHONPATH", "")])
    return env


def crash_command(a: argparse.Namespace, prompts: Path, store_path: Path, log: Path) -> list[str]:
    """The ``daskgen run`` command used for both the crashed run and the resume."""
    return [
        sys.executable,
        "-m",
        "daskgen",
        "run",
        "--prompts",
        str(prompts),
        "--store",
        str(store_path),
        "--model",
        "sim",
        "--engine",
        "daskgen.testing.engines:RecordingEngine",
        "--engine-arg",
        "inner=simulated",
        "--engine-arg",
        f"log_path={log}",
        "--engine-arg",
        f"time_scale={a.crash_time_scale}",
        "--engine-arg",
        "length_dist=lognormal",
        "--engine-arg",
        "length_mean=48",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "256",
        "--max-prompt-tokens",
        "64",
        "--partition-size",
        str(a.crash_partition_size),
        "--temperature",
        "1.0",
        "--seed",
        "11",
        "--n-workers",
        "2",
        "--window",
        "2",
        "--no-progress",
    ]


def logged_rows(log: Path, offset: int = 0) -> list[int]:
    """Prompt rows of the generate calls logged after byte ``offset``."""
    if not log.exists():
        return []
    with log.open() as fh:
        fh.seek(offset)
        return [int(line.split()[0].split("-")[0][1:]) for line in fh if line.strip()]


def part_crash(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """SIGKILL a real run mid-way, rerun the same command, count regenerated prompts."""
    from daskgen import store

    prompts = work / "crash.jsonl"
    write_input(prompts, a.crash_prompts)
    store_path, log = work / "crash.zarr", work / "calls.log"
    cmd = crash_command(a, prompts, store_path, log)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=cli_env(), start_new_session=True, text=True
    )
    t0 = time.perf_counter()
    done = 0
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the run ended before the kill point (rc {proc.returncode}):\n{proc.stdout.read()}")
        if store.read_store_attrs(store_path) is not None:
            done = int((store.GenerationStore.open(store_path).read_status() == store.DONE).sum())
            if done >= a.kill_at * a.crash_prompts:
                break
        if time.perf_counter() - t0 > a.crash_timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            raise SystemExit("the run did not reach the kill point in time")
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    t_kill = time.perf_counter() - t0
    status_at_kill = store.GenerationStore.open(store_path).read_status()
    done_rows = np.flatnonzero(status_at_kill == store.DONE)
    before = store.GenerationStore.open(store_path).read_region(
        0, a.crash_prompts, ("response_ids", "response_length", "finish_reason", "committed_at")
    )
    first_run_calls = logged_rows(log)
    offset = log.stat().st_size if log.exists() else 0

    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=cli_env(), timeout=a.crash_timeout)
    t_resume = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"resume failed (rc {res.returncode}):\n{res.stdout}\n{res.stderr}")
    rerun_rows = set(logged_rows(log, offset))
    after = store.GenerationStore.open(store_path).read_region(
        0, a.crash_prompts, ("response_ids", "response_length", "finish_reason", "committed_at")
    )
    final = store.GenerationStore.open(store_path).read_status()
    regenerated = sorted(rerun_rows & set(done_rows.tolist()))
    pending_at_kill = set(np.flatnonzero(status_at_kill != store.DONE).tolist())
    identical = all(np.array_equal(before[k][done_rows], after[k][done_rows], equal_nan=True) for k in before)
    in_flight_lost = len(set(first_run_calls) - set(done_rows.tolist()))
    rec.note(
        f"Part crash: `{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}` "
        f"({a.crash_prompts} prompts, partitions of {a.crash_partition_size}, 2 workers, simulated engine at "
        f"time_scale {a.crash_time_scale}); SIGKILL of the process group after {t_kill:.1f} s with "
        f"{len(done_rows)} prompts committed; the same command rerun took {t_resume:.1f} s."
    )
    rec.table(
        ["measure", "value"],
        [
            ["prompts done at the kill", len(done_rows)],
            ["prompts started but not committed at the kill (their work is lost and redone)", in_flight_lost],
            ["prompts the resumed run generated", len(rerun_rows)],
            ["pending prompts at the kill", len(pending_at_kill)],
            ["**prompts regenerated although already done**", len(regenerated)],
            ["rows done before the crash unchanged afterwards (ids, lengths, reasons, committed_at)", identical],
            ["all prompts done after the resume", bool((final == store.DONE).all())],
            ["resume exit status", res.returncode],
        ],
    )
    if regenerated:
        rec.note(f"Regenerated rows (first {MAX_SHOWN}): {regenerated[:MAX_SHOWN]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="pending,crash", help="comma-separated: pending, crash")
    cli.add_flags(p, partition_size=64, done_fraction=0.7, repeats=5)
    p.add_argument("--prompts", type=int, default=1_000_000, help="rows of the big store")
    p.add_argument("--target-ms", type=float, default=100.0)
    p.add_argument("--crash-prompts", type=int, default=1024)
    p.add_argument("--crash-partition-size", type=int, default=32)
    p.add_argument("--crash-time-scale", type=float, default=0.5)
    p.add_argument("--kill-at", type=float, default=0.4, help="fraction of prompts committed before SIGKILL")
    p.add_argument("--crash-timeout", type=float, default=240.0)
    return cli.parse(p, argv)


PARTS = {"pending": part_pending, "crash": part_crash}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
