"""Helpers shared by the built-in engines (one place per rule).

* Engine-argument checks (:func:`require`, :func:`is_number`, :func:`check_number`,
  :func:`check_positive_int`): every engine's ``ConfigError`` reads
  ``"<engine> engine: <name> must be <expected>, got <value>"``.
* :func:`check_known_args`: unknown engine-argument names refused with close matches.
* :func:`set_result`: hand a :class:`~daskgen.engines.base.GenerationResult` to the coroutine
  awaiting it, from the awaiting loop's thread or any other.
* :func:`bos_or_zero`: the token of the default health-check prompt.
* :func:`cuda_available`: whether torch sees a CUDA device (``False`` without torch).
* :func:`started`: a backend object set by an engine's start, or ``EngineError`` before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from daskgen.errors import ConfigError, EngineError

T = TypeVar("T")

__all__ = [
    "bos_or_zero",
    "check_known_args",
    "check_number",
    "check_positive_int",
    "cuda_available",
    "is_number",
    "require",
    "set_result",
    "started",
]


# --------------------------------------------------------------------------- engine-argument checks


def require(engine: str, ok: bool, name: str, expected: str, got: Any) -> None:
    """Raise ``ConfigError("<engine> engine: <name> must be <expected>, got <got>")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{engine} engine: {name} must be {expected}, got {got!r}")


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_number(engine: str, name: str, value: Any, low: float | None, integer: bool) -> None:
    """``value`` must be a number (an integer if ``integer``) >= ``low``, or > 0 when ``low`` is None."""
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and (value > 0 if low is None else value >= low)
    bound = "> 0" if low is None else f">= {low}"
    require(engine, ok, name, f"{'an integer' if integer else 'a number'} {bound}", value)


def check_positive_int(engine: str, name: str, value: Any) -> None:
    """``value`` must be ``None`` or an integer >= 1."""
    ok = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    require(engine, ok, name, "a positive integer or null", value)


def check_known_args(engine: str, args: Mapping[str, Any], valid: Iterable[str], where: str) -> None:
    """Raise ``ConfigError`` for keys of ``args`` not in ``valid``, suggesting close matches.

    ``where`` says what the valid names are (e.g. ``"sglang ServerArgs fields"``); the message
    lists every valid name.
    """
    names = sorted(valid)
    unknown = sorted(set(args) - set(names))
    if not unknown:
        return
    hints = []
    for key in unknown:
        close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
        hints.append(f"{key!r} (did you mean {' or '.join(map(repr, close))}?)" if close else repr(key))
    raise ConfigError(
        f"{engine} engine: unknown engine_args {', '.join(hints)}; engine_args must be {where}; "
        f"valid names are: {', '.join(names)}"
    )


# --------------------------------------------------------------------------- results, health, devices


def set_result(future: asyncio.Future, result: Any) -> None:
    """Resolve ``future`` with ``result`` unless it is done; callable from any thread.

    On the future's own (running) loop it is set at once; from elsewhere it is scheduled on that
    loop, and dropped when the loop is closed (nobody waits any more).
    """
    loop = future.get_loop()
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is running:
        if not future.done():
            future.set_result(result)
        return

    def settle() -> None:
        if not future.done():
            future.set_result(result)

    with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody waits any more
        loop.call_soon_threadsafe(settle)


def bos_or_zero(bos: Any, vocab_size: int | None) -> int:
    """``bos`` when it is a token id inside the vocabulary, else 0 (the health check's prompt token)."""
    vocab = vocab_size or 1
    return bos if isinstance(bos, int) and 0 <= bos < vocab else 0


def cuda_available() -> bool:
    """Whether torch sees a CUDA device; ``False`` when torch is not installed (imports torch)."""
    from importlib.util import find_spec

    if find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def started(engine: str, part: T | None) -> T:
    """``part`` (a backend object the engine sets when it starts); ``EngineError`` while it is ``None``."""
    if part is None:
        raise EngineError(f"{engine} engine not started")
    return part
