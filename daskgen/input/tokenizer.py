"""Client-side tokenizer loading and identity (what a resume must share)."""

from __future__ import annotations

import hashlib
import json
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


#: Model types (``config.json``'s ``model_type``) for which ``AutoTokenizer`` loads a folder whose
#: ``tokenizer_config.json`` names ``TokenizersBackend`` (and no ``auto_map``) as exactly that class: transformers'
#: tokenizer tables neither register a model-specific class for them that overrides the folder's, nor route them
#: to Mistral's backend (``mistral`` is left out: some 5.x releases route it there).  tests/test_tokenizer_loading.py
#: checks every entry against the installed transformers, in the main lane (the newest 5.x) and in the vLLM lane
#: (the oldest supported).
DIRECT_BACKEND_MODEL_TYPES = frozenset({"gemma", "gemma2", "gemma3_text", "granite", "llama", "olmo2"})


def direct_backend(folder: Path) -> bool:
    """Whether ``folder``'s tokenizer is certainly ``TokenizersBackend`` under ``AutoTokenizer``'s rules, so it can be
    loaded without ``AutoTokenizer`` (which imports torch through ``AutoConfig``: seconds of CPU on each client)."""
    try:
        tok_config = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(tok_config, dict)
        and tok_config.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in tok_config
        and model_type in DIRECT_BACKEND_MODEL_TYPES
        and (folder / "tokenizer.json").is_file()
    )


def load_hf_tokenizer(model: str | Path) -> Any:
    """The Hugging Face tokenizer of the local model folder ``model``, as ``AutoTokenizer.from_pretrained`` loads it.

    Folders :func:`direct_backend` accepts load through ``TokenizersBackend`` directly (the same class, without
    importing torch); every other folder goes through ``AutoTokenizer``.
    """
    if direct_backend(Path(model)):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(model))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


def model_tokenizer(model: str, engine: str, *, simulated: bool) -> Any:
    """The tokenizer of ``model`` for engine ``engine``: the folder's Hugging Face tokenizer (offline), else a byte
    tokenizer when the engine is ``simulated`` (the engine class says so)."""
    if has_tokenizer(model):
        tok = load_hf_tokenizer(model)
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
