"""What a location holds: a daskgen store's attrs, the version of its arrays, or why it holds no store."""

from __future__ import annotations

import json

from daskgen.errors import StoreError
from daskgen.store.attrs import ATTRS_KEY, StoreAttrs
from daskgen.store.location import StoreLocation, StoreRef, locate


def read_store_attrs(where: StoreRef) -> StoreAttrs | None:
    """The typed attrs of the store at ``where``, or ``None`` when it is not a daskgen store."""
    loc = locate(where)
    try:
        raw = loc.read_bytes("zarr.json")
        doc = None if raw is None else json.loads(raw)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"{loc.url + '/zarr.json'!r} is not readable Zarr metadata: {exc}") from exc
    found = None if doc is None else (doc.get("attributes") or {}).get(ATTRS_KEY)
    return None if found is None else StoreAttrs.from_json(found)


def version_of(attrs: StoreAttrs) -> str:
    """What identifies a store's arrays at its location (:attr:`GenerationStore.version`): creation time and
    packing state."""
    return f"{attrs.created}|{json.dumps(attrs.packed, sort_keys=True)}"


def not_a_store(loc: StoreLocation) -> str:
    """Why ``loc`` holds no daskgen store (the first sentence of every error about it)."""
    if loc.is_file():
        found = "it is a file"
    elif loc.is_empty():
        found = "nothing is there"
    else:
        found = "what is there has no zarr.json with daskgen attrs"
    return f"{loc.url!r} is not a daskgen store: {found}."
