"""What must hold for a finished (``done``) row of a store, checked on one partition's region.

Each rule returns the rows (store indices) that break it, with one line saying how; ``daskgen verify``
(:mod:`daskgen.store.tools.verify`) reports them.  The rules follow from the layout (:mod:`daskgen.store.layout`):

* every generated sample has a finish reason (``-1`` only for samples a verifier did not need), and
  every code is a known one;
* lengths lie within their caps (``1..max_prompt_tokens`` for prompts, ``0..max_new_tokens`` for responses);
* after each length comes only padding: ``pad_token_id`` in the ids, ``0`` in the mask, NaN in logprobs,
  no top-k entry (``-1``, NaN);
* token ids before each length lie in the tokenizer's vocabulary;
* the response mask is 0 or 1 (all 1 for single-turn runs, where every token is the model's);
* a sample's ``policy_fingerprint`` (``policy_fingerprint_end``) is 0 (unchecked) or the digest the policy record
  holds for its ``policy_version`` (``policy_version_end``): a sample labelled with other weights than its
  version's published ones is found;
* each image's span holds exactly its placeholder tokens and its bytes are stored
  (:mod:`daskgen.store.tools.image_checks`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from daskgen.store.layout import NO_TOKEN, NOT_GENERATED, Layout
from daskgen.store.tools.image_checks import ImageRules, image_rows

#: Finish-reason codes a stored sample may carry.
KNOWN_FINISH = (NOT_GENERATED, 0, 1, 2, 3)


@dataclass(frozen=True)
class RowRules:
    """What the store's attrs say about its rows: the layout, the vocabulary size, whether masks are all 1,
    whether the run recorded log-probabilities, and each published policy version's digest
    (:func:`~daskgen.store.fingerprint.digest_number`; versions published without a fingerprint are absent)."""

    layout: Layout
    vocab_size: int | None
    model_tokens_only: bool
    logprobs: bool = False
    digests: Mapping[int, int] = field(default_factory=dict)
    images: ImageRules | None = None  # a store with images (:mod:`daskgen.store.tools.image_checks`)


def broken_rows(region: dict[str, np.ndarray], done: np.ndarray, rules: RowRules) -> dict[int, str]:
    """Local row index -> the first rule it breaks, for the ``done`` rows of one partition's ``region``."""
    found: dict[int, str] = {}
    rules_of_rows = (
        _finish_reasons,
        _prompt_part,
        _response_lengths,
        _response_padding,
        _response_tokens,
        _fingerprints,
        _images,
    )
    for rule in rules_of_rows:
        for row, why in rule(region, rules).items():
            if done[row]:
                found.setdefault(row, why)
    return found


def _images(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    return {} if rules.images is None else image_rows(region, rules.images)


def _per_row(bad: np.ndarray) -> np.ndarray:
    """Rows where any element of ``bad`` (rows first) is set."""
    return np.asarray(bad.reshape(len(bad), -1).any(axis=1))


def _rows(bad: np.ndarray, why: str) -> dict[int, str]:
    return {int(r): why for r in np.flatnonzero(_per_row(bad))}


def expected_samples(region: dict[str, np.ndarray], rules: RowRules) -> np.ndarray:
    """Per sample (and trajectory): whether it must have been generated."""
    reasons = region["finish_reason"]
    want = np.ones(reasons.shape, dtype=bool)
    if "samples_used" in region:  # a verifier stops sampling a prompt once it is satisfied
        used = region["samples_used"].reshape(-1, 1)
        want &= (np.arange(reasons.shape[1]) < used).reshape(*reasons.shape[:2], *([1] * (reasons.ndim - 2)))
    if "num_trajectories" in region:  # schema v2: only the first num_trajectories are filled
        count = region["num_trajectories"][..., None]
        want &= np.arange(reasons.shape[2]) < np.maximum(count, 1)
    return want


def _finish_reasons(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    reasons = region["finish_reason"]
    unknown = _rows(~np.isin(reasons, KNOWN_FINISH), "a finish_reason code that is not one of -1, 0, 1, 2, 3")
    missing = _rows((reasons == NOT_GENERATED) & expected_samples(region, rules), "a sample without finish_reason")
    return {**missing, **unknown}


def _prompt_part(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    lengths, ids, layout = region["prompt_length"], region["prompt_ids"], rules.layout
    found = _rows((lengths < 1) | (lengths > layout.max_prompt_tokens), "prompt_length outside 1..max_prompt_tokens")
    inside = np.arange(ids.shape[1]) < lengths[:, None]
    found.update(_rows(~inside & (ids != layout.pad_token_id), "prompt_ids not padded after prompt_length"))
    if rules.vocab_size is not None:
        outside = inside & ((ids < 0) | (ids >= rules.vocab_size))
        found.update(_rows(outside, f"a prompt token id outside the vocabulary (0..{rules.vocab_size - 1})"))
    return found


def _response_lengths(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    lengths = region["response_length"]
    return _rows((lengths < 0) | (lengths > rules.layout.max_new_tokens), "response_length outside 0..max_new_tokens")


def _inside(region: dict[str, np.ndarray]) -> np.ndarray:
    """Per response position: whether it lies before the sample's length."""
    width = region["response_ids"].shape[-1]
    return np.arange(width) < region["response_length"][..., None]


def _response_padding(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    inside = _inside(region)
    found = _rows(~inside & (region["response_ids"] != rules.layout.pad_token_id), "response_ids not padded")
    mask = region["response_mask"]
    found.update(_rows(~inside & (mask != 0), "response_mask set after response_length"))
    found.update(_rows(inside & (mask > 1), "response_mask not 0 or 1"))
    if rules.model_tokens_only:
        found.update(_rows(inside & (mask == 0), "response_mask 0 inside a single-turn response"))
    if "logprobs" in region:
        found.update(_rows(~inside & ~np.isnan(region["logprobs"]), "logprobs after response_length"))
    if "top_logprobs" in region:
        entries = (region["top_logprob_ids"] != NO_TOKEN) | ~np.isnan(region["top_logprobs"])
        found.update(_rows(~inside & entries.any(axis=-1), "top_logprobs after response_length"))
    return found


def _response_tokens(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    if rules.vocab_size is None:
        return {}
    ids = region["response_ids"]
    outside = _inside(region) & ((ids < 0) | (ids >= rules.vocab_size))
    return _rows(outside, f"a response token id outside the vocabulary (0..{rules.vocab_size - 1})")


def _fingerprints(region: dict[str, np.ndarray], rules: RowRules) -> dict[int, str]:
    """Samples whose stored fingerprint is neither 0 (unchecked) nor their version's published digest."""
    found: dict[int, str] = {}
    if not rules.digests or "policy_fingerprint" not in region:
        return found
    for version_name, name in (
        ("policy_version", "policy_fingerprint"),
        ("policy_version_end", "policy_fingerprint_end"),
    ):
        versions, stored = region[version_name], region[name]
        for version, digest in rules.digests.items():
            wrong = (versions == version) & (stored != 0) & (stored != digest)
            for row, why in _rows(wrong, f"{name} differs from version {version}'s published digest {digest}").items():
                found.setdefault(row, why)
    return found
