"""The whole store as one zip file (chunks already compressed: stored, not deflated), and its upload to W&B."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

from daskgen.errors import ExportError
from daskgen.store.attrs import ATTRS_KEY, StoreAttrs
from daskgen.store.generation_store import GenerationStore
from daskgen.store.location import StoreRef

# Written first into a zip: with status before the data, every row done in the zip is complete.
_ZIP_FIRST = ("zarr.json", "status", "error", "committed_at")


# -- zip and W&B ----------------------------------------------------------------------------------
def zip_store(path: StoreRef, out: str | Path) -> None:
    """Write the whole store into one uncompressed zip (chunks are already compressed) and verify it."""
    store = GenerationStore.open(path)
    keys = sorted(store.object_keys(), key=lambda key: (key.split("/", 1)[0] not in _ZIP_FIRST, key))
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key in keys:
            data = store.read_object(key)
            if data is not None:  # deleted meanwhile (a running client's temporary file)
                zf.writestr(key, data)
    import zarr

    with zarr.storage.ZipStore(str(out), mode="r") as zs:  # the zip written, checked as a reader will open it
        group = zarr.open_group(zs, mode="r")
        if ATTRS_KEY not in group.attrs or "status" not in group:
            raise ExportError(f"the zip {str(out)!r} does not open as a daskgen store")


def require_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ExportError(
            "--wandb-project needs the optional package 'wandb', which is not installed: pip install "
            "wandb, then `wandb login` (or set WANDB_API_KEY). Nothing was exported."
        ) from None
    return wandb


def upload_wandb(zip_path: str | Path, project: str, attrs: StoreAttrs) -> str:
    """Log ``zip_path`` as a W&B ``dataset`` artifact in ``project``; returns the artifact name."""
    import re

    wandb = require_wandb()
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(zip_path).stem) or "daskgen-store"
    try:
        run = wandb.init(project=project, job_type="daskgen-export")
        artifact = wandb.Artifact(name, type="dataset", metadata={"identity": attrs.identity, "input": attrs.input})
        artifact.add_file(str(zip_path))
        run.log_artifact(artifact)
        run.finish()
    except Exception as exc:  # wandb raises many types (not logged in, network, permissions)
        raise ExportError(
            f"W&B upload to project {project!r} failed: {exc}. Is wandb configured (`wandb login` "
            f"or WANDB_API_KEY)? The zip is at {str(zip_path)!r}."
        ) from exc
    return f"{project}/{name}"
