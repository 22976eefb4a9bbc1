"""Benchmark: feeding a trainer while the run goes on (``daskgen.follow``) — lag, catch-up reads, first batch.

Three parts, one record:

* ``lag``: a real ``daskgen run`` (subprocess, the simulated engine in real time, lognormal lengths, its
  own LocalCluster) writes a local store while a follower in this process (``batch_prompts=1``, the
  default poll interval) takes every commit.  Per delivered prompt, two lags (same machine, same clock):
  delivery time minus ``committed_at`` (the client's clock when it began the commit), and delivery time
  minus the moment its last sample finished in the engine (the engine runs inside the labelled recording
  wrapper of ``daskgen.testing.engines``, whose timing log has each request's wall-clock end).  Second
  side: the same run on a cluster the benchmark starts, the follower subscribed to the run's commit
  events (``client=``).  ``--lag-repeats`` runs per side, the sides alternating.  Goal: p99 <= 1 s.
* ``throughput``: a catching-up consumer.  A synthetic store (``common.synthetic_store.build_store``: the layout a run
  creates, every partition done, lognormal lengths) is read start to end by a fresh cursor: token
  arrays only (``fields=("response_ids", "response_length")``, xarray), every data array (xarray), the
  verl tensor fields (``tensordict``, ``dataproto``; and ``tensordict`` with ``pad="batch"``) and dicts
  (``rows``).  Samples per second and per CPU second, after one warm-up pass (imports, page cache).
  Goals: >= 100k samples/s of token arrays and of the tensor formats, >= 50k of rows.
* ``profile`` (asked for by name): where the catching-up consumer's CPU time goes, per stage of a batch (reading
  the arrays, assembling the format, acknowledging, ...) and per trainer format; with ``DASKGEN_SRC`` it profiles
  another commit's daskgen (a stage that code has not is left out).
* ``first-batch``: a long-tailed simulated job (lognormal lengths, sigma 1.2).  Synchronous side: a run of
  exactly B prompts, time from launch until its last prompt is committed (a synchronous trainer waits
  for the whole batch, so for its slowest sample).  Streaming side: a run over 2 B prompts
  (``--pool-factor``), time from launch until the follower hands out its first batch of B prompt groups.
  Both runs join one cluster started beforehand.
* ``order``: the length bias of the delivery order.  A long-tailed simulated job (lognormal lengths,
  partitions of one prompt) is followed by several followers at once (threads, one cursor each, batches of
  B prompt groups): commit order, and input order within windows of ``--order-windows`` prompts.  Per
  follower: the mean response length of the samples in its first 25 % of batches against the whole run's
  (what a trainer consuming mid-run sees first), the time to that first quarter, and how long the window's
  head held prompts back (summed, and the longest before one batch).  ``--order-repeats`` runs.

    python benchmarks/follow.py
    python benchmarks/follow.py --no-record           # print only
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records, synthetic_store
from common.order_lengths import follow_lengths, input_row, order_row
from common.stage_clocks import stage_clocks

SIMULATED = [
    *("--model", "sim", "--engine-arg", "time_scale=1"),
    *("--engine-arg", "length_dist=lognormal", "--max-prompt-tokens", "128", "--no-progress"),
]

TITLE = "Follow: streaming finished samples to a trainer"


def write_prompts(path: Path, n: int) -> Path:
    """``n`` chat prompts with ids."""
    with path.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}], "id": f"q{i}"}) + "\n")
    return path


def launch(args: list[str], extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python -m daskgen ARGS`` importing daskgen from ``DASKGEN_SRC``, with ``extra_env`` set for it only."""
    import os

    path = os.pathsep.join([str(records.DASKGEN_SRC), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, **(extra_env or {}), "PYTHONPATH": path}
    return subprocess.Popen(
        [sys.executable, "-m", "daskgen", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def finished(proc: subprocess.Popen, what: str) -> None:
    """Wait for a run; stop the benchmark with its output when it failed."""
    out, _ = proc.communicate(timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{out[-4000:]}")


def engine_args(timing_log: Path | None) -> list[str]:
    """The simulated engine; with ``timing_log``, inside the labelled recording wrapper that appends each
    request's ``id start end tokens`` (wall-clock seconds) to that file as it finishes."""
    if timing_log is None:
        return ["--engine", "simulated"]
    wrapper = ("--engine", "daskgen.testing.engines:RecordingEngine", "--engine-arg", "inner=simulated")
    return [*wrapper, "--engine-arg", f"timing_log={timing_log}"]


def run_args(
    a: argparse.Namespace,
    prompts: Path,
    store: Path,
    *,
    n_samples: int,
    sigma: float,
    partition_size: int = 0,
    timing_log: Path | None = None,
) -> list[str]:
    """``daskgen run`` arguments of a simulated job over ``prompts`` into ``store``."""
    return [
        "run",
        *("--prompts", str(prompts), "--store", str(store), *engine_args(timing_log), *SIMULATED),
        *("--engine-arg", f"length_mean={a.length_mean}", "--engine-arg", f"length_sigma={sigma}"),
        *("--engine-arg", f"max_batch={a.max_batch}", "--max-new-tokens", str(a.max_new_tokens)),
        *("--n-samples", str(n_samples), "--partition-size", str(partition_size or a.partition_size)),
    ]


# --------------------------------------------------------------------------- lag


def follow_deliveries(store: Path, client: Any = None) -> dict[int, tuple[float, float]]:
    """Follow ``store`` to its end, one prompt per batch: prompt row -> (delivery time, its ``committed_at``)."""
    import daskgen
    from daskgen.formats.read import read_rows

    delivered: dict[int, tuple[float, float]] = {}
    with daskgen.follow(store, batch_prompts=1, fields=("response_length",), timeout=600, client=client) as follower:
        for batch in follower:
            now = time.time()
            assert follower.store is not None
            committed = read_rows(follower.store, batch.prompts, ("committed_at",))["committed_at"]
            delivered.update({int(row): (now, float(t)) for row, t in zip(batch.prompts, committed, strict=True)})
    return delivered


def finished_in_engine(timing_log: Path) -> dict[int, float]:
    """Prompt row -> when its last sample finished in the engine (the recording wrapper's timing log)."""
    ends: dict[int, float] = {}
    for line in timing_log.read_text().splitlines():
        request_id, _, end, _ = line.split()
        row = int(request_id[1:].split("-")[0])  # request ids are p<row>-s<sample>
        ends[row] = max(ends.get(row, 0.0), float(end))
    return ends


def lag_row(label: str, repeat: int, delivered: dict[int, tuple[float, float]], ends: dict[int, float]) -> list:
    """One table row: commit-to-delivery and finish-to-delivery lag percentiles of one run."""
    commit = [now - committed for now, committed in delivered.values()]
    finish = [now - ends[row] for row, (now, _) in delivered.items()]
    figures = [f(lags) for lags in (commit, finish) for f in (median_of, p99_of, max)]
    return [label, repeat, len(delivered), *figures]


def median_of(values: list[float]) -> float:
    """The 50th percentile of ``values``."""
    return records.percentile(values, 50)


def p99_of(values: list[float]) -> float:
    """The 99th percentile of ``values``."""
    return records.percentile(values, 99)


def part_lag(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Commit-to-delivery and finish-to-delivery lag, polling and with commit events, sides alternating."""
    from daskgen import tunables

    prompts = write_prompts(work / "lag.jsonl", a.lag_prompts)
    labels = {"poll": f"poll every {tunables.seconds('follow.poll-interval'):g} s", "events": "commit events"}
    rows = []
    for repeat in range(1, a.lag_repeats + 1):
        for side in ("poll", "events") if repeat % 2 else ("events", "poll"):
            store, timing = work / f"lag-{side}-{repeat}.zarr", work / f"timing-{side}-{repeat}.log"
            args = run_args(a, prompts, store, n_samples=a.n_samples, sigma=0.8, timing_log=timing)
            if side == "poll":
                proc = launch([*args, "--n-workers", "1"])
                delivered = follow_deliveries(store)
            else:
                delivered, proc = events_side(args, store)
            finished(proc, f"the {side} run")
            rows.append(lag_row(labels[side], repeat, delivered, finished_in_engine(timing)))
    rows.sort(key=lambda row: (row[0] != labels["poll"], row[1]))
    rec.note(
        f"Lag: a daskgen run of {a.lag_prompts} prompts x {a.n_samples} samples (simulated engine in real time, "
        f"lognormal lengths mean {a.length_mean}, {a.max_batch} requests at once, partitions of {a.partition_size}, "
        "commit interval 0.5 s) into a local store; a follower in the benchmark process takes one prompt per "
        f"batch; {a.lag_repeats} runs per side, the sides alternating. Commit lag = delivery time - committed_at "
        "(the client's clock when it began the commit); finish lag = delivery time - when the prompt's last "
        "sample finished in the engine (the recording wrapper's timing log, written in the worker process)."
    )
    header = ["follower wakes by", "run", "prompts", "commit lag p50 s", "commit lag p99 s", "commit lag max s"]
    rec.table([*header, "finish lag p50 s", "finish lag p99 s", "finish lag max s"], rows)


def events_side(args: list[str], store: Path) -> tuple[dict[int, tuple[float, float]], subprocess.Popen]:
    """The run joins a cluster started here; the follower subscribes to its commit events."""
    import dask
    from distributed import Client, LocalCluster

    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=1, threads_per_worker=16, processes=True, dashboard_address=":0") as cluster,
        Client(cluster) as client,
    ):
        proc = launch([*args, "--scheduler-address", cluster.scheduler_address])
        delivered = follow_deliveries(store, client)
        proc.wait(timeout=600)
    return delivered, proc


# --------------------------------------------------------------------------- throughput

TOKENS = ("response_ids", "response_length")
#: What a catching-up consumer reads: label -> (format, fields, prompts per batch; 0: ``--catchup-batch``).
READS = {
    "token arrays (response_ids, response_length), xarray": ("xarray", TOKENS, 0),
    "token arrays, xarray, batches of 1024 prompts": ("xarray", TOKENS, 1024),
    "every data array, xarray": ("xarray", None, 0),
    "verl fields, tensordict": ("tensordict", None, 0),
    "verl fields, DataProto": ("dataproto", None, 0),
    "verl fields, tensordict, pad to the batch's longest": ("tensordict", None, -1),
    "rows (dicts)": ("rows", None, 0),
}


def read_through(
    store: Path, cursor: str, fmt: str, fields: Any, batch: int, pad: str = "store"
) -> tuple[int, float, float]:
    """Samples read by a fresh cursor from start to end, the seconds it took and the CPU seconds of this process
    (every thread: Zarr decodes in threads of its own)."""
    import daskgen

    t0, cpu0, samples = time.perf_counter(), time.process_time(), 0
    padding = {"pad": pad} if pad != "store" else {}  # daskgen before pad= (DASKGEN_SRC) pads to the store
    reads = daskgen.follow(store, batch_prompts=batch, cursor=cursor, format=fmt, fields=fields, wait=False, **padding)
    for b in reads:
        samples += int((b.data["finish_reason"] >= 0).sum()) if fmt == "xarray" and fields is None else 0
        samples += len(b.data) if fmt in ("rows", "dataproto") else b.data.batch_size[0] if fmt == "tensordict" else 0
        samples += int(b.data["response_length"].size) if fmt == "xarray" and fields is not None else 0
    return samples, time.perf_counter() - t0, time.process_time() - cpu0


def part_throughput(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """A catching-up consumer's read rate per format."""
    store = work / "catchup.zarr"
    built = synthetic_store.build_store(
        argparse.Namespace(prompts=a.store_prompts, **synthetic_store.DEFAULTS),
        store,
    )
    rows = []
    for number, (label, (fmt, fields, batch)) in enumerate(READS.items()):
        pad, batch = ("batch", 0) if batch < 0 else ("store", batch)
        batch = batch or a.catchup_batch
        read_through(store, f"warm-{number}", fmt, fields, batch, pad)  # imports, page cache
        samples, seconds, cpu = read_through(store, f"bench-{number}", fmt, fields, batch, pad)
        rows.append([label, samples, seconds, samples / seconds, cpu, samples / cpu])
    rec.note(
        f"Throughput: a synthetic local store of {a.store_prompts:,} prompts x 4 samples (prompts and responses "
        f"up to 256 tokens, lognormal lengths mean 120, partitions of 64, built in {built['seconds']:.0f} s), "
        f"read start to end by a fresh cursor in batches of {a.catchup_batch} prompts unless said otherwise "
        "(acknowledged: each batch also writes and syncs the cursor), after one warm-up pass with another cursor. "
        "CPU s: this process's CPU time during the read, every thread (Zarr decodes in threads of its own)."
    )
    rec.table(["what is read", "samples", "seconds", "samples/s", "CPU s", "samples per CPU s"], rows)


# --------------------------------------------------------------------------- profile


def part_profile(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Where a catching-up consumer's CPU time goes, per stage of a batch and per format."""
    store = work / "profile.zarr"
    synthetic_store.build_store(argparse.Namespace(prompts=a.store_prompts, **synthetic_store.DEFAULTS), store)
    rows = []
    for fmt in ("tensordict", "dataproto", "rows"):
        read_through(store, f"warm-{fmt}", fmt, None, a.catchup_batch)
        with stage_clocks() as spent:
            samples, seconds, cpu = read_through(store, f"profile-{fmt}", fmt, None, a.catchup_batch)
        for label, used in [*spent.items(), ("the rest (the follower's own loop)", cpu - sum(spent.values()))]:
            rows.append([fmt, label, used, 1e6 * used / samples, used / cpu])
        rows.append([fmt, "total", cpu, 1e6 * cpu / samples, 1.0])
    rec.note(
        f"Profile: the store of the throughput part ({a.store_prompts:,} prompts x 4 samples) read by a fresh "
        f"cursor per format in batches of {a.catchup_batch} prompts (acknowledged), after a warm-up pass; the CPU "
        "time inside each stage of a batch, the stages wrapped where the follower calls them (a stage the daskgen "
        "imported has not is left out): the stage's own thread's, but reading the arrays: the whole process's "
        "(Zarr decodes chunks in its threads; a cursor saved meanwhile in another thread is counted there too)."
    )
    rec.table(["format", "stage", "CPU s", "CPU us per sample", "share"], rows)


# --------------------------------------------------------------------------- first batch


def commits_after(store: Path, t_launch: float) -> tuple[float, float]:
    """Seconds from ``t_launch`` (epoch) to the first and to the last commit of ``store``."""
    import zarr

    times = np.asarray(zarr.open_array(str(store), path="committed_at", mode="r")[:])
    return float(np.nanmin(times)) - t_launch, float(np.nanmax(times)) - t_launch


def part_first_batch(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Time to a trainer's first batch of B prompt groups: synchronous batch vs streaming a larger pool."""
    import dask
    from distributed import Client, LocalCluster

    b, pool = a.trainer_batch, a.pool_factor * a.trainer_batch
    with (
        dask.config.set({"distributed.worker.daemon": False}),
        LocalCluster(n_workers=1, threads_per_worker=16, processes=True, dashboard_address=":0") as cluster,
        Client(cluster),
    ):
        join = ["--scheduler-address", cluster.scheduler_address]
        sync_store, stream_store = work / "sync.zarr", work / "stream.zarr"
        t0 = time.time()
        size = a.first_partition_size
        args = run_args(
            a, write_prompts(work / "sync.jsonl", b), sync_store, n_samples=4, sigma=a.sigma, partition_size=size
        )
        finished(launch([*args, *join]), "the synchronous run")
        sync_first, sync_s = commits_after(sync_store, t0)
        prompts = write_prompts(work / "pool.jsonl", pool)
        args = run_args(a, prompts, stream_store, n_samples=4, sigma=a.sigma, partition_size=size)
        t0 = time.time()
        proc = launch([*args, *join])
        stream_s, got = first_batch_after(stream_store, b, t0)
        finished(proc, "the streaming run")
        stream_first, _ = commits_after(stream_store, t0)
    rec.note(
        f"First batch: B = {b} prompt groups x 4 samples, simulated engine in real time, lognormal lengths "
        f"(mean {a.length_mean}, sigma {a.sigma}, up to {a.max_new_tokens} tokens), {a.max_batch} requests at "
        f"once, partitions of {a.first_partition_size} prompt(s). Both runs join one LocalCluster started "
        "beforehand (its start is not counted; each run's own process start, input scan and engine start are)."
    )
    rec.table(
        ["trainer waits for", "prompts generated", "seconds from launch", "first commit after s"],
        [
            [f"a synchronous batch of {b} (its last commit)", b, sync_s, sync_first],
            [f"the first streamed batch of {got} (daskgen.follow)", pool, stream_s, stream_first],
        ],
    )


def first_batch_after(store: Path, prompts: int, t_launch: float) -> tuple[float, int]:
    """Seconds from ``t_launch`` until a follower of ``store`` hands out its first batch, and its size."""
    import daskgen

    with daskgen.follow(store, batch_prompts=prompts, timeout=600, fields=("response_length",)) as follower:
        first = next(follower)
        return time.time() - t_launch, len(first)


# --------------------------------------------------------------------------- order


def part_order(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Mean delivered response length early in the run vs over the whole run, commit order vs windows."""
    import threading

    windows = cli.counts(a.order_windows)
    sides = [("commit order", "commit", None)] + [(f"window of {w}", "window", w) for w in windows]
    prompts, rows = write_prompts(work / "order.jsonl", a.order_prompts), []
    for repeat in range(1, a.order_repeats + 1):
        store = work / f"order-{repeat}.zarr"
        args = run_args(a, prompts, store, n_samples=a.n_samples, sigma=a.sigma, partition_size=1)
        got: list[list] = [[] for _ in sides]
        t0 = time.time()
        proc = launch([*args, "--n-workers", "1"])
        threads = [
            threading.Thread(target=follow_lengths, args=(store, order, w, a.trainer_batch, out, t0))
            for (_, order, w), out in zip(sides, got, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        finished(proc, "the order run")
        rows += [input_row(store, repeat, a.trainer_batch)]
        rows += [order_row(label, repeat, out) for (label, _, _), out in zip(sides, got, strict=True)]
    rec.note(
        f"Order: a daskgen run of {a.order_prompts} prompts x {a.n_samples} samples (simulated engine in real time, "
        f"lognormal lengths mean {a.length_mean}, sigma {a.sigma}, up to {a.max_new_tokens} tokens, {a.max_batch} "
        "requests at once, partitions of 1 prompt, 1 worker) into a local store, followed at once by one follower "
        f"per order (threads in the benchmark process, own cursors, batches of {a.trainer_batch} prompt groups). "
        "First quarter = the follower's first 25 % of batches (for the input-order reference row: the prompts "
        "of as many full batches, by index, read from the store after the run); lengths are over the delivered "
        "samples; head wait = seconds committed prompts were held back by the window's head (batch.head_wait), "
        f"summed and the longest before one batch; {a.order_repeats} runs."
    )
    header = ["order", "run", "batches", "mean length, first quarter", "mean length, whole run", "first / whole"]
    rec.table([*header, "first quarter delivered after s", "head wait total s", "head wait max s"], rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="lag,throughput,first-batch", help="lag, throughput, profile, first-batch, order")
    cli.add_flags(p, n_samples=2, length_mean=64.0, max_new_tokens=512, max_batch=256, partition_size=4)
    p.add_argument("--lag-prompts", type=int, default=400)
    p.add_argument("--lag-repeats", type=int, default=3, help="runs per side of the lag part")
    p.add_argument("--store-prompts", type=int, default=20_000)
    p.add_argument("--catchup-batch", type=int, default=256)
    p.add_argument("--trainer-batch", type=int, default=32)
    p.add_argument("--pool-factor", type=int, default=2, help="the streaming run generates this many x B prompts")
    p.add_argument("--first-partition-size", type=int, default=1, help="partition size of the first-batch runs")
    p.add_argument("--sigma", type=float, default=1.2, help="lognormal sigma of the first-batch job's lengths")
    p.add_argument("--order-prompts", type=int, default=512, help="prompts of the order part's job")
    p.add_argument("--order-windows", default="1,8,32,64,256", help="window sizes (prompts) of the order part")
    p.add_argument("--order-repeats", type=int, default=2, help="runs of the order part")
    return cli.parse(p, argv)


PARTS = {
    "lag": part_lag,
    "throughput": part_throughput,
    "profile": part_profile,
    "first-batch": part_first_batch,
    "order": part_order,
}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
