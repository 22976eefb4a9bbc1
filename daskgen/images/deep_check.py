"""``daskgen verify --deep``: run the model's image processor again on each stored image and compare.

For every distinct image of the store's finished rows, its bytes (stored, or read where a reference points and
checked against its hash: a file that changed since the run read it is found) go through the image processor of the
store's model (:class:`~daskgen.images.processor.ImageProcessing`) once; each row's stored grid and placeholder
count must equal what it gives.  A store whose images were preprocessed with other settings than its model's
processor now has (a different resize, patch or merge size: the mismatches that leave a model seeing other pixels
than the trainer recomputes) is found; so is a processor whose identity differs from the one the store recorded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.errors import ImageReferenceError, StoreError
from daskgen.images.processor import ImageProcessing
from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import blob_key, image_bytes, reference_key
from daskgen.store.layout import DONE
from daskgen.store.tools.verify import Problem, VerifyReport


def deep_image_problems(store: GenerationStore, model: str | None = None) -> tuple[list[Problem], list[str]]:
    """The problems of re-processing ``store``'s images with the image processor of ``model`` (default: the
    store's own), and notes (a processor identity that differs from the recorded one)."""
    if not store.layout.max_images:
        return [], []
    model = model or str(store.attrs.config.get("model", ""))
    processing = ImageProcessing(model)
    notes = []
    recorded = store.attrs.input.get("image_processor")
    if recorded and recorded != processing.identity():
        notes.append(f"the image processor of {model!r} is not the one the store recorded: {recorded}")
    done = np.flatnonzero(store.read_status() == DONE)
    if done.size == 0:
        return [], notes
    arrays = store.read_region(0, store.layout.n_prompts, ("image_hash", "image_grid", "image_length"))
    expected: dict[str, Any] = {}
    problems: list[Problem] = []
    for row in done.tolist():
        for k, digest in enumerate(arrays["image_hash"][row]):
            if not digest:
                continue
            digest = str(digest)
            if digest not in expected:
                expected[digest] = _processed(store, digest, processing, problems)
            again = expected[digest]
            if again is None:
                continue
            grid, length = tuple(int(v) for v in arrays["image_grid"][row, k]), int(arrays["image_length"][row, k])
            if grid != again.grid or length != again.tokens:
                problems.append(Problem(
                    "image", "image_grid", blob_key(digest), row, row + 1,
                    f"image {k}: stored grid {grid} and {length} tokens; the processor gives {again.grid} and "
                    f"{again.tokens}",
                ))  # fmt: skip
    return problems, notes


def _processed(store: GenerationStore, digest: str, processing: ImageProcessing, problems: list[Problem]) -> Any:
    """The image ``digest`` processed again, or ``None``: a reference whose file vanished or no longer hashes to
    ``digest`` (a problem added to ``problems``), or stored bytes missing or damaged (the plain verify's finding)."""
    try:
        return processing.process(image_bytes(store.location, digest))
    except ImageReferenceError as exc:
        problems.append(Problem("image", "images", reference_key(digest), 0, 0, str(exc)))
    except StoreError:
        pass
    return None


def verify_deeply(report: VerifyReport, store: GenerationStore, model: str | None = None) -> VerifyReport:
    """``report`` (of :func:`daskgen.store.tools.verify.verify` on ``store``) with the deep image check added."""
    problems, notes = deep_image_problems(store, model)
    report.problems += problems
    report.notes += notes
    return report
