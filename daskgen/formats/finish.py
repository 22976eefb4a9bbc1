"""Finish labels: the ``finish_reason`` codes of a store as the strings every format writes."""

from __future__ import annotations

from typing import Any

import numpy as np

from daskgen.engines.base import FinishReason

#: Labels of the ``finish_reason`` codes, indexed by ``code + 1`` (code -1: the sample was not generated).
FINISH_LABELS: tuple[str, ...] = ("not_generated", *(reason.label for reason in FinishReason))


def finish_labels(codes: Any) -> np.ndarray:
    """String labels (``stop``, ``length``, ``abort``, ``error``, ``not_generated``; ``unknown`` for any other
    code) of finish codes."""
    table = np.array([*FINISH_LABELS, "unknown"])
    idx = np.asarray(codes).astype(np.int64) + 1
    return table[np.where((idx >= 0) & (idx < len(FINISH_LABELS)), idx, len(FINISH_LABELS))]
