"""Top-k logprobs in OpenAI-compatible answers, mapped to token ids.

A streamed chunk carries, per generated token, its alternatives: chat answers as
``logprobs.content[i].top_logprobs`` (``[{"token", "logprob"}, ...]``), completions as
``logprobs.top_logprobs[i]`` (``{token: logprob}``).  vLLM adds the sampled token when it is not among
the ``k`` asked for, so every list is ranked and cut to ``k`` here.  Tokens are text: vLLM names them
``token_id:<id>`` when asked (``return_tokens_as_token_ids``), and for other servers a text is mapped to
the one token id that it encodes to and decodes from (alternatives without one are left out).
"""

from __future__ import annotations

import math
from typing import Any

from daskgen.engines.base import TopLogprobs

__all__ = ["ServerTop", "retokenized_top", "server_top", "token_id_top"]

#: Per generated token, the server's ``(token text, logprob)`` alternatives.
ServerTop = list[list[tuple[str, float]]]
_TOKEN_ID = "token_id:"


def server_top(logprobs: dict[str, Any]) -> ServerTop:
    """The alternatives of one chunk's ``logprobs`` object (chat or completions), one list per token."""
    if isinstance(logprobs.get("content"), list):  # chat
        return [
            _pairs((a.get("token"), a.get("logprob")) for a in item.get("top_logprobs") or [])
            for item in logprobs["content"]
        ]
    if isinstance(logprobs.get("top_logprobs"), list):  # completions
        return [_pairs((entry or {}).items()) for entry in logprobs["top_logprobs"]]
    return []


def _pairs(items: Any) -> list[tuple[str, float]]:
    return [(str(token), float(value)) for token, value in items if value is not None and not math.isnan(float(value))]


def token_id_top(top: ServerTop, k: int) -> TopLogprobs:
    """Alternatives named ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``), ranked, ``k`` at most."""
    return [
        _ranked([(int(t[len(_TOKEN_ID) :]), v) for t, v in entries if t.startswith(_TOKEN_ID)], k) for entries in top
    ]


def retokenized_top(top: ServerTop, k: int, tokenizer: Any) -> TopLogprobs:
    """Alternatives whose text is exactly one token of ``tokenizer``, ranked, ``k`` at most."""
    ids: dict[str, int | None] = {}
    out = []
    for entries in top:
        mapped = [(_one_token(text, tokenizer, ids), value) for text, value in entries]
        out.append(_ranked([(i, v) for i, v in mapped if i is not None], k))
    return out


def _one_token(text: str, tokenizer: Any, known: dict[str, int | None]) -> int | None:
    """The id ``text`` encodes to when it is one token that decodes back to ``text``, else ``None``."""
    if text not in known:
        ids = tokenizer.encode(text, add_special_tokens=False)
        single = len(ids) == 1 and tokenizer.decode(ids) == text
        known[text] = int(ids[0]) if single else None
    return known[text]


def _ranked(entries: list[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    return sorted(entries, key=lambda e: -e[1])[:k]
