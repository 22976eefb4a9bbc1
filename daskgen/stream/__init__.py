"""Streaming finished samples to a trainer while the run goes on: ``daskgen.follow``.

* :mod:`~daskgen.stream.batches`: the :class:`Follower` iterator and its :class:`Batch` es;
* :mod:`~daskgen.stream.log`: reading the store's commit log (order, completeness);
* :mod:`~daskgen.store.records.cursors`: durable, atomic per-name consumer positions (kept with the store);
* :mod:`~daskgen.stream.formats`: the arrays a batch reads for its format, built by :mod:`daskgen.formats`
  (xarray, TensorDict, verl ``DataProto``, rows, Arrow: the fields of the export of each);
* :mod:`~daskgen.stream.staleness`: ``max_staleness``: too-stale samples flagged or sent back for generation;
* :mod:`~daskgen.stream.events`: waking on a run's commit events on the same Dask cluster.

The options of a follower are declared once in :mod:`~daskgen.stream.options`.  See docs/streaming.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from daskgen.declare import takes_options
from daskgen.stream.options import FollowOptions

if TYPE_CHECKING:
    from daskgen.store.location import StoreRef
    from daskgen.stream.batches import Follower

__all__ = ["FORMATS", "Batch", "Follower", "FollowOptions", "Position", "follow"]


@takes_options(FollowOptions)
def follow(store: StoreRef, **options: Any) -> Follower:
    """Iterate batches of newly finished prompt groups of ``store`` (``order``: as committed, or input
    order within a sliding window), each exactly once.

    Parameters
    ----------
    store:
        A daskgen store (folder or URL), also one a run is writing or is about to create.

    Returns
    -------
    Follower
        An iterator of :class:`Batch`; ``batch.data`` is in ``format``, ``batch.failed`` maps each failed
        prompt's index to its error.
    """
    from daskgen.stream.batches import Follower

    return Follower(store, **options)


#: Names imported on first use, so that reading the options (``daskgen --help``) loads no store code.
LAZY = {
    "Batch": "daskgen.stream.batches",
    "Follower": "daskgen.stream.batches",
    "Position": "daskgen.store.records.cursors",
    "FORMATS": "daskgen.stream.formats",
}


def __getattr__(name: str) -> Any:
    if name not in LAZY:
        raise AttributeError(f"module 'daskgen.stream' has no attribute {name!r}")
    return getattr(importlib.import_module(LAZY[name]), name)
