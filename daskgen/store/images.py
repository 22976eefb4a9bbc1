"""The store's copy of each distinct image, content-addressed.

An image is stored once, as the bytes it was read as (PNG, JPEG, ...), under ``images/<h[:2]>/<h>`` where ``h``
is the SHA-256 of those bytes (hex): every sample, prompt and rerun that uses the same image shares the one
object, and a reader checks it by hashing it again.  Objects are written atomically (:meth:`write_object` of the
store's location), so two workers writing the same image at once leave one whole copy.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

from daskgen.errors import StoreError

if TYPE_CHECKING:
    from daskgen.store.location import StoreLocation, StoreRef

#: The folder of the store holding the images.
IMAGES_FOLDER = "images"


def image_hash(data: bytes) -> str:
    """The content address of an image: the SHA-256 of its bytes, in hex."""
    return hashlib.sha256(data).hexdigest()


def blob_key(digest: str) -> str:
    """The store key of the image with hash ``digest``."""
    return f"{IMAGES_FOLDER}/{digest[:2]}/{digest}"


def write_blob(location: StoreLocation, digest: str, data: bytes) -> bool:
    """Store ``data`` under its hash unless it is there already; True when this call wrote it."""
    key = blob_key(digest)
    if location.read_tail(key, 1) is not None:  # there already (one byte read, not the image)
        return False
    location.write_object(key, data)
    return True


def read_blob(location: StoreLocation, digest: str) -> bytes | None:
    """The stored bytes of the image with hash ``digest`` (``None``: not stored)."""
    return location.read_bytes(blob_key(digest))


def checked_blob(location: StoreLocation, digest: str) -> bytes:
    """The stored bytes of the image with hash ``digest``, checked against it; :class:`StoreError` when the store
    does not hold it or its bytes hash to something else."""
    data = read_blob(location, digest)
    if data is None:
        raise StoreError(
            f"the store {location.url!r} holds no image {digest!r} (no object {blob_key(digest)!r}); pass a hash "
            "from the store's image_hash array, or run `daskgen verify` to list the images it misses."
        )
    found = image_hash(data)
    if found != digest:
        raise StoreError(
            f"the image {blob_key(digest)!r} of the store {location.url!r} is damaged: its bytes hash to {found!r}, "
            "not to its name; rerun the run that wrote it (its input still names the image) or restore the object."
        )
    return data


def read_image(store: StoreRef, digest: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of the image with SHA-256 ``digest`` (hex) stored in ``store`` (a folder, URL or location), as
    they were read from the input, checked against the hash (``daskgen.read_image``).

    Raises
    ------
    StoreError
        When the store does not hold the image, or its stored bytes do not hash to ``digest``.
    """
    from daskgen.store.location import locate

    return checked_blob(locate(store, storage_options), str(digest))


def stored_hashes(location: StoreLocation) -> set[str]:
    """The hashes of every image the store holds (from the object names, not their content)."""
    return {key.rsplit("/", 1)[-1] for key, _ in location.files(IMAGES_FOLDER)}
