"""The published versions of a store's policy, as its policy record ``daskgen.policy`` holds them.

:mod:`daskgen.store.policy` writes the record (``publish_policy``) and owns its rules; this module reads it:
:class:`PolicyVersion`, :func:`read_versions`, :func:`newest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from daskgen.errors import PolicyError
from daskgen.store.commit_log import POLICY_KEY
from daskgen.store.location import StoreLocation


@dataclass(frozen=True)
class PolicyVersion:
    """One published version: its number, the checkpoint folder the engines load, when it was published, and
    its fingerprint (``None`` for a URL checkpoint): the version's digest and each tensor's hash by name.  A delta
    version also has ``base``, the version its delta applies to, and ``delta``, the delta's key in the store (its
    ``path`` is then the publisher's folder, which workers do not read)."""

    version: int
    path: str
    time: str
    digest: str | None = None
    tensors: dict[str, str] | None = None
    base: int | None = None
    delta: str | None = None


def read_versions(location: StoreLocation) -> list[PolicyVersion]:
    """Every published version, oldest first (empty when none was published)."""
    raw = location.read_bytes(POLICY_KEY)
    return [] if raw is None else parse_versions(raw, location)


def newest(location: StoreLocation) -> PolicyVersion | None:
    """The newest published version, or ``None``."""
    versions = read_versions(location)
    return versions[-1] if versions else None


def parse_versions(raw: bytes, location: StoreLocation) -> list[PolicyVersion]:
    """The versions in the policy record's bytes ``raw`` (read from ``location``, named in errors)."""
    try:
        return [
            PolicyVersion(
                int(v["version"]),
                str(v["path"]),
                str(v["time"]),
                v.get("digest"),
                v.get("tensors"),
                v.get("base"),
                v.get("delta"),
            )
            for v in json.loads(raw)["versions"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise PolicyError(
            f"{location.url}/{POLICY_KEY} is not a daskgen policy record ({type(exc).__name__}: {exc}); it is "
            "replaced in one atomic write, so it was changed outside daskgen. Delete it and publish the newest "
            "version again."
        ) from exc
