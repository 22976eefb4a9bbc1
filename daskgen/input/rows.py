"""Prompt input: read JSONL/Parquet, validate every row, tokenize, fingerprint.

Validation runs on the client before any engine starts, and reports every bad row with
its row number and column.  Rows are numbered from 0, as the store's ``prompt_index`` numbers them (row N
is line N + 1 of a JSONL file); a line that is not a JSON object is named by its line number.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import InputError
from daskgen.input import adapters, chat_template, response_format
from daskgen.input import image_refs as refs
from daskgen.input.chat_template import ChatTemplate
from daskgen.input.columns import ColumnCheck, kept_values
from daskgen.input.prefix import PrefixKeys, PrefixScan
from daskgen.input.response_format import FormatCheck, ResponseFormat

if TYPE_CHECKING:
    from daskgen.input.image_tokens import VisionTokens

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED = 20
#: How the errors number rows, said under every list of them.
ROW_NUMBERING = "Rows count from 0, as the store's prompt_index does (row N is line N + 1 of a JSONL file).\n"


def read_rows(source: str | Path | Sequence[Any]) -> list[dict[str, Any]]:
    """All prompt rows of a ``.jsonl``/``.parquet`` file or a Python sequence (small inputs, tests)."""
    return [row for _, row in iter_rows(source)]


def iter_rows(source: str | Path | Sequence[Any]) -> Iterator[tuple[int, Any]]:
    """Stream ``(index, row)`` (0-based, the store's ``prompt_index``) without holding the input in memory.

    Strings in a Python sequence become ``{"prompt": s}``.  Unparseable JSONL lines raise
    :class:`InputError` naming every bad line.
    """
    if not isinstance(source, (str, Path)):
        yield from ((i, {"prompt": r} if isinstance(r, str) else r) for i, r in enumerate(source))
        return
    path = _check_path(Path(source))
    reader = _iter_parquet if path.suffix.lower() in (".parquet", ".pq") else _iter_jsonl
    count = 0
    for item in reader(path):
        count += 1
        yield item
    if count == 0:
        raise InputError(f"prompt file {str(path)!r} is empty; expected at least one prompt row.")


def _check_path(path: Path) -> Path:
    if not path.exists():
        raise InputError(f"prompt file {str(path)!r} does not exist; pass a JSONL or Parquet file.")
    if path.is_dir():
        raise InputError(f"prompt path {str(path)!r} is a directory; pass a JSONL or Parquet file.")
    if path.suffix.lower() not in (".parquet", ".pq", ".jsonl", ".json", ".ndjson"):
        raise InputError(
            f"prompt file {str(path)!r} has extension {path.suffix.lower()!r}; expected .jsonl "
            "(one JSON object per line) or .parquet."
        )
    return path


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    errors = []
    with path.open("r", encoding="utf-8-sig") as fh:  # a byte-order mark some editors write is not data
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                errors.append(f"line {lineno}: empty line (expected one JSON object per line)")
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                errors.append(f"line {lineno}: not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not errors:
                yield lineno - 1, row
    _raise_if(errors, path)


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for corrupt files
        raise InputError(f"prompt file {str(path)!r} is not a readable Parquet file: {exc}") from exc
    number = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            yield number, row
            number += 1


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
    errors += refs.images_column_errors(row)
    if row.get("id") is not None and not isinstance(row["id"], (str, int)):
        errors.append(f"column 'id': expected a string or integer, found {type(row['id']).__name__}")
    return errors + chat_template.row_errors(row)


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
        errors += refs.content_errors(msg.get("content"), where)
    return errors


def _raise_if(errors: list[str], source: Any) -> None:
    if not errors:
        return
    shown = "\n  ".join(errors[:MAX_REPORTED])
    more = f"\n  ... and {len(errors) - MAX_REPORTED} more" if len(errors) > MAX_REPORTED else ""
    raise InputError(
        f"{len(errors)} problem(s) in {source}:\n  {shown}{more}\n{ROW_NUMBERING}Fix these rows and rerun."
    )


class _Fingerprint:
    """Order-sensitive hash of rows, fed one row at a time (one pass over a streamed input)."""

    def __init__(self) -> None:
        self._digest = hashlib.blake2b(digest_size=16)
        self.count = 0

    def add(self, row: Any) -> None:
        self._digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=str).encode() + b"\n")
        self.count += 1

    def value(self) -> str:
        return f"blake2b:{self._digest.hexdigest()}:{self.count}"


def fingerprint(rows: Iterable[dict[str, Any]]) -> str:
    """Stable hash of the input's content (order-sensitive); what a resume compares."""
    digest = _Fingerprint()
    for row in rows:
        digest.add(row)
    return digest.value()


def holds_input(source: Any, wanted: Any, on_row: Callable[[Any], None] | None = None) -> bool:
    """True when ``source`` is a file whose rows have the fingerprint ``wanted`` (a store's input, from its attrs);
    ``on_row`` sees each row as it is read (one pass).  A missing, unreadable or other file is ``False``."""
    if not isinstance(source, (str, Path)) or not Path(source).is_file():
        return False

    def rows() -> Iterator[Any]:
        for _, row in iter_rows(source):
            if on_row is not None:
                on_row(row)
            yield row

    try:
        return fingerprint(rows()) == wanted
    except (OSError, InputError):
        return False


def tokenize_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer: Any,
    template: ChatTemplate | None = None,
    numbers: Iterable[int] | None = None,
    vision: VisionTokens | None = None,
) -> list[list[int]]:
    """Token ids per row: ``messages`` through the chat template (with the run's ``template`` options and the
    row's own), ``prompt`` as plain text after one image block per image (``vision``: the model's image tokens).
    Each image is one placeholder token here (:func:`daskgen.input.image_tokens.expand` expands them).  ``numbers``
    are the rows' indices in the input, for errors (default: from 0)."""
    template = template or ChatTemplate()
    out = []
    for number, row in zip(range(len(rows)) if numbers is None else numbers, rows, strict=True):
        if row.get("messages") is not None:
            out.append(template.ids(tokenizer, row, number))
            continue
        ids = list(tokenizer(row["prompt"])["input_ids"])
        if row.get(refs.IMAGES_COLUMN):
            if vision is None:
                raise InputError(f"row {number}: column 'images' needs a model with image tokens")
            from daskgen.input.image_tokens import prompt_with_images

            ids = prompt_with_images(ids, vision, len(row[refs.IMAGES_COLUMN]))
        out.append(ids)
    return out


