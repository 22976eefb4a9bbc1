"""Output files of exports and reports: refuse to overwrite by accident, write beside and rename into place."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daskgen.errors import ExportError, OutputExistsError
from daskgen.store.location import StoreRef, locate


# -- output paths -------------------------------------------------------------------------------
def check_output(out: str | Path, *, overwrite: bool = False, protect: StoreRef | None = None) -> None:
    """Refuse an existing ``out`` (unless ``overwrite``) and any ``out`` overlapping the store ``protect``."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(
            f"output {str(out)!r} exists; pass --overwrite (overwrite=True) to replace it, "
            "or choose another --out path."
        )
    if protect is not None and locate(protect).is_local:
        guarded, target = Path(str(locate(protect))).resolve(), out.resolve()
        if target == guarded or guarded in target.parents or target in guarded.parents:
            raise ExportError(f"output {str(out)!r} overlaps the store {str(protect)!r}; choose a path outside it.")


@contextmanager
def staged_output(out: str | Path, *, overwrite: bool = False, protect: StoreRef | None = None) -> Iterator[Path]:
    """Yield a temporary path beside ``out``; on success it replaces ``out`` (atomically for files)."""
    out = Path(out)
    check_output(out, overwrite=overwrite, protect=protect)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        yield tmp
        _remove(out)
        os.replace(tmp, out)
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def output_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
