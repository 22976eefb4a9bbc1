"""The seeded sampler of the ``transformers`` engine, installed as the manager's only logits processor.

:class:`SamplerTable` maps backend request ids to their :class:`SampledSequence` and picks one token
per row of each forward pass: Gumbel-max with noise from a generator reseeded with
:func:`step_seed` (``splitmix64(seed, step)``), so a token depends only on its request's seed and
position (the design is explained in :mod:`daskgen.engines.transformers.engine`).
:func:`processor_list` wraps the table for transformers' continuous-batching manager.  Heavy
imports (torch, transformers) happen inside functions only.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import SamplingParams
from daskgen.engines.continuation import split_prompt
from daskgen.engines.transformers.shaping import Shaping

if TYPE_CHECKING:
    import torch

__all__ = ["SampledSequence", "SamplerTable", "processor_list", "step_seed"]

_MASK64 = (1 << 64) - 1
#: Handles are ``int32`` values in ``1 .. _HANDLES`` (0: a row of no sequence).
_HANDLES = (1 << 31) - 2


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seed64(seed: int) -> int:
    """``seed`` itself when it fits in 64 unsigned bits, else a 64-bit hash of it."""
    if 0 <= seed <= _MASK64:
        return seed
    digest = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def step_seed(seed: int, step: int) -> int:
    """The generator seed for token ``step`` of a request seeded with ``seed`` (counter-based)."""
    return _splitmix64(_splitmix64(_seed64(seed)) ^ (step & _MASK64))


@dataclass
class SampledSequence:
    """Per-request sampling settings and what the sampler picked so far (written by the backend thread)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    want_logprobs: bool
    want_top: int = 0
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: Any = None
    min_p: float = 0.0
    #: Penalties, ``min_new_tokens`` and stop strings (``None``: none of them, the plain path).
    shaping: Shaping | None = None
    constraint: Any = None  # a response_format's grammar state (:mod:`daskgen.engines.transformers.grammar`)
    adapter: str | None = None  # the LoRA adapter generating this sequence (:mod:`daskgen.engines.transformers.lora`)
    #: The response position of the first token this sequence picks (a continuation's tokens so far): its noise
    #: is that of its position in the whole response.
    first_step: int = 0

    @classmethod
    def from_params(
        cls,
        params: SamplingParams,
        prompt: list[int] | None = None,
        decode: Callable[[list[int]], str] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> SampledSequence:
        """The sequence of a request; ``decode`` and ``on_stop`` serve its stop strings (``on_stop`` is called
        from the sampling thread when the newest token completes one)."""
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        _, carried = split_prompt(prompt or [], params.continued)
        shaping = Shaping.of(params, prompt or [], decode, on_stop, carried)
        return cls(
            params.temperature,
            params.top_p,
            params.top_k,
            seed,
            params.logprobs,
            params.top_logprobs,
            min_p=params.min_p,
            shaping=shaping,
            adapter=params.adapter,
            first_step=len(carried),
        )

    def pick(self, row: torch.Tensor) -> int:
        """Choose the next token from the float32 logits ``row`` and record it."""
        import torch

        scores = row if self.shaping is None else self.shaping.adjusted(row, self.tokens)
        if self.constraint is not None:
            scores = self.constraint.masked(scores)
        if self.temperature == 0:
            token = int(torch.argmax(scores))
        else:
            token = int(torch.argmax(_filtered(scores / self.temperature, self) + self._gumbel(row)))
        if self.constraint is not None:
            self.constraint.accept(token)
        if self.want_logprobs or self.want_top:
            log_norm = torch.logsumexp(row, dim=0)  # the untempered distribution's normalizer, once per token
        if self.want_logprobs:
            self.logprobs.append(float(row[token] - log_norm))
        if self.want_top:
            values, ids = torch.topk(row - log_norm, min(self.want_top, row.numel()))
            self.top.append(list(zip(ids.tolist(), values.tolist(), strict=True)))
        self.tokens.append(token)
        if self.shaping is not None:
            self.shaping.after(self.tokens)
        return token

    def _gumbel(self, row: torch.Tensor) -> torch.Tensor:
        """Gumbel noise for this step, one value per token id, from a generator reseeded per step."""
        import torch

        if self.generator is None:
            self.generator = torch.Generator(device=row.device)
        self.generator.manual_seed(step_seed(self.seed, self.first_step + len(self.tokens)))
        uniform = torch.rand(row.shape, generator=self.generator, device=row.device, dtype=row.dtype)
        return -torch.log(-torch.log(uniform))


def _filtered(scores: torch.Tensor, seq: SampledSequence) -> torch.Tensor:
    """``scores`` with tokens outside top-k, then below min-p, then outside the top-p nucleus set to ``-inf``."""
    import torch

    if 0 < seq.top_k < scores.numel():
        kth = torch.topk(scores, seq.top_k, sorted=False).values.min()
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if seq.min_p > 0:  # probability below min_p x the top token's: log(p) < log(min_p) + max log(p)
        scores = scores.masked_fill(scores < scores.max() + math.log(seq.min_p), float("-inf"))
    if seq.top_p < 1:
        probs = torch.softmax(scores, dim=0)
        scores = scores.masked_fill(probs < _nucleus_threshold(probs, seq.top_p), float("-inf"))
    return scores


def _nucleus_threshold(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Smallest probability inside the top-p nucleus (searches the largest 256, 2048, ... first)."""
    import torch

    k = min(probs.numel(), 256)
    while True:
        top = torch.topk(probs, k).values
        cumulative = torch.cumsum(top, 0)
        if cumulative[-1] >= top_p or k == probs.numel():
            break
        k = min(probs.numel(), k * 8)
    keep = max(1, int(((cumulative - top) < top_p).sum()))
    return top[keep - 1]


class SamplerTable:
    """The engine's sampler: maps backend request ids to :class:`SampledSequence` and picks tokens.

    Driven by the manager's thread through a ``ContinuousBatchingLogitsProcessor`` adapter.  Each sequence gets
    an ``int32`` handle; before a forward pass the adapter writes the handle of every request that gets a new
    token into the pass's per-row argument tensor, in the order of the rows of its logits, and zeros in every
    other slot.  :meth:`process` then reads which sequence each row of the logits belongs to from those
    handles, so rows that belong to no sequence are told apart from the rest: a batch whose requests are all
    part-way through a chunked prefill (no logits row at all), padding rows, the manager's own warm-up rows, and
    requests removed between the two calls.  A sequence whose pick raises fails alone (``on_error``); the
    other rows of the pass go on.
    """

    def __init__(self) -> None:
        self.sequences: dict[str, SampledSequence] = {}
        self._handles: dict[str, int] = {}
        self._by_handle: dict[int, str] = {}
        self._counter = itertools.count(1)
        #: Called with the requests of each forward pass before it runs (LoRA routing), when set.
        self.on_batch: Callable[[list[Any]], None] | None = None
        #: Called from the sampling thread with a request id and a message when its pick raised.
        self.on_error: Callable[[str, str], None] | None = None

    def add(self, request_id: str, sequence: SampledSequence) -> None:
        """Sample ``request_id``'s rows with ``sequence`` from now on."""
        handle = next(self._counter) % _HANDLES + 1
        self._handles[request_id], self._by_handle[handle] = handle, request_id
        self.sequences[request_id] = sequence

    def remove(self, request_id: str) -> None:
        """Forget ``request_id`` (its later rows, if any, are picked by argmax and discarded)."""
        self.sequences.pop(request_id, None)
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            self._by_handle.pop(handle, None)

    def adapter_of(self, request_id: str) -> str | None:
        """The LoRA adapter of a running request (``None``: the base model, or a warm-up row)."""
        seq = self.sequences.get(request_id)
        return None if seq is None else seq.adapter

    def handles(self, request_ids: list[str]) -> list[int]:
        """The handles of ``request_ids`` (0 for a request the table does not know: a warm-up row)."""
        return [self._handles.get(rid, 0) for rid in request_ids]

    def process(self, scores: torch.Tensor, handles: list[int]) -> torch.Tensor:
        """Pick one token per row of ``scores`` (row ``i`` belongs to ``handles[i]``; 0: no sequence); return
        scores whose argmax is that token."""
        import torch

        picked = [0] * scores.size(0)
        for i, handle in enumerate(handles[: scores.size(0)]):
            if handle:
                picked[i] = self._pick(handle, scores[i])
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(1, torch.tensor(picked, dtype=torch.long, device=scores.device).unsqueeze(1), 0.0)
        return out

    def _pick(self, handle: int, row: torch.Tensor) -> int:
        """The token of the sequence with ``handle``; argmax for a row whose sequence is gone or failed."""
        import torch

        rid = self._by_handle.get(handle, "")
        seq = self.sequences.get(rid)
        if seq is None:  # removed between the pass's preparation and its logits
            return int(torch.argmax(row))
        try:
            return seq.pick(row)
        except Exception as exc:  # this request fails alone; the forward pass and its other rows go on
            self.remove(rid)
            if self.on_error is not None:
                self.on_error(rid, f"sampling failed: {type(exc).__name__}: {exc}")
            return int(torch.argmax(row))


def processor_list(table: SamplerTable) -> Any:
    """Wrap ``table`` as the manager's (only) logits processor."""
    import torch
    from transformers.generation.continuous_batching.cb_logits_processors import (
        ContinuousBatchingLogitsProcessor,
        ContinuousBatchingLogitsProcessorList,
    )
    from transformers.generation.logits_process import LogitsProcessorList

    class DaskgenSampler(ContinuousBatchingLogitsProcessor):
        supported_kwargs: dict[str, type] = {}
        ignored_kwargs: tuple[str, ...] = ()

        def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
            int32_tensor.fill_(0)

        def prepare_tensor_args(self, requests_with_new_token: list[Any]) -> torch.Tensor:
            handles = table.handles([r.state.request_id for r in requests_with_new_token])
            return torch.tensor(handles, dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            return table.process(scores, tensor_arg[: scores.size(0)].tolist())

    class DaskgenProcessors(ContinuousBatchingLogitsProcessorList):
        def prepare_tensor_args(self, requests_in_batch: list[Any], arg_storage: torch.Tensor) -> torch.Tensor:
            if table.on_batch is not None:  # runs before the forward pass of these requests
                table.on_batch(requests_in_batch)
            arg_storage[0].zero_()  # the manager keeps earlier passes' handles beyond this pass's rows
            return super().prepare_tensor_args(requests_in_batch=requests_in_batch, arg_storage=arg_storage)

    processors = DaskgenProcessors(LogitsProcessorList([DaskgenSampler()]))
    processors.tensors_required = 1  # one (unused) row of per-request tensor args
    return processors
