"""Benchmark 3: the same generated dataset as a daskgen store, as JSONL and as pickled batches.

The dataset is a daskgen store: an existing one (``--store PATH``, e.g. one written by the real model in
``longtail_real.py --workdir``) or one generated here with the instant ``simulated`` engine (its token
ids are uniform random ids and its logprobs random floats: both compress worse than real ones).  Its
done rows are exported as

* **JSONL** — one record per sample with token lists (``prompt_ids``, ``response_ids``, ``logprobs`` when
  stored), ``finish_reason``, ``response_length``, ``num_turns``, ids: what datatrove / NeMo-Skills style
  writers produce; plain and gzip-compressed (datatrove's default), written with the standard ``json``;
* **pickled batches** — one pickle per 1000 samples, each a list of per-sample dicts holding unpadded
  ``int32``/``float32`` numpy arrays (the compact way to pickle; highest protocol, uncompressed).

Reported: bytes on disk per generated token (with and without logprobs; the top-k logprob arrays of a run with
``--top-logprobs K`` are left out of that comparison, which the other formats do not hold, and reported per array),
and the time to load one column (response lengths) and compute the mean response length — xarray on the store;
``json`` line by line and ``pyarrow.json`` on JSONL (the faster one is the baseline); ``pickle`` on the batches.
Files were just written, so every reader sees a warm page cache; medians of ``--repeats``.

    python benchmarks/storage.py                              # ~1-2 minutes
    python benchmarks/storage.py --store path/to/out.zarr     # any existing daskgen store
    python benchmarks/storage.py --top-logprobs 20 --prompts 512   # with the top-20 logprobs of every token

The simulated engine's top-k entries are the sampled token with its logprob, then random distinct ids with
random logprobs below it: they compress worse than a real model's.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pickle
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from common import cli, records, simulation

from daskgen.config import RunConfig

REASONS = ("stop", "length", "abort", "error")
BATCH = 1000


def make_store(a: argparse.Namespace, path: Path) -> None:
    """Generate the dataset with daskgen and the instant simulated engine."""
    from daskgen.client.runner import run

    config = RunConfig(
        model="simulated-storage",
        engine="simulated",
        store=str(path),
        n_samples=a.n_samples,
        engine_args=simulation.lognormal_engine(0.0, a.length_mean, a.length_sigma),
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=128,
        temperature=1.0,
        seed=0,
        logprobs=True,
        top_logprobs=a.top_logprobs,
        partition_size=64,
        n_workers=a.workers,
        progress=False,
    )
    prompts = [
        f"Problem {i}: prove that the sum of the first {i % 97 + 2} odd numbers is a square." for i in range(a.prompts)
    ]
    summary = run(config, prompts)
    if not summary.ok:
        raise SystemExit(f"generating the dataset failed: {summary.line()}")


def has_logprobs(path: Path) -> bool:
    """Whether the store's run asked for logprobs (its config says so)."""
    from daskgen import store

    return bool(store.GenerationStore.open(path).attrs.identity.get("logprobs"))


def samples(path: Path, with_logprobs: bool) -> Iterator[dict[str, Any]]:
    """Every done (prompt, sample) of the store as a dict of unpadded numpy arrays and scalars."""
    import zarr

    from daskgen import store

    group = zarr.open_group(str(path), mode="r")
    layout = (store.read_store_attrs(path)).layout
    has_lp = with_logprobs and has_logprobs(path)
    step = layout.partition_size
    for start in range(0, layout.n_prompts, step):
        stop = min(start + step, layout.n_prompts)
        status = group["status"][start:stop]
        block = {
            n: group[n][start:stop]
            for n in (
                "prompt_ids",
                "prompt_length",
                "response_ids",
                "response_length",
                "finish_reason",
                "num_turns",
                "prompt_id",
            )
        }
        lp = group["logprobs"][start:stop] if has_lp else None
        for r in range(stop - start):
            if status[r] != store.DONE:
                continue
            plen = int(block["prompt_length"][r])
            for s in range(layout.n_samples):
                n = int(block["response_length"][r, s])
                rec = {
                    "prompt_index": start + r,
                    "prompt_id": str(block["prompt_id"][r]),
                    "sample": s,
                    "prompt_ids": block["prompt_ids"][r, :plen],
                    "response_ids": block["response_ids"][r, s, :n],
                    "finish_reason": REASONS[int(block["finish_reason"][r, s])],
                    "response_length": n,
                    "num_turns": int(block["num_turns"][r, s]),
                }
                if lp is not None:
                    rec["logprobs"] = lp[r, s, :n]
                yield rec


def _jsonable(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in rec.items()}


