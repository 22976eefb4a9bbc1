"""The Zarr store: its layout, typed attrs, the store object, where it lives, its lock, cursors, packing.

:class:`GenerationStore` is the one object through which a run reads and writes a store; its layout
(:class:`Layout`) and attrs (:class:`StoreAttrs`) are defined once, in :mod:`daskgen.store.layout` and
:mod:`daskgen.store.attrs`.
"""

from daskgen.store.attrs import StoreAttrs
from daskgen.store.generation_store import GenerationStore, read_store_attrs
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
