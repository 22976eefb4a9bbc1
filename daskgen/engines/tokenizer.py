"""The tokenizer an engine's model uses, found from the engine's name: :func:`load_tokenizer`.

A model folder's Hugging Face tokenizer when it has one (:func:`daskgen.input.tokenizer.model_tokenizer`), else a
byte tokenizer for an engine class that generates without a model (:meth:`~daskgen.engines.base.Engine.is_simulated`).
"""

from __future__ import annotations

from typing import Any

from daskgen.engines import resolve_engine_class
from daskgen.input.tokenizer import has_tokenizer, model_tokenizer


def load_tokenizer(model: str, engine: str, engine_args: dict[str, Any] | None = None) -> Any:
    """Load the model's Hugging Face tokenizer (offline), or a byte tokenizer for simulated engines."""
    if has_tokenizer(model):
        return model_tokenizer(model, engine, simulated=False)
    return model_tokenizer(model, engine, simulated=resolve_engine_class(engine).is_simulated(engine_args or {}))
