"""Reading an image's bytes (or only its size) from its URL: a file path, ``file://``, ``data:`` (base64), object
storage (``s3://``, ``gs://``, ``az://``, ``memory://``, with the run's ``storage_options``) or ``http(s)://``.

Object storage and HTTP go through the same obstore clients as the store (:mod:`daskgen.store.objects.object_client`),
with its timeouts and retries.  The input scan, the workers and the store's readers of images kept as references
(:mod:`daskgen.store.images`) read images through here.  Every failure is an :class:`~daskgen.errors.InputError`
naming the URL.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

from daskgen.errors import InputError

#: Schemes read through an obstore client.
OBJECT_SCHEMES = ("s3", "gs", "az", "abfs", "memory", "http", "https")

T = TypeVar("T")


def read_image_bytes(url: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of the image at ``url``; :class:`InputError` naming it when it cannot be read."""
    return _named(url, lambda: _bytes(url, storage_options or {}))


def image_size(url: str, storage_options: dict[str, Any] | None = None) -> int:
    """The size in bytes of the image at ``url``, without reading it (a file's or object's metadata);
    :class:`InputError` naming it when it cannot be found."""
    return _named(url, lambda: _size(url, storage_options or {}))


def _bytes(url: str, storage_options: dict[str, Any]) -> bytes:
    if url.startswith("data:"):
        return _data_url(url)
    scheme = _scheme(url)
    if scheme in OBJECT_SCHEMES:
        return _object_bytes(url, scheme, storage_options)
    return _path(url, scheme).read_bytes()


def _size(url: str, storage_options: dict[str, Any]) -> int:
    if url.startswith("data:"):
        return len(_data_url(url))
    scheme = _scheme(url)
    if scheme in OBJECT_SCHEMES:
        import obstore

        store, path = _object_store(url, scheme, storage_options)
        return int(obstore.head(store, path)["size"])
    return _path(url, scheme).stat().st_size


def _scheme(url: str) -> str:
    """The URL's scheme (``""``: a file path); :class:`InputError` for a scheme images are not read from."""
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    if scheme and scheme != "file" and scheme not in OBJECT_SCHEMES:
        raise InputError(
            f"image {url!r:.100}: scheme {scheme!r} is not read; use a file path, file://, data:, http(s)://, "
            f"or one of {[s for s in OBJECT_SCHEMES if not s.startswith('http')]}"
        )
    return scheme


def _path(url: str, scheme: str) -> Path:
    return Path(unquote(urlsplit(url).path)) if scheme == "file" else Path(url).expanduser()


def _named(url: str, read: Callable[[], T]) -> T:
    """``read()``, its failures an :class:`InputError` naming ``url``."""
    try:
        return read()
    except InputError:
        raise
    except FileNotFoundError as exc:
        raise InputError(f"image {url!r:.100}: not found (no such file or object); check the path or URL") from exc
    except Exception as exc:  # OSError, obstore's errors, bad base64
        raise InputError(f"image {url!r:.100} cannot be read: {type(exc).__name__}: {exc}") from exc


def _data_url(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        raise InputError(f"image {url!r:.60}: a data: URL must be base64 ('data:image/png;base64,...')")
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error as exc:
        raise InputError(f"image {url!r:.60}: the data: URL is not valid base64 ({exc})") from exc


def _object_bytes(url: str, scheme: str, storage_options: dict[str, Any]) -> bytes:
    import obstore

    store, path = _object_store(url, scheme, storage_options)
    return bytes(obstore.get(store, path).bytes())


def _object_store(url: str, scheme: str, storage_options: dict[str, Any]) -> tuple[Any, str]:
    """The obstore client of ``url``'s bucket (or server) and the object's path in it."""
    from daskgen.store.objects.object_client import object_store_for

    parts = urlsplit(url)
    root = f"{scheme}://{parts.netloc}"
    options = dict(storage_options) if not scheme.startswith("http") else {}
    if scheme == "http":
        options["client_options"] = {"allow_http": True}
    return object_store_for(root, options), unquote(parts.path.lstrip("/"))
