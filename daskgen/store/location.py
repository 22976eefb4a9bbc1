"""Where a store lives: a local folder or a prefix on object storage (S3, GCS, Azure, memory).

Every module reaches the store through a :class:`StoreLocation` (:func:`locate`), never through
``pathlib`` directly: it hands zarr its store object and offers the few whole-object operations
daskgen needs outside zarr (read ``zarr.json``, the run lock's conditional writes, listing files).

Object storage goes through :class:`zarr.storage.ObjectStore` on top of ``obstore`` (chosen over
fsspec/s3fs because obstore exposes *conditional writes* — create-if-absent and replace-if-ETag-matches
— the same way on S3, GCS and Azure, which the one-client lock (:mod:`daskgen.store.records.lock`) needs; s3fs
has no public API for them).  Credentials and endpoint come from the standard environment
(``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``, ``AWS_ALLOW_HTTP``; ``GOOGLE_*``; ``AZURE_*``) or from ``storage_options`` (the run
config's key of that name, passed to :func:`obstore.store.from_url`).  Options are never written to
the store.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from daskgen.errors import StoreError
from daskgen.store.objects.object_client import endpoint_of, object_store_for

#: URL schemes served by object storage (``file://`` is a local folder).
OBJECT_SCHEMES = ("s3", "s3a", "gs", "gcs", "az", "azure", "abfs", "abfss", "memory", "http", "https")


def is_url(store: str | Path) -> bool:
    """True when ``store`` names object storage (``scheme://...``) rather than a local path."""
    text = str(store)
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.lower() != "file"


class StoreLocation:
    """A store's place. Subclasses: :class:`LocalLocation`, :class:`ObjectLocation`.

    Keys are ``/``-separated paths inside the store (``zarr.json``, ``status/c/0``, ``daskgen.lock``).
    ``version`` values are opaque tokens of :meth:`read_versioned` for :meth:`replace_object`.
    """

    url: str
    is_local: bool = False

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StoreLocation) and type(other) is type(self) and other.url == self.url

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.url))

    def zarr_store(self, read_only: bool = False) -> Any:
        """What to pass to ``zarr.open_*``/``xarray.open_zarr`` as the store."""

    def is_file(self) -> bool:
        """True when the location is a local file (not a folder, not object storage)."""
        return False

    def check_reachable(self) -> None:
        """Raise :class:`StoreError` naming the fix when the store's place cannot be used (no-op locally)."""
        return None

    def read_bytes(self, key: str) -> bytes | None:
        """The object ``key``, or ``None`` when it does not exist."""
        raise NotImplementedError

    def read_tail(self, key: str, size: int) -> bytes | None:
        """The last ``size`` bytes of ``key`` (all of it when shorter); ``None`` when it does not exist."""
        raise NotImplementedError

    def is_empty(self) -> bool:
        """True when nothing is stored at this location yet."""
        raise NotImplementedError

    def create_object(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist; False when it does."""
        raise NotImplementedError

    def read_versioned(self, key: str) -> tuple[bytes, Any] | None:
        """``(data, version)`` of ``key``, or ``None`` when it does not exist."""
        raise NotImplementedError

    def replace_object(self, key: str, data: bytes, version: Any) -> Any | None:
        """Overwrite ``key`` only if it is still at ``version``; the new version, or ``None`` when it changed."""
        raise NotImplementedError

    def update_object(self, key: str, change: Callable[[bytes | None], bytes | None], attempts: int) -> bool:
        """Read ``key`` (``None`` when missing), let ``change`` give its new content (``None``: leave it), and write
        that only if ``key`` was not changed meanwhile (:meth:`create_object`, :meth:`replace_object`); retried
        from the read up to ``attempts`` times.  False when another writer changed it every time."""
        for _ in range(attempts):
            found = self.read_versioned(key)
            data = change(None if found is None else found[0])
            if data is None:
                return True
            if found is None and self.create_object(key, data):
                return True
            if found is not None and self.replace_object(key, data, found[1]) is not None:
                return True
        return False

    def write_object(self, key: str, data: bytes, *, create_location: bool = True) -> None:
        """Replace ``key`` atomically with ``data``: readers see the old or the new object, never a part.

        ``create_location=False``: when the location's own folder is missing (e.g. a store that ``daskgen
        pack`` is swapping in place), raise ``FileNotFoundError`` instead of creating it (object storage has
        no folders: ignored there)."""
        raise NotImplementedError

    def delete_object(self, key: str) -> None:
        """Delete ``key`` (no error when it is gone)."""
        raise NotImplementedError

    def files(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Every stored object (under the key prefix ``prefix``, a folder) as ``(key, size in bytes)``."""
        raise NotImplementedError

    def sibling(self, suffix: str) -> StoreLocation:
        """The location named like this one plus ``suffix`` (e.g. ``run.zarr`` -> ``run.zarr.packing``)."""
        raise NotImplementedError

    @property
    def name(self) -> str:
        """Last component of the location (``run.zarr``)."""
        return self.url.rstrip("/").rsplit("/", 1)[-1]


