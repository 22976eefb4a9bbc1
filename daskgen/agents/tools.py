"""Tools for the tool loop: Python callables (sync or async) registered by name, run with a timeout."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from daskgen.agents.parsers import ToolCall
from daskgen.errors import ConfigError
from daskgen.importing import import_object

logger = logging.getLogger(__name__)

_REGISTRY: dict[str, Callable[..., Any]] = {}


def register_tool(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: make a callable available to ``agent_args: {tools: [name]}``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY[name or fn.__name__] = fn
        return fn

    return wrap


def load_tools(spec: Sequence[str] | Mapping[str, str] | None) -> dict[str, Callable[..., Any]]:
    """Resolve tools given as registered names or ``package.module:function`` paths.

    A mapping gives explicit names: ``{"calc": "mytools:calculator"}``.
    """
    items = spec.items() if isinstance(spec, Mapping) else ((None, s) for s in (spec or []))
    tools = {}
    for name, target in items:
        fn = _resolve(target)
        tools[name or target.rpartition(":")[2]] = fn
    return tools


def _resolve(target: str) -> Callable[..., Any]:
    if target in _REGISTRY:
        return _REGISTRY[target]
    if ":" not in target:
        raise ConfigError(
            f"unknown tool {target!r}; registered tools are {sorted(_REGISTRY)}; or give 'package.module:function'."
        )
    fn = import_object(target, "tool")
    if not callable(fn):
        raise ConfigError(f"tool {target!r} is not callable")
    return fn


async def call_tool(
    tools: Mapping[str, Callable[..., Any]], call: ToolCall, timeout_s: float, *, images: bool = False
) -> str | list[dict[str, Any]]:
    """Run one call; failures (unknown tool, bad JSON, exception, timeout) become an error text for the model.

    A result holding images is, with ``images`` (the loop places tool images: ``max_tool_images``), its content
    parts (:func:`content_parts`); without, an error text telling the model the loop passes text only."""
    if call.error is not None:
        return f"Error: {call.error}"
    fn = tools.get(call.name or "")
    if fn is None:
        return f"Error: unknown tool {call.name!r}; available tools: {sorted(tools)}"
    try:
        if inspect.iscoroutinefunction(fn):
            result = await asyncio.wait_for(fn(**call.arguments), timeout_s)
        else:
            result = await asyncio.wait_for(asyncio.to_thread(fn, **call.arguments), timeout_s)
    except asyncio.TimeoutError:
        return f"Error: tool {call.name!r} timed out after {timeout_s:g} s"
    except Exception as exc:
        return f"Error: tool {call.name!r} raised {type(exc).__name__}: {exc}"
    if has_image(result):
        if not images:
            logger.warning(
                "tool %r returned an image, which this tool loop does not take (agent_args max_tool_images: 0): "
                "the model is told so",
                call.name,
            )
            return f"Error: tool {call.name!r} returned an image; this tool loop passes text results only"
        try:
            return content_parts(result)
        except ValueError as exc:
            return f"Error: tool {call.name!r} returned {exc}"
    return result if isinstance(result, str) else json.dumps(result, default=str)


#: Image content parts a tool may return, by their ``type``: the key that holds the image.
_IMAGE_PARTS = {"image_url": "image_url", "image": "image", "input_image": "image_url"}


def has_image(result: Any) -> bool:
    """Whether a tool's result holds an image content part (``{"type": "image_url", "image_url": ...}`` and the
    like); sent as JSON text, the model would see a URL, not the image."""
    if isinstance(result, Mapping):
        kind = result.get("type")
        named = isinstance(kind, str) and kind in _IMAGE_PARTS and _IMAGE_PARTS[kind] in result
        return named or any(map(has_image, result.values()))
    if isinstance(result, (list, tuple)):
        return any(map(has_image, result))
    return False


def content_parts(result: Any) -> list[dict[str, Any]]:
    """A tool's result with images as the content of its ``tool`` message: text parts ``{"type": "text", "text":
    ...}`` and image parts ``{"type": "image", "image": SOURCE}``, where SOURCE is a URL (a file path, ``file://``,
    object storage, ``http(s)://``, ``data:``), the image file's bytes or a Pillow image.

    The result is one content part or a list of them (``image_url`` parts as in a prompt's messages); anything
    else holding an image is a :class:`ValueError` naming what was expected."""
    expected = (
        "return images as content parts: {'type': 'image_url', 'image_url': {'url': ...}} (or {'type': 'image', "
        "'image': bytes or a Pillow image}), alone or in a list with {'type': 'text', 'text': ...} parts"
    )
    parts = [result] if isinstance(result, Mapping) else result
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, Mapping) for p in parts):
        raise ValueError(f"an image inside a {type(result).__name__}; {expected}")
    out = []
    for part in parts:
        kind = part.get("type")
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind in _IMAGE_PARTS and part.get(_IMAGE_PARTS[kind]) is not None:
            source = part[_IMAGE_PARTS[kind]]
            out.append({"type": "image", "image": source.get("url") if isinstance(source, Mapping) else source})
        else:
            raise ValueError(f"a content part that is neither text nor an image, {dict(part)!r:.100}; {expected}")
    return out
