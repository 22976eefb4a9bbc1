"""Reading an image's bytes from its URL: a file path, ``file://``, ``data:`` (base64), object storage
(``s3://``, ``gs://``, ``az://``, ``memory://``, with the run's ``storage_options``) or ``http(s)://``.

Object storage and HTTP go through the same obstore clients as the store (:mod:`daskgen.store.object_client`),
with its timeouts and retries.  Every failure is an :class:`~daskgen.errors.InputError` naming the URL.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from daskgen.errors import InputError

#: Schemes read through an obstore client.
OBJECT_SCHEMES = ("s3", "gs", "az", "abfs", "memory", "http", "https")


def read_image_bytes(url: str, storage_options: dict[str, Any] | None = None) -> bytes:
    """The bytes of the image at ``url``; :class:`InputError` naming it when it cannot be read."""
    try:
        if url.startswith("data:"):
            return _data_url(url)
        scheme = urlsplit(url).scheme.lower() if "://" in url else ""
        if scheme == "file":
            return Path(unquote(urlsplit(url).path)).read_bytes()
        if scheme in OBJECT_SCHEMES:
            return _object_bytes(url, scheme, storage_options or {})
        if scheme:
            raise InputError(
                f"image {url!r:.100}: scheme {scheme!r} is not read; use a file path, file://, data:, http(s)://, "
                f"or one of {[s for s in OBJECT_SCHEMES if not s.startswith('http')]}"
            )
        return Path(url).expanduser().read_bytes()
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

    from daskgen.store.object_client import object_store_for

    parts = urlsplit(url)
    root = f"{scheme}://{parts.netloc}"
    options = dict(storage_options) if not scheme.startswith("http") else {}
    if scheme == "http":
        options["client_options"] = {"allow_http": True}
    store = object_store_for(root, options)
    return bytes(obstore.get(store, unquote(parts.path.lstrip("/"))).bytes())
