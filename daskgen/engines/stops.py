"""Stop conditions, one rule for every engine: where a sample ends and which stop ended it.

The rule: a sample ends with the token that completes its first stop, and that token is kept — a stop
token id is the last response token, a stop string's text is at the end of the decoded response (the
last token may carry text after the stop string: tokens are never split).  Engines that stop natively
(vLLM, SGLang) are asked to keep the stop in their output; the ``transformers`` engine checks stop
strings with :class:`StopMatcher`.  The worker then applies :func:`settle` to every sample, on every
engine: it cuts a response that ran past its first stop and gives the ``stop_reason`` stored per sample:

* ``0 .. len(stop) - 1``: the index of the stop string that matched first,
* ``len(stop) + j``: the ``j``-th of the row's ``stop_token_ids``,
* :data:`EOS` (``-2``): the model's end-of-sequence token (or the engine stopped for a reason of its own),
* :data:`NO_STOP` (``-1``): no stop (``finish_reason`` says length, abort or error; or not generated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: ``stop_reason`` of a sample that did not end by a stop (length, abort, error, not generated).
NO_STOP = -1
#: ``stop_reason`` of a sample ended by the model's end-of-sequence token.
EOS = -2
#: Tokens decoded beyond the longest stop string's length when checking the newest token (multi-byte
#: characters may take several tokens).
SLACK_TOKENS = 4

Decode = Callable[[list[int]], str]


class StopMatcher:
    """Incremental stop-string check over a growing list of tokens (for engines that cannot stop natively).

    :meth:`matched` decodes only a window at the end (the longest stop string's length plus
    :data:`SLACK_TOKENS` tokens), so a step costs the same however long the response is.
    """

    def __init__(self, stop: Sequence[str], decode: Decode) -> None:
        self.stop = tuple(stop)
        self.decode = decode
        self.window = max(len(s) for s in self.stop) + SLACK_TOKENS

    def matched(self, tokens: list[int]) -> bool:
        """True when the newest token of ``tokens`` completes a stop string."""
        tail = tokens[-self.window :]
        text = self.decode(tail)
        before = self.decode(tail[:-1])
        return any(s in text and s not in before for s in self.stop)


def first_stop(ids: list[int], stop: Sequence[str], stop_ids: Sequence[int], decode: Decode) -> tuple[int, int] | None:
    """``(length, reason)`` of the first stop in ``ids``: the response length up to and including the token
    that completes it, and its ``stop_reason`` code; ``None`` when no stop occurs."""
    ids_at = {t: j for j, t in reversed(list(enumerate(stop_ids)))}
    by_id = next(((i + 1, len(stop) + ids_at[t]) for i, t in enumerate(ids) if t in ids_at), None)
    by_text = _first_string(ids, stop, decode, by_id[0] if by_id else len(ids))
    if by_text is not None and (by_id is None or by_text[0] <= by_id[0]):
        return by_text
    return by_id


def _first_string(ids: list[int], stop: Sequence[str], decode: Decode, upto: int) -> tuple[int, int] | None:
    """The shortest prefix of ``ids[:upto]`` whose text holds a stop string (binary search), and that string's index."""
    if not stop or upto == 0 or not any(s in decode(ids[:upto]) for s in stop):
        return None
    low, high = 1, upto  # the shortest prefix that holds a stop string is in [low, high]
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(ids[:mid]) for s in stop):
            high = mid
        else:
            low = mid + 1
    text = decode(ids[:low])
    found = [(text.find(s), i) for i, s in enumerate(stop) if s in text]
    return low, min(found)[1]


def settle(
    ids: list[int], stopped: bool, stop: Sequence[str], stop_ids: Sequence[int], decode: Decode
) -> tuple[int, int]:
    """``(length to keep, stop_reason)`` of a response ``ids`` under the rule above.

    ``stopped`` is whether the engine finished it by a stop (``FinishReason.STOP``); a response that
    holds a stop is cut after it (and counts as stopped) whatever the engine said.
    """
    found = first_stop(ids, stop, stop_ids, decode) if (stop or stop_ids) else None
    if found is not None:
        return found
    return len(ids), EOS if stopped else NO_STOP
