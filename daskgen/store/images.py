"""The store's images, content-addressed: each distinct image kept once, as its bytes or as a reference.

An image is named by ``h``, the SHA-256 of the bytes it was read as (PNG, JPEG, ...), hex; every sample, prompt
and rerun that uses the same image shares what the store keeps of it, in one of two forms (the run option
``image_storage``):

- ``copy`` (the default): the bytes themselves, under ``images/<h[:2]>/<h>``;
- ``reference``: a small JSON object under ``images/<h[:2]>/<h>.ref`` (:class:`ImageReference`: the absolute URL
  the image was read from and its size in bytes); the image stays where the input named it, and the store depends
  on it staying there unchanged.  A ``data:`` URL has nothing to point at: its bytes are kept as in ``copy``.

A store may hold both forms (a resume with the other ``image_storage``); the bytes win where both exist.  Every
reader resolves a hash through :func:`image_bytes` (the bytes, else the reference's URL read with the reader's
storage options) and checks what it got against the hash, so a referenced file that changed or vanished is an
:class:`~daskgen.errors.ImageReferenceError` naming the image and the file.  Objects are written atomically
(:meth:`write_object` of the store's location), so two workers writing the same image at once leave one whole copy.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import ImageReferenceError, InputError, StoreError

if TYPE_CHECKING:
    from daskgen.store.location import StoreLocation, StoreRef

#: The folder of the store holding the images.
IMAGES_FOLDER = "images"
#: The two forms an image is kept in (the ``image_storage`` run option's values).
COPY, REFERENCE = "copy", "reference"
#: The suffix of a reference object's key.
REFERENCE_SUFFIX = ".ref"


def image_hash(data: bytes) -> str:
    """The content address of an image: the SHA-256 of its bytes, in hex."""
    return hashlib.sha256(data).hexdigest()


def blob_key(digest: str) -> str:
    """The store key of the bytes of the image with hash ``digest``."""
    return f"{IMAGES_FOLDER}/{digest[:2]}/{digest}"


def reference_key(digest: str) -> str:
    """The store key of the reference to the image with hash ``digest``."""
    return blob_key(digest) + REFERENCE_SUFFIX


@dataclass(frozen=True)
class ImageReference:
    """Where an image kept as a reference lies: the absolute URL it was read from, and its size in bytes."""

    url: str
    size: int

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def parse(cls, data: bytes, key: str) -> ImageReference:
        """The reference stored as ``data`` under ``key``; :class:`StoreError` for an object that is none."""
        try:
            found = json.loads(data)
            return cls(str(found["url"]), int(found["size"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"the image reference {key!r} is not a JSON object with 'url' and 'size' ({exc}); write the URL of "
                "the image and its size in bytes into it, or delete it and rerun the run that stored it."
            ) from exc


def keep_image(location: StoreLocation, digest: str, data: bytes, url: str, storage: str = COPY) -> bool:
    """Keep the image ``data`` read from ``url`` in the store as ``storage`` (:data:`COPY` or :data:`REFERENCE`)
    asks, unless it is there already; True when this call wrote something."""
    if storage == REFERENCE and not url.startswith("data:"):
        from daskgen.input.image_refs import resolved  # the input's rule: a relative path made absolute

        return write_reference(location, digest, ImageReference(resolved(url, Path.cwd()), len(data)))
    return write_blob(location, digest, data)


def write_blob(location: StoreLocation, digest: str, data: bytes) -> bool:
    """Store ``data`` under its hash unless it is there already (a reference to it is then dropped: the bytes
    replace it); True when this call wrote it."""
    key = blob_key(digest)
    if location.read_tail(key, 1) is not None:  # there already (one byte read, not the image)
        return False
    location.write_object(key, data)
    if location.read_tail(reference_key(digest), 1) is not None:
        location.delete_object(reference_key(digest))
    return True


def write_reference(location: StoreLocation, digest: str, reference: ImageReference) -> bool:
    """Store ``reference`` for the image ``digest`` unless the store keeps it already (as bytes or a reference);
    True when this call wrote it."""
    if any(location.read_tail(key, 1) is not None for key in (blob_key(digest), reference_key(digest))):
        return False
    location.write_object(reference_key(digest), reference.to_bytes())
    return True


def read_blob(location: StoreLocation, digest: str) -> bytes | None:
    """The stored bytes of the image with hash ``digest`` (``None``: no bytes stored)."""
    return location.read_bytes(blob_key(digest))


def read_reference(location: StoreLocation, digest: str) -> ImageReference | None:
    """The reference to the image with hash ``digest`` (``None``: none stored)."""
    data = location.read_bytes(reference_key(digest))
    return None if data is None else ImageReference.parse(data, reference_key(digest))


def image_bytes(location: StoreLocation, digest: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of the image with hash ``digest``, checked against it: the stored bytes, else those the stored
    reference points at (read with ``storage_options``, default: the store's).

    Raises
    ------
    ImageReferenceError
        When the image is a reference whose file cannot be read or no longer hashes to ``digest``.
    StoreError
        When the store keeps no such image, or its stored bytes hash to something else.
    """
    data = read_blob(location, digest)
    if data is None:
        reference = read_reference(location, digest)
        if reference is not None:
            return referenced_bytes(location, digest, reference, storage_options)
        data = read_blob(location, digest)  # a run storing copies may have replaced the reference meanwhile
    if data is None:
        raise StoreError(
            f"the store {location.url!r} holds no image {digest!r} (no object {blob_key(digest)!r} nor "
            f"{reference_key(digest)!r}); pass a hash from the store's image_hash array, or run `daskgen verify` "
            "to list the images it misses."
        )
    found = image_hash(data)
    if found != digest:
        raise StoreError(
            f"the image {blob_key(digest)!r} of the store {location.url!r} is damaged: its bytes hash to {found!r}, "
            "not to its name; rerun the run that wrote it (its input still names the image) or restore the object."
        )
    return data


