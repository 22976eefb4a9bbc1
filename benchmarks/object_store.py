"""Benchmark: write and commit overhead of a store on object storage (S3 protocol) vs a local folder.

The S3 side is moto's standalone server (``moto_server``, a Python test server of the S3 API) in its own
process on loopback: no network latency, but every request goes through HTTP and a Python server, so
per-request costs are *higher* than the request handling of a real S3 endpoint and lower than its
latency (typically 10-30 ms per PUT from a cloud VM in the same region).  ``memory://`` (obstore's
in-process store) shows the cost of the obstore/zarr path without any server.

Part ``store`` — the store calls of one run, timed per backend: ``store.create`` (all arrays and
metadata), ``store.write_region`` of every partition (what a worker does; data as the simulated engine
makes it), ``store.commit`` of every partition (what the client does), ``read_status``, and
``open_store`` + loading ``response_length``.  Part ``run`` — the real ``daskgen run`` (instant simulated
engine, LocalCluster of ``--workers``) into a local folder and into S3: wall time of the whole run.

    python benchmarks/object_store.py                # ~2-4 minutes
    python benchmarks/object_store.py --prompts 1024 --no-record
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records

from daskgen.config import RunConfig

TITLE = "Object storage: store calls and whole runs, S3 vs local folder"


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A ``moto_server`` process on a free loopback port; yields its endpoint URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = shutil.which("moto_server") or "moto_server"
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("moto_server did not start (pip install 'moto[server]')")
            time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard AWS environment pointing at ``endpoint`` (moto accepts any credentials)."""
    return {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_REGION": "us-east-1",
    }


def make_bucket(endpoint: str) -> str:
    """A new bucket on the server; returns its name."""
    import boto3

    name = f"daskgen-bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def partition_data(rng: np.random.Generator, layout: Any) -> dict[str, np.ndarray]:
    """One partition's arrays as a worker writes them (random tokens up to lognormal lengths)."""
    n, s, r, p = layout.partition_size, layout.n_samples, layout.max_new_tokens, layout.max_prompt_tokens
    lengths = np.clip(rng.lognormal(np.log(r / 4), 0.8, size=(n, s)), 1, r).astype("int32")
    mask = np.arange(r)[None, None, :] < lengths[..., None]
    return {
        "prompt_ids": rng.integers(1, 32000, size=(n, p), dtype="int32"),
        "prompt_length": np.full(n, p, "int32"),
        "response_ids": np.where(mask, rng.integers(1, 32000, size=(n, s, r), dtype="int32"), 0),
        "response_length": lengths,
        "response_mask": mask.astype("uint8"),
        "logprobs": np.where(mask, rng.normal(-1, 1, size=(n, s, r)), np.nan).astype("float32"),
        "finish_reason": np.zeros((n, s), "int8"),
        "num_turns": np.ones((n, s), "int16"),
    }


def store_calls(a: argparse.Namespace, where: Any) -> dict[str, float]:
    """Seconds of each store call on ``where`` (per-partition calls: median per call)."""
    from daskgen import store
    from daskgen.analysis.accessor import open_store

    layout = store.Layout(a.prompts, a.n_samples, 64, a.max_new_tokens, a.partition_size, 0)
    rng = np.random.default_rng(0)
    blocks = [partition_data(rng, layout) for _ in range(4)]
    t0 = time.perf_counter()
    store.GenerationStore.create(
        where, store.StoreAttrs(layout, **{"identity": {"model": "bench"}}), [f"r{i}" for i in range(a.prompts)]
    )
    out = {"create": time.perf_counter() - t0}
    writes, commits = [], []
    for i, start in enumerate(layout.partitions()):
        t = time.perf_counter()
        store.GenerationStore.open(where).write_region(start, blocks[i % len(blocks)])
        writes.append(time.perf_counter() - t)
        t = time.perf_counter()
        store.GenerationStore.open(where).commit(
            start, np.ones(a.partition_size, "int8"), None, np.full(a.partition_size, time.time())
        )
        commits.append(time.perf_counter() - t)
    out["write_region (per partition)"] = statistics.median(writes)
    out["commit (per partition)"] = statistics.median(commits)
    t = time.perf_counter()
    store.GenerationStore.open(where).read_status()
    out["read_status"] = time.perf_counter() - t
    t = time.perf_counter()
    np.asarray(open_store(where).response_length)
    out["open_store + all response_length"] = time.perf_counter() - t
    return out


