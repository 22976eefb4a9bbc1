"""What ``daskgen verify`` checks of a store's images (:mod:`daskgen.images`).

Per finished row (:func:`image_rows`, one of the row rules of :mod:`daskgen.store.tools.invariants`): each image's span
lies inside the prompt and holds only the model's image placeholder token, as many as its grid asks for
(``t*h*w / merge²``); the prompt holds no placeholder outside the spans; an image slot without a hash has no span;
its hash is stored.  The images a sample's tools returned (``tool_image_*``) likewise, in its response: each span
lies inside the response, on tool tokens (mask 0) that are all placeholders, as many as its grid asks for; the
response's tool tokens hold no placeholder outside the spans; each hash is stored.  Per stored image
(:func:`stored_image_problems`): stored bytes hash to their name; a
reference's file exists and has the size the run read (``--deep`` reads it and checks its hash:
:mod:`daskgen.images.deep_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from daskgen.errors import InputError, StoreError
from daskgen.store.images import (
    COPY,
    REFERENCE,
    blob_key,
    image_hash,
    read_reference,
    reference_key,
    storage_summary,
    stored_hashes,
    stored_images,
)


@dataclass(frozen=True)
class ImageRules:
    """What the store's attrs say of its images: the placeholder token, the processor's merge size, and the
    hashes of the images the store holds."""

    token: int
    merge: int
    stored: frozenset[str]

    @classmethod
    def of(cls, attrs: Any, location: Any) -> ImageRules | None:
        """The rules of a store with images (``None`` without: no ``images`` in its input identity)."""
        found = attrs.input.get("image_token_id")
        if found is None:
            return None
        settings = (attrs.input.get("image_processor") or {}).get("settings", {})
        return cls(int(found), int(settings.get("merge_size", 1) or 1), frozenset(stored_hashes(location)))


def image_rows(region: dict[str, np.ndarray], rules: ImageRules) -> dict[int, str]:
    """Local row -> how its images (its prompt's, its samples' tool images) break the rules (the module
    docstring), for every row of ``region``."""
    found: dict[int, str] = {}
    for r in range(len(region["prompt_length"])):
        why = _row_problem(region, r, rules) if "image_hash" in region else ""
        if not why and "tool_image_hash" in region:
            why = _tool_problem(region, r, rules)
        if why:
            found[r] = why
    return found


def _row_problem(region: dict[str, np.ndarray], r: int, rules: ImageRules) -> str:
    ids = np.asarray(region["prompt_ids"][r, : int(region["prompt_length"][r])])
    return _spans_problem(ids, np.zeros(len(ids), dtype=bool), region, "image_", (r,), rules, "the prompt")


def _tool_problem(region: dict[str, np.ndarray], r: int, rules: ImageRules) -> str:
    """The first sample (or trajectory) of row ``r`` whose tool images break the rules, said."""
    for index in np.ndindex(region["tool_image_hash"].shape[1:-1]):
        at = (r, *index)
        n = int(region["response_length"][at])
        ids, mask = np.asarray(region["response_ids"][at][:n]), np.asarray(region["response_mask"][at][:n])
        why = _spans_problem(ids, mask != 0, region, "tool_image_", at, rules, "the response's tool tokens")
        if why:
            return f"sample {'/'.join(map(str, index))}: tool {why}"
    return ""


def _spans_problem(
    ids: np.ndarray, model: np.ndarray, region: dict[str, np.ndarray], prefix: str, at: tuple[int, ...],
    rules: ImageRules, where: str,
) -> str:  # fmt: skip
    """How the images of slot ``at`` (arrays ``<prefix>hash`` ...) break the rules in ``ids`` (``model``: positions
    of model tokens, which no image may cover and whose placeholders are not counted), or ``""``."""
    covered = 0
    for k, digest in enumerate(region[prefix + "hash"][at]):
        slot = at + (k,)
        offset, length = int(region[prefix + "offset"][slot]), int(region[prefix + "length"][slot])
        if not digest:
            if offset != -1 or length != 0:
                return f"image slot {k} has a span ({offset}, {length}) but no hash"
            continue
        t, h, w = (int(v) for v in region[prefix + "grid"][slot])
        if length != t * h * w // (rules.merge * rules.merge) or length < 1:
            return (
                f"image {k}: {length} placeholder tokens, its grid {(t, h, w)} asks for {t * h * w // rules.merge**2}"
            )
        span = slice(offset, offset + length)
        if offset < 0 or offset + length > len(ids) or (ids[span] != rules.token).any() or model[span].any():
            return f"image {k}: span ({offset}, {length}) is not {length} placeholder tokens {rules.token} in {where}"
        if str(digest) not in rules.stored:
            return f"image {k}: {digest} is not stored ({blob_key(str(digest))} missing)"
        covered += length
    placeholders = int(((ids == rules.token) & ~model).sum())
    if placeholders != covered:
        return f"{where} hold {placeholders} image placeholder tokens, the images' spans {covered}"
    return ""


def stored_image_problems(
    location: Any, storage_options: dict[str, Any] | None = None
) -> tuple[list[tuple[str, str]], list[str]]:
    """``(key, what is wrong)`` for each stored image whose bytes do not hash to its name, and each reference whose
    file is missing or has another size than the run read (read with ``storage_options``, default: the store's);
    and, when some images are references, a note saying how the store keeps its images."""
    kinds = stored_images(location)
    problems = []
    for digest, kind in sorted(kinds.items()):
        found = _image_problem(location, digest, kind, storage_options)
        if found is not None:
            problems.append(found)
    notes = [f"images: {storage_summary(kinds)}"] if REFERENCE in kinds.values() else []
    return problems, notes


def _image_problem(
    location: Any, digest: str, kind: str, storage_options: dict[str, Any] | None
) -> tuple[str, str] | None:
    """``(key, what is wrong)`` of one stored image, or ``None`` when nothing is."""
    if kind == COPY:
        data = location.read_bytes(blob_key(digest))
        if data is not None and image_hash(data) != digest:
            return blob_key(digest), f"its bytes hash to {image_hash(data)}, not to its name"
        return None
    from daskgen.store.objects.image_urls import image_size

    try:
        reference = read_reference(location, digest)
    except StoreError as exc:
        return reference_key(digest), str(exc)
    if reference is None:  # replaced by the bytes since the listing
        return None
    options = storage_options if storage_options is not None else getattr(location, "storage_options", None)
    try:
        size = image_size(reference.url, options)
    except InputError as exc:
        return reference_key(digest), (
            f"image {digest}: the file it refers to, {reference.url!r}, cannot be found ({exc}); put it back there"
        )
    if size != reference.size:
        return reference_key(digest), (
            f"image {digest}: the file it refers to, {reference.url!r}, changed: {size} bytes, the run read "
            f"{reference.size}; restore the file the run read"
        )
    return None
