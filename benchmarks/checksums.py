"""Benchmark: what the CRC32C checksum on every chunk costs — a whole run, and a full-column read.

Both sides in one invocation, interleaved (A, B, A, B, ...), medians of ``--repeats``:

* **A, checksummed**: a store made the way daskgen makes every store (Zstandard, then CRC32C on each
  chunk, :mod:`daskgen.store.chunks.codecs`);
* **B, no checksum**: the same run into a store whose arrays are created with Zstandard only, as daskgen
  made them before checksums (the codec chain of the store's creation is the only difference: the
  client picks it when it creates the store; workers and readers follow what the array metadata says).

Measured per side: the wall time of a whole ``daskgen`` run (``runner.run`` on a LocalCluster with the
instant ``simulated`` engine, so that storage is as large a share of the run as it can be; cluster
start-up included, as a user sees it) and of the generating part alone (engines ready to last commit),
then the time to read the whole ``response_ids`` column of the finished store (every chunk decoded and,
on side A, checked).  Reported: the medians and the ratio A / B for each.

    python benchmarks/checksums.py                 # ~3-5 minutes on 2 cores
    python benchmarks/checksums.py --prompts 2048 --repeats 2 --no-record
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import cli, runs

SIDES = {"checksummed": True, "no checksum": False}

TITLE = "Checksums: CRC32C on every chunk vs none (a whole run, a full-column read)"


@contextlib.contextmanager
def codec_chain(checksummed: bool) -> Iterator[None]:
    """Stores created inside the block get daskgen's codec chain, or (side B) Zstandard only."""
    from zarr.codecs import ZstdCodec

    from daskgen.store import generation_store
    from daskgen.store.chunks import codecs

    original = generation_store.compressors
    if not checksummed:
        generation_store.compressors = lambda: [ZstdCodec(level=codecs.ZSTD_LEVEL)]
    try:
        yield
    finally:
        generation_store.compressors = original


def one_run(a: argparse.Namespace, path: Path, checksummed: bool) -> dict[str, float]:
    """One whole run into a fresh store, then one full-column read; the seconds of each."""
    from daskgen.client.runner import run
    from daskgen.config import RunConfig
    from daskgen.store.generation_store import GenerationStore

    shutil.rmtree(path, ignore_errors=True)
    config = RunConfig(
        model="simulated-checksums",
        engine="simulated",
        store=str(path),
        n_samples=a.n_samples,
        engine_args={"time_scale": 0.0, "length_dist": "lognormal", "length_mean": a.length_mean},
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=128,
        partition_size=a.partition_size,
        n_workers=a.workers,
        logprobs=True,
        progress=False,
    )
    prompts = [f"Question {i}: what is {i} times {i % 13}?" for i in range(a.prompts)]
    with codec_chain(checksummed), runs.instrument_run() as marks:
        t0 = time.perf_counter()
        summary = run(config, prompts, handle_signals=False)
        total = time.perf_counter() - t0
    if not summary.ok:
        raise SystemExit(f"the run failed: {summary.line()}")
    store = GenerationStore.open(path)
    assert store.checksummed == checksummed, "the store's codec chain is not the side's"
    t0 = time.perf_counter()
    store.read_region(0, a.prompts, ("response_ids",))
    return {"run": total, "generate": marks["generate_s"], "read": time.perf_counter() - t0}


def part_checksums(a: argparse.Namespace, work: Path, rec: Any) -> None:
    """Interleaved repeats of both sides; one table row per measure with the medians and the ratio."""
    results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
    for _ in range(a.repeats):
        for side, checksummed in SIDES.items():
            results[side].append(one_run(a, work / "store.zarr", checksummed))
    rec.note(
        f"Runs: {a.prompts:,} prompts x {a.n_samples} samples, responses up to {a.max_new_tokens} tokens "
        f"(lognormal, mean {a.length_mean}), logprobs stored, partitions of {a.partition_size}, "
        f"{a.workers} worker(s), the instant simulated engine; {a.repeats} interleaved repeats per side."
    )
    rows = []
    for measure, label in (("run", "whole run"), ("generate", "engines ready to last commit"), ("read", "read")):
        a_med = statistics.median(r[measure] for r in results["checksummed"])
        b_med = statistics.median(r[measure] for r in results["no checksum"])
        what = "full response_ids column" if measure == "read" else label
        rows.append([what, a_med, b_med, a_med / b_med])
    rec.table(["measure (seconds, median)", "checksummed (A)", "no checksum (B)", "A / B"], rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="checksums", help="checksums")
    cli.add_flags(
        p, prompts=8192, n_samples=4, max_new_tokens=256, length_mean=120.0, partition_size=64, workers=1, repeats=3
    )
    return cli.parse(p, argv)


PARTS = {"checksums": part_checksums}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
