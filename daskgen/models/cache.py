"""The models' cache folder and how a model folder is built beside it and renamed into place."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

#: Environment variable naming the cache folder (default ``~/.cache/daskgen``).
CACHE_ENV = "DASKGEN_CACHE"


def default_cache_dir() -> Path:
    """Return the cache folder: ``$DASKGEN_CACHE`` if set, else ``~/.cache/daskgen``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "daskgen"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def staging_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh hidden folder beside ``final`` (same filesystem); remove it on exit."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary shared-readable folder
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_staging(final: Path, max_age: float = 3600.0) -> None:
    """Delete staging folders of ``final`` left by killed builders (older than ``max_age`` s)."""
    if not final.parent.is_dir():
        return
    now = time.time()
    for old in final.parent.glob(f".{final.name}.tmp-*"):
        with suppress(OSError):
            if now - old.stat().st_mtime > max_age:
                shutil.rmtree(old, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` atomically; a concurrent builder that won the race is fine."""
    try:
        tmp.rename(final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
