"""Scale-out: the long-tail run at 1, 2, 4 workers and the client bottleneck, into one record.

``--part longtail`` is ``scaleout_workers.py`` (weak scaling of the long-tail streaming run on simulated
engines); ``--part client`` is ``scaleout_client.py`` (where daskgen's client saturates, in up to four
cluster layouts, against Dask's own floor).  Each script's docstring says how its comparison is built;
this one takes the flags of both.

    python benchmarks/scaleout.py                  # ~8-10 minutes on 2 cores
    python benchmarks/scaleout.py --part client --scheduler separate --workers 2   # ~1 minute
    python benchmarks/scaleout.py --workers 1,2 --prompts-per-worker 64 --no-record
"""

from __future__ import annotations

import argparse

import scaleout_client
import scaleout_workers
from common import cli

TITLE = "Scale-out: 1, 2, 4 workers and the client bottleneck"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options: ``--part`` and the flags of both comparisons."""
    adders = (scaleout_workers.add_args, scaleout_client.add_args)
    return cli.parse_parts(__doc__, argv, *adders, part="longtail,client")


if __name__ == "__main__":
    parts = {"longtail": scaleout_workers.part_longtail, "client": scaleout_client.part_client_and_commit}
    raise SystemExit(cli.run_parts(parse_args(), TITLE, parts))
