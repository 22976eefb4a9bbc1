"""Whether a run may resume a store: the same identity (settings, input, tokenizer), a schema this daskgen reads,
and not a packed store with rows left."""

from __future__ import annotations

from daskgen.errors import StoreMismatchError
from daskgen.store.attrs import StoreAttrs, jsonable
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import DONE, SCHEMA_VERSIONS


def check_resumable(store: GenerationStore, wanted: StoreAttrs) -> None:
    """Refuse a resume whose identity (settings, input, tokenizer) differs, or of a packed store with rows left."""
    stored = store.attrs
    if stored.schema_version not in SCHEMA_VERSIONS:
        raise StoreMismatchError(
            f"store {store.url!r} has schema_version {stored.schema_version!r}; this daskgen reads "
            f"{list(SCHEMA_VERSIONS)}. Use a new --store path (or the daskgen version that wrote it)."
        )
    diffs = []
    for section, old in stored.identity_sections().items():
        new = jsonable(wanted.identity_sections()[section])
        diffs += [
            f"{key}: store has {old.get(key)!r}, this run has {new.get(key)!r}"
            for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)
        ]
    if diffs:
        raise StoreMismatchError(
            f"cannot resume {store.url!r}: this run differs from the one that created the store:\n  "
            + "\n  ".join(diffs)
            + "\nRerun with the store's settings and input to resume, or pass a new --store path to start a "
            "new run."
        )
    check_not_packed(store)


def check_not_packed(store: GenerationStore) -> None:
    """Refuse to resume a packed store with rows left: partitions share its shards (writers would lose data)."""
    left = int((store.read_status() != DONE).sum()) if store.attrs.packed else 0
    if left:
        raise StoreMismatchError(
            f"cannot resume {store.url!r}: it is packed (daskgen pack: many partitions share each shard file, "
            f"and workers writing one shard at once lose data), and {left} row(s) are not done. Run `daskgen "
            f"unpack {store.url}` first (then rerun; pack again when it is finished), or rerun into a new --store."
        )
