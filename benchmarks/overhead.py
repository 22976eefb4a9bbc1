"""Pipeline overhead of daskgen around the engine: both comparisons of the overhead, into one record.

``--part zarr`` is ``overhead_zarr.py`` (daskgen with an instant engine vs direct Zarr writes of the same
arrays); ``--part engine`` is ``overhead_engine.py`` (daskgen with an in-process engine vs the same engine
driven directly).  Each script's docstring says how its comparison is built; this one takes the flags of
both.

    python benchmarks/overhead.py                       # both parts
    python benchmarks/overhead.py --part zarr --prompts 512 --no-record
    python benchmarks/overhead.py --part engine --engine vllm --engine-repeats 10
"""

from __future__ import annotations

import argparse

import overhead_engine
import overhead_zarr
from common import cli

TITLE = "Pipeline overhead: daskgen vs direct Zarr writes and vs the engine alone"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: ``--part`` and the flags of both comparisons."""
    return cli.parse_parts(__doc__, argv, overhead_zarr.add_args, overhead_engine.add_args, part="zarr,engine")


if __name__ == "__main__":
    parts = {"zarr": overhead_zarr.part_zarr, "engine": overhead_engine.part_engine}
    raise SystemExit(cli.run_parts(parse_args(), TITLE, parts))
