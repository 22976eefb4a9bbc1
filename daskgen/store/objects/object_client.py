"""The obstore client behind an object-storage location: built once per (URL, options) per process, with
daskgen's timeouts and retries (the ``daskgen.object-store`` tunables) and the endpoint it talks to."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, cast

from daskgen.errors import StoreError

if TYPE_CHECKING:
    from obstore.store import ClientConfig


def endpoint_of(options: dict[str, Any]) -> str:
    """The endpoint requests go to: ``storage_options``' own, else ``AWS_ENDPOINT_URL`` (empty: the default)."""
    return str(options.get("endpoint") or options.get("aws_endpoint") or os.environ.get("AWS_ENDPOINT_URL", ""))


#: One client per (URL, options) per process: ``memory://`` stores live in it; S3 clients pool connections.
_STORES: dict[tuple[str, str], Any] = {}


def object_store_for(url: str, options: dict[str, Any]) -> Any:
    import json

    key = (url, json.dumps(options, sort_keys=True, default=str))
    if key not in _STORES:
        _STORES[key] = _build(url, options)
    return _STORES[key]


def retry_config() -> Any:
    """obstore's retry configuration from the ``daskgen.object-store`` tunables (Dask config): requests that
    fail with 5xx, a dropped connection or a timeout are retried with exponential backoff and jitter."""
    from datetime import timedelta

    from daskgen import tunables

    def seconds(key: str) -> timedelta:
        return timedelta(seconds=tunables.seconds(f"object-store.{key}"))

    backoff = {"init_backoff": seconds("init-backoff"), "max_backoff": seconds("max-backoff"), "base": 2.0}
    return {
        "max_retries": int(tunables.get("object-store.max-retries")),
        "retry_timeout": seconds("retry-timeout"),
        "backoff": backoff,
    }


def _client_defaults() -> dict[str, Any]:
    """Per-attempt timeouts of object-storage requests, from the ``daskgen.object-store`` tunables."""
    from daskgen import tunables

    return {
        "connect_timeout": f"{tunables.seconds('object-store.connect-timeout')}s",
        "timeout": f"{tunables.seconds('object-store.timeout')}s",
    }


def _build(url: str, options: dict[str, Any]) -> Any:
    from obstore.store import from_url

    opts = dict(options)
    client = cast("ClientConfig", {**_client_defaults(), **(opts.pop("client_options", {}) or {})})
    endpoint = endpoint_of(opts)
    if endpoint.startswith("http://"):
        client.setdefault("allow_http", True)  # a plain-HTTP endpoint (MinIO, moto, a local gateway)
    retry = opts.pop("retry_config", None) or retry_config()
    try:
        return from_url(url, client_options=client, retry_config=retry, **opts)
    except Exception as exc:  # obstore raises several types for bad URLs/options
        raise StoreError(
            f"cannot open the object store {url!r}: {exc}. Check the URL (s3://bucket/path, gs://, "
            "az://, memory:///) and the credentials in the environment or storage_options."
        ) from exc
