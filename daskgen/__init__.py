"""daskgen: distributed LLM generation on Dask with resumable Zarr stores.

Importing ``daskgen`` is cheap: torch, transformers and engine backends load only where used.
"""

from __future__ import annotations

from typing import Any

import daskgen.tunables  # noqa: F401 - merges the `daskgen:` defaults into Dask's config

__version__ = "0.1.0"
__all__ = ["RunConfig", "follow", "generate", "open_store", "publish_policy", "read_image", "run", "verify"]


def __getattr__(name: str) -> Any:
    if name in ("generate", "run"):
        from daskgen.client import runner

        return getattr(runner, name)
    if name == "open_store":
        from daskgen.analysis.accessor import open_store

        return open_store
    if name == "follow":
        from daskgen.stream import follow

        return follow
    if name == "publish_policy":
        from daskgen.store.policy import publish_policy

        return publish_policy
    if name == "read_image":
        from daskgen.store.images import read_image

        return read_image
    if name == "verify":
        from daskgen.store.tools.verify import verify

        return verify
    if name == "RunConfig":
        from daskgen.config import RunConfig

        return RunConfig
    raise AttributeError(f"module 'daskgen' has no attribute {name!r}")