def check_lengths(lengths: dict[int, int], limit: int, *, skip: bool) -> dict[int, str]:
    """Given 0-based row -> token count, find prompts over ``limit``; raise unless ``skip``."""
    overlong = {
        i: f"prompt has {n} tokens, more than max_prompt_tokens={limit}" for i, n in lengths.items() if n > limit
    }
    if overlong and not skip:
        errors = [f"row {i}: column 'messages'/'prompt': {why}" for i, why in overlong.items()]
        errors.append(
            "raise --max-prompt-tokens, shorten these prompts, or pass --skip-overlong to record them as failed"
        )
        _raise_if(errors, "input")
    return overlong


@dataclass
class InputScan:
    """What one streaming pass over the input learned; no prompt text or tokens are kept."""

    source: Any
    n_rows: int
    ids: list[str]
    fingerprint: str
    overlong: dict[int, str] = field(default_factory=dict)
    columns: tuple[str, ...] = ()  # the kept input columns (``keep_columns``, ``"*"`` resolved)
    structured: bool = False  # some row has its own ``response_format`` (:mod:`daskgen.input.response_format`)
    prefix: PrefixKeys | None = None  # shared-prefix keys per row (:mod:`daskgen.input.prefix`); None: not known
    max_images: int = 0  # the most images one row names (:mod:`daskgen.images`)
    images: str = ""  # the digest of every image's hash in input order ("": no images)
    image_processor: dict[str, Any] | None = None  # the model's image processor's identity (None: no images)
    image_token: int | None = None  # the model's image placeholder token (None: no images)

    def __len__(self) -> int:
        return self.n_rows

    def image_identity(self) -> dict[str, Any]:
        """What the store's input identity records of the images (a resume with others is refused)."""
        return {"images": self.images, "image_processor": self.image_processor, "image_token_id": self.image_token}


def scan_prompts(
    source: str | Path | Sequence[Any],
    tokenizer: Any,
    *,
    max_prompt_tokens: int,
    skip_overlong: bool = False,
    template: ChatTemplate | None = None,
    keep_columns: tuple[str, ...] | str = (),
    reserved_columns: Collection[str] = (),
    check_row: Callable[[Any], list[str]] | None = None,
    images: Any = None,
) -> InputScan:
    """Validate, fingerprint and length-check every row in one streaming pass.

    Raises :class:`InputError` listing every bad row (row number and column); overlong prompts
    are an error unless ``skip_overlong`` (then they are returned to be recorded as failed).
    ``template`` renders ``messages`` rows; every row must have the ``keep_columns``
    (:mod:`daskgen.input.columns`), and with ``"*"`` the first row's columns may not take a ``reserved_columns``
    name (the planner passes :func:`daskgen.reserved.reserved_names`); ``check_row`` adds the problems it finds
    in a row (e.g. its ``sampling`` column) to the report; ``images`` checks the images rows name
    (a :class:`daskgen.images.scan.ImageCheck`; without it a row with images is an error).
    """
    name = str(source) if isinstance(source, (str, Path)) else "input"
    kept, formats, prefixes = ColumnCheck(keep_columns, reserved_columns), FormatCheck(), PrefixScan()
    ids, fingerprint, errors, lengths = _scan_rows(
        source, tokenizer, max_prompt_tokens, template, (kept, formats, prefixes), check_row, images
    )
    _raise_if(errors, name)
    if not ids:
        raise InputError(f"{name} has no prompts; expected at least one row.")
    overlong = check_lengths({i: n for i, n in lengths.items()}, max_prompt_tokens, skip=skip_overlong)
    scan = InputScan(source, len(ids), ids, fingerprint, overlong, kept.names, formats.used, prefixes.result())
    if images is not None and images.n_images:
        scan.max_images, scan.images = images.max_images, images.digest()
        scan.image_processor, scan.image_token = images.processing.identity(), images.processing.tokens.image
    return scan


