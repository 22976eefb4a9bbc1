"""Reuse the input scan when a run resumes on an unchanged input file.

Starting a run reads, validates, tokenizes and fingerprints every prompt (``data.scan_prompts``):
about 5-15 s per million short prompts, all before any engine works.  A resumed run on the same
file needs none of it: the scan's result (row count, fingerprint, overlong rows) is kept in the
store's ``daskgen`` attrs (``input_scan``), keyed by the file's path, size, modification and
change times, inode and device, the tokenizer's identity and the settings that change the scan.
Any write to the file (even one that restores its modification time) or ``touch``-ing it makes
the next run scan it again; a file that changed while it was being scanned is not recorded.
In-memory inputs are always scanned.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from daskgen.input.rows import InputScan

logger = logging.getLogger(__name__)

#: Scans with more overlong rows than this are not kept (their messages would bloat the attrs).
MAX_KEPT_OVERLONG = 10_000


def scan_key(
    source: Any, tokenizer_id: dict[str, Any], max_prompt_tokens: int, skip_overlong: bool
) -> dict[str, Any] | None:
    """What must be unchanged for a kept scan to hold; ``None`` when ``source`` is not a file."""
    file = _file_identity(source)
    if file is None:
        return None
    return {**file, "tokenizer": tokenizer_id, "max_prompt_tokens": max_prompt_tokens, "skip_overlong": skip_overlong}


def _file_identity(source: Any) -> dict[str, Any] | None:
    """Path, size, times and inode of the input file; ``None`` when ``source`` is not an existing file path."""
    if not isinstance(source, (str, Path)):
        return None
    try:
        st = os.stat(source)
    except OSError:
        return None  # the scan itself reports a missing file
    # ctime cannot be set back by users (touch -r, os.utime and rsync restore mtime, not ctime)
    return {
        "path": str(Path(source).resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
        "device": st.st_dev,
    }


def load_scan(doc: dict[str, Any] | None, key: dict[str, Any] | None, source: Any) -> InputScan | None:
    """The scan kept in the store (its attrs' ``input_scan``, ``doc``) for ``key``, or ``None`` (no key,
    none kept, or another).

    The returned scan has no ``ids``: they are only needed to create a store, which exists here.
    """
    if key is None or not isinstance(doc, dict) or doc.get("key") != key:
        return None
    try:
        overlong = {int(row): str(why) for row, why in doc["overlong"].items()}
        n_rows, fingerprint = int(doc["n_rows"]), str(doc["fingerprint"])
    except (ValueError, KeyError, TypeError, AttributeError):  # another format: scan again
        return None
    logger.info("input %s is unchanged since the last run: reusing its scan (%d rows)", key["path"], n_rows)
    return InputScan(source, n_rows, [], fingerprint, overlong)


def scan_record(key: dict[str, Any] | None, scan: InputScan, source: Any) -> dict[str, Any] | None:
    """The attrs entry to keep for ``scan``, or ``None`` when it must not be kept.

    ``key`` is the one taken before the scan: when the file changed since, nothing is kept.
    """
    if key is None or len(scan.overlong) > MAX_KEPT_OVERLONG or scan.images:
        return None  # an input with images is scanned again: its images may change without the file
    if scan_key(source, key["tokenizer"], key["max_prompt_tokens"], key["skip_overlong"]) != key:
        return None
    return {
        "key": key,
        "n_rows": scan.n_rows,
        "fingerprint": scan.fingerprint,
        "overlong": {str(row): why for row, why in scan.overlong.items()},
        "prefix": scan.prefix.summary() if scan.prefix is not None else None,
    }
