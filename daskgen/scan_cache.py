"""Reuse the input scan when a run resumes on an unchanged input file.

Starting a run reads, validates, tokenizes and fingerprints every prompt (``data.scan_prompts``):
about 15 s per million short prompts, all before any engine works.  A resumed run on the same
file needs none of it: the scan's result (row count, fingerprint, overlong rows) is written next
to the store's metadata, keyed by the file's path, size, modification and change times, inode and
device, the tokenizer's identity and the settings that change the scan.  Any write to the file
(even one that restores its modification time) or ``touch``-ing it makes the next run scan it
again; a file that changed while it was being scanned is not recorded.  In-memory inputs are
always scanned.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from daskgen.data import InputScan

logger = logging.getLogger(__name__)

CACHE_NAME = "daskgen-input-scan.json"


def scan_key(source: Any, tokenizer_id: dict[str, Any], max_prompt_tokens: int, skip_overlong: bool
             ) -> dict[str, Any] | None:
    """What must be unchanged for a stored scan to hold; ``None`` when ``source`` is not a file."""
    if not isinstance(source, (str, Path)):
        return None
    try:
        st = os.stat(source)
    except OSError:
        return None  # the scan itself reports a missing file
    # ctime cannot be set back by users (touch -r, os.utime and rsync restore mtime, not ctime)
    return {"path": str(Path(source).resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev, "tokenizer": tokenizer_id,
            "max_prompt_tokens": max_prompt_tokens, "skip_overlong": skip_overlong}


def load_scan(store_path: str | Path, key: dict[str, Any] | None, source: Any) -> InputScan | None:
    """The stored scan for ``key``, or ``None`` (no key, no stored scan, or a different one).

    The returned scan has no ``ids``: they are only needed to create a store, which exists here.
    """
    path = Path(store_path) / CACHE_NAME
    if key is None or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        if doc.get("key") != key:
            return None
        overlong = {int(row): str(why) for row, why in doc["overlong"].items()}
        n_rows, fingerprint = int(doc["n_rows"]), str(doc["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # unreadable or another format: rescan
        return None
    logger.info("input %s is unchanged since the last run: reusing its scan (%d rows)", key["path"], n_rows)
    return InputScan(source, n_rows, [], fingerprint, overlong)


def save_scan(store_path: str | Path, key: dict[str, Any] | None, scan: InputScan, source: Any) -> None:
    """Write the scan for the next run (atomically; a failure only costs that run a rescan).

    ``key`` is the one taken before the scan: when the file changed since, nothing is written.
    """
    if key is None or scan_key(source, key["tokenizer"], key["max_prompt_tokens"], key["skip_overlong"]) != key:
        return
    path = Path(store_path) / CACHE_NAME
    doc = {"key": key, "n_rows": scan.n_rows, "fingerprint": scan.fingerprint,
           "overlong": {str(row): why for row, why in scan.overlong.items()}}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
    except OSError as exc:
        logger.warning("could not save the input scan to %s (%s); the next run scans the input again", path, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()