def referenced_bytes(
    location: StoreLocation, digest: str, reference: ImageReference, storage_options: dict[str, Any] | None = None
) -> bytes:
    """The bytes ``reference`` points at, checked against ``digest``; :class:`ImageReferenceError` naming the image
    and the file when they cannot be read or hash to something else."""
    from daskgen.store.objects.image_urls import read_image_bytes

    what = f"the image {digest} of the store {location.url!r} is kept as a reference to {reference.url!r}"
    options = storage_options if storage_options is not None else getattr(location, "storage_options", None)
    try:
        data = read_image_bytes(reference.url, options)
    except InputError as exc:
        raise ImageReferenceError(
            f"{what}, which cannot be read ({exc}). Expected there: {reference.size} bytes with SHA-256 {digest}. "
            f"Put the file back at {reference.url!r}, or write where it lies now into the store's "
            f"{reference_key(digest)!r} (JSON: url, size)."
        ) from exc
    found = image_hash(data)
    if found != digest:
        raise ImageReferenceError(
            f"{what}, and that file changed since the run read it: expected {reference.size} bytes with SHA-256 "
            f"{digest}, found {len(data)} bytes with SHA-256 {found}. Restore the file the run read (the store's "
            "prompts and answers were made from it); a run with image_storage: copy keeps the store's own copy."
        )
    return data


def read_image(store: StoreRef, digest: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of the image with SHA-256 ``digest`` (hex) of ``store`` (a folder, URL or location), as they were
    read from the input, checked against the hash (``daskgen.read_image``): the stored copy, or the file a reference
    points at.  ``storage_options`` open an object-storage store and read referenced images on object storage (for
    a local store, only the latter).

    Raises
    ------
    StoreError
        When the store does not hold the image, or its stored bytes do not hash to ``digest``;
        :class:`~daskgen.errors.ImageReferenceError` when it is a reference to a file that vanished or changed.
    """
    from daskgen.store.location import StoreLocation, is_url, locate

    remote = isinstance(store, StoreLocation) or is_url(store)
    return image_bytes(locate(store, storage_options if remote else None), str(digest), storage_options)


def stored_images(location: StoreLocation) -> dict[str, str]:
    """The hash of every image the store keeps -> how: :data:`COPY` (its bytes) or :data:`REFERENCE` (from the
    object names, not their content)."""
    found: dict[str, str] = {}
    for key, _ in location.files(IMAGES_FOLDER):
        name = key.rsplit("/", 1)[-1]
        if name.endswith(REFERENCE_SUFFIX):
            found.setdefault(name[: -len(REFERENCE_SUFFIX)], REFERENCE)
        else:
            found[name] = COPY
    return found


def stored_hashes(location: StoreLocation) -> set[str]:
    """The hashes of every image the store keeps, as bytes or as references (from the object names)."""
    return set(stored_images(location))


def storage_summary(kinds: dict[str, str]) -> str:
    """How the store keeps its images (``kinds``: :func:`stored_images`), as ``daskgen status`` and ``daskgen
    verify`` say it."""
    references = sum(kind == REFERENCE for kind in kinds.values())
    text = f"{len(kinds)} distinct, {len(kinds) - references} stored as bytes, {references} as references"
    if references:
        text += " to files outside the store (image_storage: reference; the store reads them there, so they must stay)"
    return text
