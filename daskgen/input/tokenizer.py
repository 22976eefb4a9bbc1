"""Client-side tokenizer loading and identity (what a resume must share)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from daskgen.errors import ConfigError
from daskgen.input.chat_template import ChatTemplate


class ByteTokenizer:
    """UTF-8 byte tokenizer used only with the ``simulated`` engine when the model has no tokenizer.

    Token id = byte value + 3 (0 pad, 1 bos, 2 eos).  No chat template: ``messages`` rows are
    rendered as ``role: content`` lines.
    """

    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    chat_template = "byte-lines"
    name_or_path = "daskgen-byte-tokenizer"

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [self.bos_token_id] + [b + 3 for b in text.encode()]}

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True, tokenize: bool = True
    ) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return self(text + ("assistant: " if add_generation_prompt else ""))["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


def has_tokenizer(model: str) -> bool:
    """Whether ``model`` is a local folder with tokenizer files."""
    return Path(model).is_dir() and any(Path(model).glob("tokenizer*"))


def model_tokenizer(model: str, engine: str, *, simulated: bool) -> Any:
    """The tokenizer of ``model`` for engine ``engine``: the folder's Hugging Face tokenizer (offline), else a byte
    tokenizer when the engine is ``simulated`` (the engine class says so)."""
    if has_tokenizer(model):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        if tok.pad_token_id is None:
            tok.pad_token = tok.eos_token
        return tok
    if simulated:
        return ByteTokenizer()
    raise ConfigError(
        f"model {model!r} is not a folder with tokenizer files; engine {engine!r} needs a local Hugging Face "
        "model folder (config.json, weights, tokenizer). Nothing is downloaded from a model hub."
    )


def tokenizer_identity(tokenizer: Any, template: ChatTemplate | None = None) -> dict[str, Any]:
    """What must match between runs on one store: vocabulary size, special ids, chat template hash, and the
    run's chat-template options (``template``: an overriding template's hash, its variables)."""
    own = getattr(tokenizer, "chat_template", None) or ""
    vocab = len(tokenizer) if hasattr(tokenizer, "__len__") else 259
    return {
        "name": str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
        "vocab_size": vocab,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        "chat_template_sha256": hashlib.sha256(str(own).encode()).hexdigest()[:16],
        **(template.identity() if template is not None else {}),
    }
