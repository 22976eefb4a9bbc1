"""Where a prompt row names its images, and the row as its chat template sees it.

A ``messages`` row names images with OpenAI-style content parts, in any turn::

    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "photos/cat.jpg"}},
                                 {"type": "text", "text": "What is in the picture?"}]}

(``{"type": "image", "image": URL}`` is taken too, and ``"url"`` or ``"path"`` in place of ``"image"``, as
transformers' chat templates take them); a ``prompt`` row names them in an ``images`` column (a list of
URLs), and they come before its text.  A URL is a file path (relative: to the prompt file's folder), ``file://``,
an object-storage URL (``s3://``, ``gs://``, ``az://``: read with the run's ``storage_options``), ``http(s)://``
or a ``data:`` URL (base64).  A message whose content parts hold only text is joined into one string.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Content-part types that name an image.
IMAGE_PARTS = ("image_url", "image")
#: The column of a ``prompt`` row that lists its images.
IMAGES_COLUMN = "images"
#: URL schemes read as they are (the rest, and no scheme, are file paths).
URL_SCHEMES = ("file", "data", "http", "https", "s3", "gs", "az", "abfs", "memory")


@dataclass(frozen=True)
class ImageRef:
    """One image of a row: its URL as given and where the row names it (for errors)."""

    url: str
    where: str


#: Where an ``image`` content part may hold its URL: under its type (``{"type": "image", "image": URL}``), or as
#: transformers' chat templates take it (``"url"``, ``"path"``).
IMAGE_PART_KEYS = ("image", "url", "path")


def part_url(part: dict[str, Any]) -> Any:
    """The URL of an image content part (``None`` when the part holds none)."""
    if part.get("type") == "image":
        value = next((part[key] for key in IMAGE_PART_KEYS if part.get(key) is not None), None)
    else:
        value = part.get(part.get("type", ""))
    if isinstance(value, dict):
        value = value.get("url")
    return value


def image_refs(row: dict[str, Any]) -> list[ImageRef]:
    """The images of ``row`` in the order the model sees them (call :func:`row_errors` first)."""
    if row.get("messages") is None:
        images = row.get(IMAGES_COLUMN) or []
        return [ImageRef(url, f"column {IMAGES_COLUMN!r}[{i}]") for i, url in enumerate(images)]
    refs = []
    for m, message in enumerate(row["messages"]):
        content = message.get("content") if isinstance(message, dict) else None
        for p, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, dict) and part.get("type") in IMAGE_PARTS:
                refs.append(ImageRef(part_url(part), f"column 'messages'[{m}].content[{p}]"))
    return refs


def has_images(row: Any) -> bool:
    """True when ``row`` names at least one image (a malformed row: False; its errors come from the scan)."""
    if not isinstance(row, dict):
        return False
    try:
        return bool(image_refs(row))
    except (TypeError, AttributeError):
        return False


def content_errors(content: Any, where: str) -> list[str]:
    """Problems of one message's ``content``: a string, or a list of text and image parts."""
    if isinstance(content, str):
        return []
    if not isinstance(content, list) or not content:
        found = "an empty list" if isinstance(content, list) else type(content).__name__
        return [f"{where}: 'content' must be a string or a list of content parts, found {found}"]
    errors = []
    for p, part in enumerate(content):
        at = f"{where}.content[{p}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            if not isinstance(part.get("text"), str):
                errors.append(f"{at}: a text part needs 'text' (a string)")
        elif kind in IMAGE_PARTS:
            errors += url_errors(part_url(part), at)
        else:
            errors.append(
                f"{at}: expected a content part {{'type': 'text', 'text': ...}} or "
                f"{{'type': 'image_url', 'image_url': {{'url': ...}}}}, found {part!r:.80}"
            )
    return errors


def images_column_errors(row: dict[str, Any]) -> list[str]:
    """Problems of a row's ``images`` column (a list of URLs, on ``prompt`` rows only)."""
    images = row.get(IMAGES_COLUMN)
    if images is None:
        return []
    if row.get("messages") is not None:
        return [
            f"column {IMAGES_COLUMN!r} applies to 'prompt' rows; a 'messages' row names its images with "
            "image_url content parts"
        ]
    if not isinstance(images, list):
        return [f"column {IMAGES_COLUMN!r}: expected a list of image URLs, found {type(images).__name__}"]
    errors = []
    for i, url in enumerate(images):
        errors += url_errors(url, f"column {IMAGES_COLUMN!r}[{i}]")
    return errors


def url_errors(url: Any, where: str) -> list[str]:
    """Problems of an image URL (it must be a non-empty string)."""
    if not isinstance(url, str) or not url.strip():
        return [f"{where}: expected an image URL or file path (a non-empty string), found {url!r:.60}"]
    return []


def resolved(url: str, base: Path | None) -> str:
    """``url`` with a relative file path made absolute against ``base`` (the prompt file's folder)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ("data" if url.startswith("data:") else "")
    if scheme in URL_SCHEMES or base is None:
        return url
    path = Path(url).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as the chat template takes them: an image part becomes ``{"type": "image"}`` (the template
    renders its placeholder; the URL stays out of the prompt), a content of text parts only one string."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = [{"type": "image"} if p.get("type") in IMAGE_PARTS else p for p in content]
            content = "".join(p["text"] for p in parts) if all(p.get("type") == "text" for p in parts) else parts
            message = {**message, "content": content}
        out.append(message)
    return out