def write_jsonl(path: Path, records: Iterator[dict[str, Any]], compress: bool) -> None:
    """One JSON object per line (``json.dumps`` defaults), optionally gzip-compressed."""
    opener: Callable[..., Any] = gzip.open if compress else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for rec in records:
            fh.write(json.dumps(_jsonable(rec)) + "\n")


def write_pickles(folder: Path, records: Iterator[dict[str, Any]]) -> None:
    """One pickle per ``BATCH`` samples: a list of per-sample dicts with numpy arrays."""
    folder.mkdir(parents=True, exist_ok=True)
    batch: list[dict[str, Any]] = []
    index = 0

    def flush() -> None:
        nonlocal batch, index
        with open(folder / f"batch-{index:06d}.pkl", "wb") as fh:
            pickle.dump(batch, fh, protocol=pickle.HIGHEST_PROTOCOL)
        batch, index = [], index + 1

    for rec in records:
        rec = dict(rec)
        rec["prompt_ids"] = rec["prompt_ids"].astype(np.int32)
        rec["response_ids"] = rec["response_ids"].astype(np.int32)
        if "logprobs" in rec:
            rec["logprobs"] = rec["logprobs"].astype(np.float32)
        batch.append(rec)
        if len(batch) == BATCH:
            flush()
    if batch:
        flush()