def part_store(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """The store calls on a local folder, memory:// and S3 (moto)."""
    warm = argparse.Namespace(**{**vars(a), "prompts": 2 * a.partition_size})
    store_calls(warm, work / "warm-up.zarr")  # first imports and zarr/xarray caches: not part of any side
    results = {
        "local folder": store_calls(a, work / "local.zarr"),
        "memory:// (obstore)": store_calls(a, f"memory:///{uuid.uuid4().hex}"),
    }
    with moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        results["s3:// (moto_server, loopback)"] = store_calls(a, f"s3://{make_bucket(endpoint)}/run.zarr")
    names = list(results)
    rows = [
        [call, *[results[n][call] * 1000 for n in names], results[names[-1]][call] / results[names[0]][call]]
        for call in results[names[0]]
    ]
    rec.table(
        ["call (ms)", *names, "s3 / local"],
        rows,
        f"Store calls: {a.prompts:,} prompts x {a.n_samples} samples, max {a.max_new_tokens} new tokens, "
        f"logprobs on, partitions of {a.partition_size} ({-(-a.prompts // a.partition_size)} partitions), "
        "one process, sequential calls.",
    )


def run_config(a: argparse.Namespace, where: str) -> RunConfig:
    """An instant simulated run (the engine costs nothing: what is left is daskgen and the store)."""
    return RunConfig(
        model="bench-object-store",
        engine="simulated",
        store=where,
        n_samples=a.n_samples,
        engine_args={"time_scale": 0.0, "length_dist": "lognormal", "length_mean": a.max_new_tokens / 4},
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=64,
        seed=0,
        logprobs=True,
        partition_size=a.partition_size,
        n_workers=a.workers,
        progress=False,
    )


def timed_run(a: argparse.Namespace, where: str) -> float:
    """Wall seconds of one whole run (cluster start included)."""
    from daskgen.client.runner import run

    prompts = [f"Question {i}: what is {i} times {i % 13}?" for i in range(a.run_prompts)]
    t0 = time.perf_counter()
    summary = run(run_config(a, where), prompts)
    if not summary.ok:
        raise SystemExit(f"benchmark run failed: {summary.line()}")
    return time.perf_counter() - t0


def part_run(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """The whole ``daskgen run`` into a local folder and into S3."""
    local = timed_run(a, str(work / "run-local.zarr"))
    with moto_server() as endpoint:
        os.environ.update(s3_env(endpoint))
        s3 = timed_run(a, f"s3://{make_bucket(endpoint)}/run.zarr")
    rec.table(
        ["store", "run wall s", "prompts/s", "vs local"],
        [
            ["local folder", local, a.run_prompts / local, 1.0],
            ["s3:// (moto_server, loopback)", s3, a.run_prompts / s3, s3 / local],
        ],
        f"Whole run: `daskgen run` of {a.run_prompts:,} prompts, instant simulated engine, {a.workers} workers "
        f"(LocalCluster start included), partitions of {a.partition_size}.",
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="store,run", help="comma-separated: store, run")
    cli.add_flags(p, n_samples=4, max_new_tokens=256, partition_size=64, workers=2)
    p.add_argument("--prompts", type=int, default=8192, help="rows of the store-call part")
    p.add_argument("--run-prompts", type=int, default=4096, help="prompts of the whole-run part")
    return cli.parse(p, argv)


PARTS = {"store": part_store, "run": part_run}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
