"""Image preprocessing on CPU workers: when the cluster has workers with the ``daskgen-preprocess`` resource
(:data:`~daskgen.worker.images.PREPROCESS_RESOURCE`; they run no engine), each partition whose rows name images
first becomes a preprocessing task there (:func:`~daskgen.worker.images.preprocess_images`: read, kept once in
the store as the run's ``image_storage`` asks, run through the model's image processor, loaded with the engine
args' ``trust_remote_code`` as on the engine worker, which the task carries), whose result Dask hands to the
engine worker that generates the partition.  Without such workers, each engine worker prepares its partitions'
images itself, in its own thread pool.
"""

from __future__ import annotations

import time
from typing import Any

from daskgen.worker.images import PREPROCESS_RESOURCE, preprocess_images


def preprocess_workers(client: Any) -> int:
    """How many workers of the cluster have the preprocessing resource."""
    workers = client.scheduler_info(n_workers=-1).get("workers", {})
    return sum(1 for w in workers.values() if (w.get("resources") or {}).get(PREPROCESS_RESOURCE))


def preprocessing(client: Any, tasks: list[Any], retries: int) -> list[Any]:
    """Per partition task: the future of its preprocessing task on a CPU worker, or ``None`` (no images, or no
    preprocessing workers: its engine worker prepares them)."""
    urls = [[row.get("image_urls", []) for row in task.inputs or []] for task in tasks]
    if not any(any(row) for row in urls) or not preprocess_workers(client):
        return [None] * len(tasks)
    out: list[Any] = []
    for task, rows in zip(tasks, urls, strict=True):
        if not any(rows):
            out.append(None)
            continue
        out.append(client.submit(
            preprocess_images, task.store, task.model, task.trust_remote_code, rows, task.image_storage,
            key=f"daskgen-images-{task.start}-{time.time_ns()}", pure=False, retries=retries,
            resources={PREPROCESS_RESOURCE: 1},
        ))  # fmt: skip
    return out
