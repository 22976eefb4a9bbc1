"""Prompt input: read JSONL/Parquet, validate every row, tokenize, fingerprint.

Validation runs on the client before any engine starts, and reports every bad row with
its row number (1-based, the line number for JSONL) and column.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daskgen.errors import InputError

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED = 20


@dataclass
class PromptSet:
    """Validated, tokenized prompts ready to partition.

    ``token_ids[i]`` is ``None`` for rows recorded as failed before generation
    (``overlong[i]`` holds the reason).
    """

    rows: list[dict[str, Any]]
    ids: list[str]
    token_ids: list[list[int] | None]
    fingerprint: str
    overlong: dict[int, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)


def read_rows(source: str | Path | Sequence[Any]) -> list[dict[str, Any]]:
    """Read prompt rows from a ``.jsonl``/``.json``/``.parquet`` file or a Python sequence.

    Strings in a Python sequence become ``{"prompt": s}``.
    """
    if isinstance(source, (str, Path)):
        return _read_file(Path(source))
    return [{"prompt": r} if isinstance(r, str) else r for r in source]


def _read_file(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        raise InputError(f"prompt file {str(path)!r} does not exist; pass a JSONL or Parquet file.")
    if path.is_dir():
        raise InputError(f"prompt path {str(path)!r} is a directory; pass a JSONL or Parquet file.")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        return _read_parquet(path)
    if suffix in (".jsonl", ".json", ".ndjson"):
        return _read_jsonl(path)
    raise InputError(
        f"prompt file {str(path)!r} has extension {suffix!r}; expected .jsonl (one JSON object per line) "
        "or .parquet."
    )


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows, errors = [], []
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                errors.append(f"row {lineno}: empty line (expected one JSON object per line)")
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                errors.append(f"row {lineno}: not valid JSON ({exc.msg} at column {exc.colno})")
    _raise_if(errors, path)
    if not rows:
        raise InputError(f"prompt file {str(path)!r} is empty; expected at least one prompt row.")
    return rows


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"prompt file {str(path)!r} is not a readable Parquet file: {exc}") from exc
    if table.num_rows == 0:
        raise InputError(f"prompt file {str(path)!r} is empty; expected at least one prompt row.")
    return table.to_pylist()


def validate_rows(rows: Sequence[Any], source: str = "input") -> None:
    """Raise :class:`InputError` listing every malformed row (up to 20)."""
    if not rows:
        raise InputError(f"{source} has no prompts; expected at least one row.")
    errors: list[str] = []
    seen_ids: dict[str, int] = {}
    for number, row in enumerate(rows, start=1):
        errors.extend(f"row {number}: {msg}" for msg in _row_errors(row))
        if isinstance(row, dict) and row.get("id") is not None:
            key = str(row["id"])
            if key in seen_ids:
                errors.append(f"row {number}: column 'id': duplicate id {key!r} (first at row {seen_ids[key]})")
            seen_ids.setdefault(key, number)
    _raise_if(errors, source)


def _row_errors(row: Any) -> list[str]:
    if not isinstance(row, dict):
        return [f"expected a JSON object with 'messages' or 'prompt', found {type(row).__name__}"]
    has_messages = row.get("messages") is not None
    has_prompt = row.get("prompt") is not None
    if has_messages and has_prompt:
        return ["has both 'messages' and 'prompt'; give exactly one"]
    if not (has_messages or has_prompt):
        return [f"missing column 'messages' or 'prompt' (found columns {sorted(row)})"]
    errors = _messages_errors(row["messages"]) if has_messages else _prompt_errors(row["prompt"])
    if row.get("id") is not None and not isinstance(row["id"], (str, int)):
        errors.append(f"column 'id': expected a string or integer, found {type(row['id']).__name__}")
    return errors


def _prompt_errors(prompt: Any) -> list[str]:
    if not isinstance(prompt, str):
        return [f"column 'prompt': expected a string, found {type(prompt).__name__}"]
    if not prompt.strip():
        return ["column 'prompt': empty string"]
    return []


def _messages_errors(messages: Any) -> list[str]:
    if not isinstance(messages, list):
        return [f"column 'messages': expected a list of {{role, content}} objects, found {type(messages).__name__}"]
    if not messages:
        return ["column 'messages': empty conversation"]
    errors = []
    for i, msg in enumerate(messages):
        where = f"column 'messages'[{i}]"
        if not isinstance(msg, dict):
            errors.append(f"{where}: expected an object with 'role' and 'content', found {type(msg).__name__}")
            continue
        if msg.get("role") not in ROLES:
            errors.append(f"{where}: role {msg.get('role')!r} is not one of {list(ROLES)}")
        if not isinstance(msg.get("content"), str):
            errors.append(f"{where}: 'content' must be a string, found {type(msg.get('content')).__name__}")
    return errors


def _raise_if(errors: list[str], source: Any) -> None:
    if not errors:
        return
    shown = "\n  ".join(errors[:MAX_REPORTED])
    more = f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
    raise InputError(f"{len(errors)} problem(s) in {source}:\n  {shown}{more}\nFix these rows and rerun.")


def fingerprint(rows: Iterable[dict[str, Any]]) -> str:
    """Stable hash of the input's content (order-sensitive)."""
    digest = hashlib.blake2b(digest_size=16)
    count = 0
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode())
        digest.update(b"\n")
        count += 1
    return f"blake2b:{digest.hexdigest()}:{count}"


def tokenize_rows(rows: Sequence[dict[str, Any]], tokenizer: Any) -> list[list[int]]:
    """Token ids per row: ``messages`` through the chat template, ``prompt`` as plain text."""
    out = []
    for number, row in enumerate(rows, start=1):
        if row.get("messages") is not None:
            out.append(_chat_ids(tokenizer, row["messages"], number))
        else:
            out.append(list(tokenizer(row["prompt"])["input_ids"]))
    return out


def _chat_ids(tokenizer: Any, messages: list[dict[str, str]], number: int) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(
            f"row {number}: column 'messages' needs a chat template, but the model's tokenizer has none; "
            "use 'prompt' strings or a model with a chat template."
        )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def check_lengths(token_ids: Sequence[list[int]], limit: int, *, skip: bool) -> dict[int, str]:
    """Find prompts longer than ``limit``; raise unless ``skip`` (then return row -> reason)."""
    overlong = {
        i: f"prompt has {len(ids)} tokens, more than max_prompt_tokens={limit}"
        for i, ids in enumerate(token_ids)
        if len(ids) > limit
    }
    if overlong and not skip:
        errors = [f"row {i + 1}: column 'messages'/'prompt': {why}" for i, why in overlong.items()]
        errors.append(
            "raise --max-prompt-tokens, shorten these prompts, or pass --skip-overlong to record them as failed"
        )
        _raise_if(errors, "input")
    return overlong


def load_prompts(source: str | Path | Sequence[Any], tokenizer: Any, *, max_prompt_tokens: int,
                 skip_overlong: bool = False) -> PromptSet:
    """Read, validate, fingerprint and tokenize prompts; nothing is dropped silently."""
    rows = read_rows(source)
    validate_rows(rows, str(source) if isinstance(source, (str, Path)) else "input")
    ids = [str(r["id"]) if r.get("id") is not None else "" for r in rows]
    token_ids: list[list[int] | None] = list(tokenize_rows(rows, tokenizer))
    overlong = check_lengths(token_ids, max_prompt_tokens, skip=skip_overlong)  # type: ignore[arg-type]
    for i in overlong:
        token_ids[i] = None
    return PromptSet(rows=rows, ids=ids, token_ids=token_ids, fingerprint=fingerprint(rows), overlong=overlong)