def disk_bytes(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def store_without(src: Path, dst: Path, arrays: tuple[str, ...]) -> None:
    """A copy of the store folder without the chunks of ``arrays`` (metadata kept)."""
    import shutil

    shutil.copytree(src, dst, ignore=lambda d, names: [n for n in names if Path(d).name in arrays and n == "c"])


def array_rows(path: Path, tokens: int) -> list[list[Any]]:
    """Per data array of the store: MiB on disk and bytes per generated token (largest first)."""
    sizes = {p.name: disk_bytes(p) for p in path.iterdir() if p.is_dir()}
    return [[name, size / 2**20, size / tokens] for name, size in sorted(sizes.items(), key=lambda kv: -kv[1])]


# --------------------------------------------------------------------------- column loads


def load_store(path: Path) -> float:
    """Mean response length with xarray (done rows only)."""
    import xarray as xr

    ds = xr.open_zarr(str(path))
    lengths = ds["response_length"].values
    done = ds["status"].values == 1
    return float(lengths[done].mean())


def load_json_lines(path: Path) -> float:
    """Mean response length with the standard ``json`` module, line by line (gzip when ``.gz``)."""
    opener: Callable[..., Any] = gzip.open if path.suffix == ".gz" else open
    total = count = 0
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            total += json.loads(line)["response_length"]
            count += 1
    return total / count


def load_pyarrow_json(path: Path) -> float:
    """Mean response length with ``pyarrow.json.read_json`` (parses every field; multi-threaded)."""
    import pyarrow.compute as pc
    import pyarrow.json as pj

    table = pj.read_json(path)
    return float(pc.mean(table["response_length"]).as_py())


def load_pickles(folder: Path) -> float:
    """Mean response length from the pickled batches."""
    total = count = 0
    for file in sorted(folder.glob("*.pkl")):
        with open(file, "rb") as fh:
            for rec in pickle.load(fh):
                total += rec["response_length"]
                count += 1
    return total / count


def timed(fn: Callable[[Path], float], path: Path, repeats: int) -> tuple[float, float]:
    """(median seconds, value) of ``fn(path)``."""
    times, value = [], float("nan")
    for _ in range(repeats):
        t0 = time.perf_counter()
        value = fn(path)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    cli.add_flags(
        p, prompts=4096, n_samples=4, max_new_tokens=2048, length_mean=384.0, length_sigma=1.0, workers=2, repeats=3
    )
    p.add_argument("--store", type=Path, default=None, help="existing daskgen store (default: generate one)")
    p.add_argument("--top-logprobs", type=int, default=0, help="k most likely tokens stored per token (generated)")
    p.add_argument("--skip-slow-readers", action="store_true", help="time only the fastest JSONL reader")
    return cli.parse(p, argv)


def main(argv: list[str] | None = None) -> int:
    """Build the three formats, measure, print, write the record."""
    a = parse_args(argv)
    cli.quiet_logs()
    from daskgen import store
    from daskgen.store.layout import top_logprob_arrays

    rec = records.Record("Storage: daskgen store vs JSONL vs pickled batches")
    with cli.workdir(a.workdir) as work:
        src = a.store
        if src is None:
            src = work / "daskgen.zarr"
            make_store(a, src)
        attrs = store.read_store_attrs(src)
        if attrs is None:
            raise SystemExit(f"{src} is not a daskgen store")
        layout = (attrs).layout
        status = store.GenerationStore.open(src).read_status()
        lengths = store.GenerationStore.open(src).read_region(0, layout.n_prompts, ("response_length",))[
            "response_length"
        ][status == 1]
        tokens = int(lengths.sum())
        has_lp = has_logprobs(src)
        variants = [True, False] if has_lp else [False]
        sizes: dict[tuple[str, bool], int] = {}
        paths: dict[str, Path] = {}
        top = top_logprob_arrays(layout)
        for lp in variants:
            tag = "lp" if lp else "nolp"
            dropped = top + (() if lp else ("logprobs",))
            zpath = work / f"store-{tag}.zarr" if dropped else src
            if dropped:
                store_without(src, zpath, dropped)
            sizes[("daskgen store (zarr, zstd)", lp)] = disk_bytes(zpath)
            for name, gz in (("JSONL", False), ("JSONL.gz", True)):
                path = work / f"data-{tag}.jsonl{'.gz' if gz else ''}"
                write_jsonl(path, samples(src, lp), gz)
                sizes[(name, lp)] = disk_bytes(path)
                paths.setdefault(f"{name}-{tag}", path)
            pdir = work / f"pickles-{tag}"
            write_pickles(pdir, samples(src, lp))
            sizes[("pickled batches (1000 samples each)", lp)] = disk_bytes(pdir)
            paths[f"pickle-{tag}"] = pdir
            paths[f"store-{tag}"] = zpath
        main_tag = "lp" if has_lp else "nolp"
        loads: dict[str, tuple[float, float]] = {
            "daskgen store: xarray.open_zarr(...).response_length": timed(
                load_store, paths[f"store-{main_tag}"], a.repeats
            ),
            "JSONL: pyarrow.json.read_json": timed(load_pyarrow_json, paths[f"JSONL-{main_tag}"], a.repeats),
        }
        if not a.skip_slow_readers:
            loads["JSONL: json.loads per line"] = timed(load_json_lines, paths[f"JSONL-{main_tag}"], a.repeats)
            loads["JSONL.gz: json.loads per line"] = timed(load_json_lines, paths[f"JSONL.gz-{main_tag}"], a.repeats)
        loads["pickled batches: pickle.load"] = timed(load_pickles, paths[f"pickle-{main_tag}"], a.repeats)
        arrays = array_rows(src, tokens)

    n_samples = int(lengths.size)
    origin = (
        "generated here with the instant simulated engine (uniform random token ids, random logprobs)"
        if a.store is None
        else str(a.store)
    )
    rec.note(
        f"Dataset: {origin}; "
        f"{int((status == 1).sum()):,} prompts × {layout.n_samples} samples = {n_samples:,} samples, "
        f"{tokens:,} generated tokens (mean {lengths.mean():.0f}, max_new_tokens {layout.max_new_tokens}, "
        f"padded width in the store), prompt ids included in every format; logprobs "
        f"{'stored' if has_lp else 'not stored'}; top-k logprobs "
        f"{f'stored (k = {layout.top_logprobs}; left out of the format comparison)' if top else 'not stored'}."
    )
    jsonl = {lp: sizes[("JSONL", lp)] for lp in variants}
    jsonl_gz = {lp: sizes[("JSONL.gz", lp)] for lp in variants}
    srows = []
    for (name, lp), size in sizes.items():
        srows.append(
            [name, "with" if lp else "without", size / 2**20, size / tokens, size / jsonl[lp], size / jsonl_gz[lp]]
        )
    rec.table(["format", "logprobs", "MiB", "bytes per generated token", "vs JSONL", "vs JSONL.gz"], srows)
    base_name = "JSONL: pyarrow.json.read_json"
    if "JSONL: json.loads per line" in loads and loads["JSONL: json.loads per line"][0] < loads[base_name][0]:
        base_name = "JSONL: json.loads per line"
    base = loads[base_name][0]
    lrows = [[name, sec, value, base / sec] for name, (sec, value) in loads.items()]
    rec.table(
        [
            "reader (load response lengths, compute the mean)",
            "seconds (median)",
            "mean length",
            f"speed-up vs {base_name}",
        ],
        lrows,
    )
    zbytes = sizes[("daskgen store (zarr, zstd)", variants[0])] / jsonl[variants[0]]
    zload = base / loads["daskgen store: xarray.open_zarr(...).response_length"][0]
    rec.table(["store array (chunks on disk)", "MiB", "bytes per generated token"], arrays)
    if top:
        per_token = sum(row[2] for row in arrays if row[0] in top)
        rec.note(
            f"**Top-{layout.top_logprobs} logprobs (ids and logprobs): {per_token:.1f} bytes per generated token.**"
        )
    rec.note(
        f"**Store bytes / JSONL bytes = {zbytes:.3f} (target ≤ 0.333); column load {zload:.0f}× faster than the "
        f"fastest JSONL reader (target ≥ 10×).**"
    )
    rec.finish(cli.record_folder(a))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TQDM_DISABLE", "1")
    raise SystemExit(main())
