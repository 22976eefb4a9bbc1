"""Benchmark: ``daskgen export`` and the analysis helpers on a synthetic store — time, output size, peak memory.

The store is made like ``pack.py`` makes its one (:func:`common.synthetic_store.build_store`: the layout a run
creates, its data arrays filled directly as finished partitions leave them; lognormal response lengths, random token
ids, random log-probabilities, every partition done).  Then, each in a fresh child process (so that its peak resident
memory, ``ru_maxrss``, is its own):

* ``daskgen.analysis.export.export`` to parquet, jsonl and tensordict without decoded text (``text=False``;
  decoding needs the run's tokenizer, which a synthetic store has not), and to zip;
* ``daskgen.analysis.report.write_report`` (the HTML page);
* ``ds.daskgen.length_stats()`` and ``ds.daskgen.throughput()``.

Reported per step: wall seconds, rows (prompt × sample) per second, output MiB and peak RSS of the child.
There is no second side: the figures say what these steps cost on this machine at this size.

    python benchmarks/export.py                         # ~3-5 minutes on 2 cores
    python benchmarks/export.py --prompts 2000 --no-record
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from common import cli, records, synthetic_store

#: Run in a child process: one step, then its wall time, rows, output bytes and peak RSS as JSON.
CHILD = """
import json, resource, sys, time
path, out, step = sys.argv[1:4]
t0 = time.perf_counter()
if step == "report":
    from daskgen.analysis.report import write_report
    write_report(path, out)
    rows, size = 0, __import__("os").path.getsize(out)
elif step == "statistics":
    from daskgen.analysis.accessor import open_store
    ds = open_store(path)
    ds.daskgen.length_stats()
    ds.daskgen.throughput()
    rows, size = 0, 0
else:
    from daskgen.analysis.export import export
    result = export(path, out, step, text=False, raw=False)
    rows, size = result.rows, result.bytes
seconds = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({"seconds": seconds, "rows": rows, "bytes": size, "rss_mib": rss}))
"""

STEPS = {
    "parquet": "export parquet, no text",
    "jsonl": "export jsonl, no text",
    "tensordict": "export tensordict (memmap), no text",
    "zip": "export zip (the whole store)",
    "report": "report (HTML)",
    "statistics": "length_stats() + throughput()",
}

TITLE = "Export: daskgen export, report and statistics on a synthetic store"


def run_step(store: Path, out: Path, step: str) -> dict[str, float]:
    """One step in a child process importing daskgen from ``DASKGEN_SRC``; its measurements."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(records.DASKGEN_SRC), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(store), str(out), step], capture_output=True, text=True, env=env, timeout=3600
    )
    if res.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def fill_logprobs(path: Path, block: int = 4096) -> None:
    """Random log-probabilities (<= 0) where ``response_mask`` is set: ``build_store`` leaves NaN."""
    import numpy as np
    import zarr

    rng = np.random.default_rng(2)
    mask = zarr.open_array(str(path), path="response_mask", mode="r")
    logprobs = zarr.open_array(str(path), path="logprobs", mode="r+")
    for start in range(0, mask.shape[0], block):
        m = np.asarray(mask[start : start + block]).astype(bool)
        values = -rng.exponential(1.0, size=m.shape).astype("float32")
        logprobs[start : start + block] = np.where(m, values, np.nan).astype("float32")


def part_export(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Build the store, run every step, one table row per step."""
    path = work / "store.zarr"
    built = synthetic_store.build_store(a, path)
    fill_logprobs(path)
    files, size = synthetic_store.files_and_bytes(path)
    rec.note(
        f"Store: {a.prompts:,} prompts x {a.n_samples} samples, prompts up to {a.max_prompt_tokens} tokens, "
        f"responses up to {a.max_new_tokens} (lognormal lengths, mean {a.length_mean}), logprobs stored, "
        f"partitions of {a.partition_size}, {built['done_rows']:,} rows done; {size / 2**20:.0f} MiB in "
        f"{files:,} files, built in {built['seconds']:.0f} s. Each step ran in a child process of its own."
    )
    rows = []
    for step in a.steps.split(","):
        out = work / f"out-{step}" if step == "tensordict" else work / f"out.{step}"
        m = run_step(path, out.with_suffix(".html") if step == "report" else out, step)
        rate = m["rows"] / m["seconds"] if m["rows"] else None
        rows.append([STEPS[step], m["seconds"], rate, m["bytes"] / 2**20 if m["bytes"] else None, m["rss_mib"]])
    rec.table(["step", "wall s", "rows/s", "output MiB", "peak RSS MiB (child process)"], rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="export", help="export")
    cli.add_flags(p, prompts=20_000, **synthetic_store.DEFAULTS)
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, from {', '.join(STEPS)}")
    return cli.parse(p, argv)


PARTS = {"export": part_export}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
