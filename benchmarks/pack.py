"""Benchmark: ``daskgen pack`` on a 1M-prompt store — files and bytes before/after, read times.

The store is made by ``daskgen.store.generation_store.create`` (the layout a run creates) and its data arrays are filled
directly, as finished partitions leave them: lognormal response lengths (mean ``--length-mean``), random
token ids up to the length then padding, the matching mask, lengths, finish reasons and turns; ``status``
done for ``--done-fraction`` of the partitions (the rest stay pending and unwritten, like a partly
finished run).  Writing the arrays directly instead of running generation is what makes a 1M-prompt
store take minutes; the files are the same ones workers write (one per partition per array).

Then ``daskgen.store.tools.pack.pack`` rewrites it in place on a LocalCluster of ``--workers`` workers.  Before and
after: file count, bytes, and read times (medians of ``--repeats``, warm page cache):

* ``open_store`` + count of done rows (``status``);
* all ``response_length`` values (a column for statistics);
* the ``response_ids`` of one partition (``store.read_region``, and sliced from an open ``open_store``
  dataset; random partitions);
* a full scan of ``response_mask`` summed per prompt (xarray + dask, every chunk).

    python benchmarks/pack.py                                  # ~10-15 minutes on 2 cores
    python benchmarks/pack.py --prompts 100000 --no-record     # quick
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from common import cli, records
from common.synthetic_store import build_store, files_and_bytes

TITLE = "Pack: files, bytes and read times of a 1M-prompt store"


def read_times(a: argparse.Namespace, path: Path) -> dict[str, float]:
    """Median seconds of each read (see the module docstring)."""
    from daskgen import store
    from daskgen.analysis.accessor import open_store

    rng = np.random.default_rng(1)
    status = store.GenerationStore.open(path).read_status()
    ds = open_store(path)
    done_parts = np.unique(np.flatnonzero(status == store.DONE) // a.partition_size)

    def open_count() -> None:
        int((open_store(path).status == store.DONE).sum())

    def lengths() -> None:
        np.asarray(open_store(path).response_length)

    def one_partition() -> None:
        start = int(rng.choice(done_parts)) * a.partition_size
        store.GenerationStore.open(path).read_region(start, start + a.partition_size, ("response_ids",))

    def one_partition_xarray() -> None:
        start = int(rng.choice(done_parts)) * a.partition_size
        np.asarray(ds.response_ids[start : start + a.partition_size])

    def scan() -> None:
        np.asarray(open_store(path).response_mask.sum(("sample", "response_position")))

    reads: dict[str, Callable[[], None]] = {
        "open_store + count done": open_count,
        "all response_length": lengths,
        "one partition's response_ids": one_partition,
        "one partition's response_ids via open_store": one_partition_xarray,
        "full scan: response_mask summed per prompt": scan,
    }
    out = {}
    for name, fn in reads.items():
        repeats = a.repeats if "scan" not in name else max(1, a.repeats // 2)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[name] = statistics.median(times)
    return out


def part_pack(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Build, measure, pack, measure again, check the values are unchanged."""
    from daskgen import store
    from daskgen.store.tools.pack import pack

    path = work / "big.zarr"
    built = build_store(a, path)
    files_before, bytes_before = files_and_bytes(path)
    reads_before = read_times(a, path)
    sample = store.GenerationStore.open(path).read_region(
        0, min(a.prompts, 4096), ("response_ids", "response_length", "status")
    )
    result = pack(path, n_workers=a.workers)
    files_after, bytes_after = files_and_bytes(path)
    reads_after = read_times(a, path)
    again = store.GenerationStore.open(path).read_region(
        0, min(a.prompts, 4096), ("response_ids", "response_length", "status")
    )
    same = all(np.array_equal(sample[k], again[k]) for k in sample)
    rec.note(
        f"Store: {a.prompts:,} prompts x {a.n_samples} sample(s), max {a.max_new_tokens} new tokens (lognormal "
        f"lengths, mean {a.length_mean}), partitions of {a.partition_size} ({built['partitions']:,}), "
        f"{built['done_rows']:,} rows done ({a.done_fraction:.0%} of partitions), logprobs off; built in "
        f"{built['seconds']:.0f} s. Packed in place on a LocalCluster of {a.workers} worker(s) in "
        f"{result.seconds:.0f} s; values of the first 4,096 rows identical after packing: {records.fmt(same)}."
    )
    rec.table(
        ["", "before (one file per partition per array)", "after `daskgen pack`", "after / before"],
        [
            ["files", files_before, files_after, files_after / files_before],
            ["MiB", bytes_before / 2**20, bytes_after / 2**20, bytes_after / bytes_before],
            *[
                [f"{name} (s)", reads_before[name], reads_after[name], reads_after[name] / reads_before[name]]
                for name in reads_before
            ],
        ],
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="pack", help="pack")
    cli.add_flags(
        p,
        prompts=1_000_000,
        n_samples=1,
        max_new_tokens=128,
        max_prompt_tokens=64,
        length_mean=40.0,
        partition_size=64,
        done_fraction=0.9,
        workers=2,
        repeats=5,
    )
    return cli.parse(p, argv)


PARTS = {"pack": part_pack}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