class LocalLocation(StoreLocation):
    """A store in a local (or shared POSIX) folder."""

    is_local = True

    def __init__(self, path: str | Path) -> None:
        text = str(path)
        self.path = Path(text[len("file://") :] if text.startswith("file://") else text)
        self.url = str(self.path)

    def zarr_store(self, read_only: bool = False) -> Any:
        return str(self.path)

    def is_file(self) -> bool:
        return self.path.is_file()

    def read_bytes(self, key: str) -> bytes | None:
        try:
            return (self.path / key).read_bytes()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def read_tail(self, key: str, size: int) -> bytes | None:
        try:
            with (self.path / key).open("rb") as fh:
                fh.seek(max(fh.seek(0, os.SEEK_END) - size, 0))
                return fh.read()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    def is_empty(self) -> bool:
        if self.path.is_file():
            return False
        return not (self.path.is_dir() and any(self.path.iterdir()))

    def create_object(self, key: str, data: bytes) -> bool:
        try:
            fd = os.open(self.path / key, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        return True

    def read_versioned(self, key: str) -> tuple[bytes, Any] | None:
        data = self.read_bytes(key)
        return None if data is None else (data, data)  # the content is the version (compare-then-replace)

    def replace_object(self, key: str, data: bytes, version: Any) -> Any | None:
        current = self.read_bytes(key)
        if current != version:
            return None
        tmp = _temporary(self.path / key)
        tmp.write_bytes(data)
        os.replace(tmp, self.path / key)
        return data

    def write_object(self, key: str, data: bytes, *, create_location: bool = True) -> None:
        """Write a temporary file beside ``key``, flush it to disk, then rename it into place."""
        target = self.path / key
        if create_location:
            target.parent.mkdir(parents=True, exist_ok=True)
        else:  # folder by folder below the location: each fails at once if the location's folder is gone
            for folder in reversed(Path(key).parents[:-1]):
                (self.path / folder).mkdir(exist_ok=True)
        tmp = _temporary(target)
        with tmp.open("wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)

    def delete_object(self, key: str) -> None:
        (self.path / key).unlink(missing_ok=True)

    def files(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """Like an object listing: without the temporary files of writes in progress, nor files that were renamed
        or deleted while the folder was listed."""
        for p in sorted((self.path / prefix).rglob("*")):
            if _TEMPORARY.search(p.name):
                continue
            try:
                found = p.stat()
            except FileNotFoundError:  # a temporary file renamed into place, or a file deleted, since the listing
                continue
            if stat.S_ISREG(found.st_mode):
                yield p.relative_to(self.path).as_posix(), found.st_size

    def sibling(self, suffix: str) -> LocalLocation:
        return LocalLocation(self.path.with_name(self.path.name + suffix))


#: A local write goes to a temporary file first (:func:`_temporary`), renamed into place once complete.
_TEMPORARY = re.compile(r"\.tmp-\d+$")


def _temporary(target: Path) -> Path:
    """The temporary file a local write of ``target`` goes through (this process's own)."""
    return target.with_name(f"{target.name}.tmp-{os.getpid()}")


class ObjectLocation(StoreLocation):
    """A store under a prefix of object storage, reached through ``obstore``.

    Picklable (workers rebuild the client from the URL and options); the client is built lazily.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage_options = dict(storage_options or {})
        self._store: Any = None
        self._zarr: dict[bool, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options}

    def __setstate__(self, state: dict[str, Any]) -> None:
        ObjectLocation.__init__(self, state["url"], state["storage_options"])

    @property
    def store(self) -> Any:
        """The ``obstore`` store of this prefix (built on first use)."""
        if self._store is None:
            self._store = object_store_for(self.url, self.storage_options)
        return self._store

    def zarr_store(self, read_only: bool = False) -> Any:
        if read_only not in self._zarr:
            from daskgen.store.objects.object_retry import RetryingObjectStore

            self._zarr[read_only] = RetryingObjectStore(self.store, read_only=read_only)
        return self._zarr[read_only]

    def read_bytes(self, key: str) -> bytes | None:
        got = self.read_versioned(key)
        return None if got is None else got[0]

    def read_tail(self, key: str, size: int) -> bytes | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            return bytes(obstore.get(self.store, key, options={"range": {"suffix": size}}).bytes())
        except (NotFoundError, FileNotFoundError):
            return None

    def is_empty(self) -> bool:
        import obstore

        for _batch in obstore.list(self.store, chunk_size=1):
            return False
        return True

    def check_reachable(self) -> None:
        """List one key: a missing bucket, refused credentials or an unreachable endpoint become one
        :class:`StoreError` that says which and how to fix it (before any engine starts)."""
        try:
            self.is_empty()
        except Exception as exc:  # obstore raises its own types (not found, permission, generic)
            problem = _object_store_problem(exc, endpoint_of(self.storage_options) or "the default endpoint")
            raise StoreError(f"cannot use the object store {self.url!r}: {problem}") from exc

    def create_object(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        from daskgen.store.objects.object_retry import retry_write

        try:
            retry_write(lambda: obstore.put(self.store, key, data, mode="create"))
        except AlreadyExistsError:
            return self.read_bytes(key) == data  # ours, when a dropped first attempt landed
        return True

    def read_versioned(self, key: str) -> tuple[bytes, Any] | None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            got = obstore.get(self.store, key)
        except (NotFoundError, FileNotFoundError):
            return None
        return bytes(got.bytes()), _version(got.meta)

    def replace_object(self, key: str, data: bytes, version: Any) -> Any | None:
        import obstore
        from obstore.exceptions import PreconditionError

        from daskgen.store.objects.object_retry import retry_write

        try:
            result = retry_write(lambda: obstore.put(self.store, key, data, mode=version))
        except PreconditionError:
            got = self.read_versioned(key)  # a dropped first attempt that landed is ours: its new version
            return got[1] if got is not None and got[0] == data else None
        return _version(result)

    def write_object(self, key: str, data: bytes, *, create_location: bool = True) -> None:
        """One PUT: object stores replace a whole object atomically."""
        import obstore

        from daskgen.store.objects.object_retry import retry_write

        retry_write(lambda: obstore.put(self.store, key, data))

    def delete_object(self, key: str) -> None:
        import obstore

        from daskgen.store.objects.object_retry import retry_write

        retry_write(lambda: obstore.delete(self.store, key))

    def files(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        import obstore

        for batch in obstore.list(self.store, prefix=prefix or None):
            for meta in batch:
                yield meta["path"], int(meta["size"])

    def sibling(self, suffix: str) -> ObjectLocation:
        return ObjectLocation(self.url + suffix, self.storage_options)


#: Words an object store's answer uses when it refuses the credentials (whole words: a duration such as
#: "30.240316ms" must not read as HTTP 403).
_AUTH_REFUSAL = re.compile(r"\b(InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|Forbidden|403|Unauthenticated)\b")


def _object_store_problem(exc: BaseException, endpoint: str) -> str:
    """What an object-store error at ``endpoint`` means for the user, and the fix."""
    text = describe_failure(exc)
    if "NoSuchBucket" in text or "bucket does not exist" in text.lower():
        return f"the bucket does not exist at {endpoint}. Create it, or fix the URL. ({text})"
    if any(sign in str(exc).lower() for sign in ("error sending request", "connect", "dns error")):
        return (
            f"{endpoint} could not be reached (after retries): check the endpoint (AWS_ENDPOINT_URL or "
            f"storage_options' endpoint) and that the service is up. ({text})"
        )
    if _AUTH_REFUSAL.search(text) or "PermissionDenied" in type(exc).__name__:
        return (
            f"access was refused at {endpoint}: check the credentials (AWS_ACCESS_KEY_ID / "
            f"AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, or storage_options) and their permissions. ({text})"
        )
    return f"it did not answer as expected at {endpoint} (after retries): {text}"


def _version(meta: Any) -> dict[str, str]:
    return {k: meta[k] for k in ("e_tag", "version") if meta.get(k) is not None}


#: A store given by the user: a local path, an object-storage URL (``s3://bucket/run.zarr``) or a location.
StoreRef = str | Path | StoreLocation


def default_output(store: str | Path | StoreLocation, suffix: str) -> Path:
    """A local output path named after the store: beside a local store, in the current folder for a URL."""
    loc = locate(store)
    return (loc.path if isinstance(loc, LocalLocation) else Path(loc.name)).with_suffix(suffix)


def describe_failure(exc: BaseException) -> str:
    """One readable line for a storage error (object-store errors carry a long debug dump after it)."""
    text = str(exc).split("Debug source:")[0]
    return f"{type(exc).__name__}: {' '.join(text.split())}"


def write_failures() -> tuple[type[BaseException], ...]:
    """Exception types of a failed write: OS errors, and object storage errors (network, permissions)."""
    from obstore.exceptions import BaseError

    return (OSError, BaseError)


def locate(store: str | Path | StoreLocation | None, storage_options: dict[str, Any] | None = None) -> StoreLocation:
    """The :class:`StoreLocation` of ``store``: a local path, a ``scheme://`` URL, or a location already.

    Raises :class:`~daskgen.errors.StoreError` when ``store`` is None or empty.
    """
    if isinstance(store, StoreLocation):
        return store
    if store is None or str(store) == "":
        raise StoreError("no store given: pass --store PATH (a folder, or s3://bucket/prefix, gs://, az://).")
    if is_url(store):
        return ObjectLocation(str(store), storage_options)
    if storage_options:
        raise StoreError(
            f"storage_options apply to object storage URLs (s3://, gs://, az://); the store "
            f"{str(store)!r} is a local path. Remove storage_options or use a URL."
        )
    return LocalLocation(store)


def announced_for(event: Any, location: StoreLocation) -> dict[str, Any] | None:
    """The message of a Dask event (``(time, msg)``, as ``Client.subscribe_topic`` hands it) when it names the
    store at ``location`` (its ``"store"`` key), else ``None``: one rule for every daskgen announcement topic."""
    _, msg = event
    if isinstance(msg, dict) and same_store(str(msg.get("store", "")), location):
        return msg
    return None


def same_store(url: str, location: StoreLocation) -> bool:
    """True when ``url`` (a store announced in a Dask event) is ``location`` (local paths compared after resolving)."""
    if location.is_local:
        return os.path.realpath(url) == os.path.realpath(location.url)
    return url.rstrip("/") == location.url
