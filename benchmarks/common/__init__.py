"""Shared machinery of the daskgen benchmarks; every script in ``benchmarks/`` imports from this package.

* :mod:`.records` — a run's record file: the machine, the code that ran (commits, clean or not), tables;
* :mod:`.cli` — the scripts' parser, common flags, ``main`` and scratch folders;
* :mod:`.runs` — timed daskgen runs and the engine requests they send;
* :mod:`.workers` — probes that run on Dask workers (engine statistics, utilisation sampler, sync shards);
* :mod:`.simulation` — the simulated long-tail workload, computed sync batches, emulated streaming;
* :mod:`.stats` — intervals of side-by-side ratios over repeats;
* :mod:`.prompts`, :mod:`.synthetic_store`, :mod:`.plots` — inputs, a store made without generating, plots;
* :mod:`.cpu`, :mod:`.processes`, :mod:`.dask_floor` — where the client's CPU goes, and Dask's own floor;
* :mod:`.engine_batch` — one batch of requests through a daskgen engine (the GPU validation steps).

Importing it puts ``$DASKGEN_SRC`` (else this repository) first on ``sys.path``, so scripts run as
``python benchmarks/x.py`` from anywhere import that daskgen.  The package is pickled by value, so Dask
workers and schedulers need not import ``benchmarks``.
"""

from __future__ import annotations

import sys

import cloudpickle

from .records import DASKGEN_SRC

if str(DASKGEN_SRC) not in sys.path:
    sys.path.insert(0, str(DASKGEN_SRC))

cloudpickle.register_pickle_by_value(sys.modules[__name__])