def _scan_rows(
    source: str | Path | Sequence[Any],
    tokenizer: Any,
    max_prompt_tokens: int,
    template: ChatTemplate | None,
    checks: tuple[ColumnCheck, FormatCheck, PrefixScan],
    check_row: Callable[[Any], list[str]] | None = None,
    images: Any = None,
) -> tuple[list[str], str, list[str], dict[int, int]]:
    """One pass over the rows: their ids, the input fingerprint, every row error, and the token count of
    each prompt longer than ``max_prompt_tokens`` (tokenizing stops at the first error); each prompt's
    tokens go to the prefix scan."""
    kept, formats, prefixes = checks
    digest = _Fingerprint()
    errors: list[str] = []
    ids: list[str] = []
    seen: dict[str, int] = {}
    lengths: dict[int, int] = {}
    for number, row in iter_rows(source):
        found = _row_errors(row) + (check_row(row) if check_row else [])
        if isinstance(row, dict):
            found += kept.row_errors(row, number) + formats.row_errors(row)
        digest.add(row)
        ids.append(_row_id(row, number, seen, errors))
        extra, vision = 0, None
        if not found and refs.has_images(row):  # every row's images are checked, whatever other rows hold
            if images is None:
                found.append("names images, but this input is read without image support")
            else:
                image_errors, extra = images.row(row)
                found += image_errors
                vision = images.processing.tokens if not found else None
        errors += [f"row {number}: {msg}" for msg in found]
        if not errors:
            tokens = tokenize_rows([row], tokenizer, template, [number], vision)[0]
            prefixes.add(tokens)
            if (n_tokens := len(tokens) + extra) > max_prompt_tokens:
                lengths[len(ids) - 1] = n_tokens
    return ids, digest.value(), errors, lengths


def _row_id(row: Any, number: int, seen: dict[str, int], errors: list[str]) -> str:
    """The row's ``id`` ("" when it has none); a duplicate is added to ``errors``, a first sighting to ``seen``."""
    key = str(row["id"]) if isinstance(row, dict) and row.get("id") is not None else ""
    if key and key in seen:
        errors.append(f"row {number}: column 'id': duplicate id {key!r} (first at row {seen[key]})")
    if key:
        seen.setdefault(key, number)
    return key


def iter_selected_rows(source: str | Path | Sequence[Any], wanted: Iterator[int]) -> Iterator[tuple[int, Any]]:
    """``(index, row)`` of the rows whose 0-based indices ``wanted`` yields (ascending), streaming."""
    rows = iter_rows(source)
    index = -1
    for target in wanted:
        while index < target:
            _, row = next(rows)
            index += 1
        yield target, row


def iter_token_ids(
    source: str | Path | Sequence[Any], tokenizer: Any, wanted: Iterator[int], template: ChatTemplate | None = None
) -> Iterator[tuple[int, list[int], dict[str, Any]]]:
    """``(index, token ids, row)`` of the rows whose 0-based indices ``wanted`` yields (ascending), streaming."""
    for index, row in iter_selected_rows(source, wanted):
        yield index, tokenize_rows([row], tokenizer, template, [index])[0], row


def worker_input(
    row: dict[str, Any],
    columns: tuple[str, ...],
    run_format: ResponseFormat | None,
    run_adapter: str | None,
    base: Path | None = None,
) -> dict[str, Any]:
    """The part of an input row the worker needs: what it tokenizes (the prompt or messages, with their
    chat-template columns), the text of the kept ``columns``, the row's structured-output format and LoRA adapter
    (its own, else the run's ``run_format`` and ``run_adapter``), the URLs of its images (``image_urls``, relative
    paths resolved against ``base``, the prompt file's folder); other columns stay on the client."""
    keys = ("messages", "chat_template_kwargs", "tools") if row.get("messages") is not None else ("prompt", "images")
    out = {key: row[key] for key in keys if row.get(key) is not None}
    if urls := [refs.resolved(ref.url, base) for ref in refs.image_refs(row)]:
        out["image_urls"] = urls
    if columns:
        out["columns"] = kept_values(row, columns)
    structured = response_format.for_row(row, run_format)
    if structured is not None:
        out["response_format"] = structured
    adapter = adapters.for_row(row, run_adapter)
    if adapter is not None:
        out["adapter"] = adapter
    return out


def input_folder(source: Any) -> Path | None:
    """The folder of the prompt file ``source`` (relative image paths are read from it); ``None`` for rows given
    in memory (read from the current folder)."""
    return Path(source).resolve().parent if isinstance(source, (str, Path)) else None
