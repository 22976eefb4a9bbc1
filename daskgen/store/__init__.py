"""The Zarr store: the store object, its layout and typed attrs, where it lives, and what works beside it.

:class:`GenerationStore` is the one object through which a run reads and writes a store; its layout
(:class:`Layout`) and attrs (:class:`StoreAttrs`) are defined once, in :mod:`daskgen.store.layout` and
:mod:`daskgen.store.attrs`.  The rest is grouped by what it is for: :mod:`daskgen.store.chunks` (a chunk's
bytes), :mod:`daskgen.store.objects` (object storage and URLs), :mod:`daskgen.store.records` (the lock, cursors
and the requeue record beside the arrays), :mod:`daskgen.store.tools` (``verify``, ``repair``, ``pack``); the
policy record's modules (``policy*``, ``delta_codec``, ``fingerprint``) sit at the top.
"""

from daskgen.store.attrs import StoreAttrs
from daskgen.store.generation_store import GenerationStore
from daskgen.store.identity import read_store_attrs
from daskgen.store.layout import DONE, FAILED, PENDING, ArraySpec, Layout
from daskgen.store.location import StoreLocation, StoreRef, locate

__all__ = [
    "DONE",
    "FAILED",
    "PENDING",
    "ArraySpec",
    "GenerationStore",
    "Layout",
    "StoreAttrs",
    "StoreLocation",
    "StoreRef",
    "locate",
    "read_store_attrs",
]
