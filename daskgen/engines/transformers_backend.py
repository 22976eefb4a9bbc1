"""The machinery under :class:`~daskgen.engines.transformers.TransformersEngine`.

:mod:`daskgen.engines.transformers` is the public engine module (its docstring explains the
design); this module holds:

* the seeded sampler installed as the continuous-batching manager's only logits processor
  (:class:`SamplerTable`, :class:`SampledSequence`, :func:`step_seed`: Gumbel-max with noise from
  ``splitmix64(seed, step)``);
* :func:`load_backend`: loading the model and creating the manager (device, dtype, CPU
  defaults, limits, identity), returned as one :class:`LoadedBackend`;
  :func:`free_device_memory` after it is dropped.

Heavy imports (torch, transformers) happen inside functions only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from daskgen.engines.base import SamplingParams
from daskgen.engines.common import cuda_available
from daskgen.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

    from daskgen.engines.transformers import TransformersArgs

__all__ = ["LoadedBackend", "SampledSequence", "SamplerTable", "free_device_memory", "load_backend", "step_seed"]

# The engine's logger, so log configuration and records are the same as before the module split.
logger = logging.getLogger("daskgen.engines.transformers")

_MASK64 = (1 << 64) - 1
#: Defaults that keep a CPU worker's memory small; on a GPU, ``None`` lets transformers size from free memory.
_CPU_DEFAULTS = {"max_batch_tokens": 512, "max_requests_per_batch": 64, "kv_cache_tokens": 16384}


# --------------------------------------------------------------------------- sampling


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
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    generator: Any = None

    @classmethod
    def from_params(cls, params: SamplingParams) -> SampledSequence:
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        return cls(params.temperature, params.top_p, params.top_k, seed, params.logprobs)

    def pick(self, row: torch.Tensor) -> int:
        """Choose the next token from the float32 logits ``row`` and record it."""
        import torch

        if self.temperature == 0:
            token = int(torch.argmax(row))
        else:
            token = int(torch.argmax(_filtered(row / self.temperature, self) + self._gumbel(row)))
        if self.want_logprobs:
            self.logprobs.append(float(row[token] - torch.logsumexp(row, dim=0)))
        self.tokens.append(token)
        return token

    def _gumbel(self, row: torch.Tensor) -> torch.Tensor:
        """Gumbel noise for this step, one value per token id, from a generator reseeded per step."""
        import torch

        if self.generator is None:
            self.generator = torch.Generator(device=row.device)
        self.generator.manual_seed(step_seed(self.seed, len(self.tokens)))
        uniform = torch.rand(row.shape, generator=self.generator, device=row.device, dtype=row.dtype)
        return -torch.log(-torch.log(uniform))


def _filtered(scores: torch.Tensor, seq: SampledSequence) -> torch.Tensor:
    """``scores`` with tokens outside top-k and then outside the top-p nucleus set to ``-inf``."""
    import torch

    if 0 < seq.top_k < scores.numel():
        kth = torch.topk(scores, seq.top_k, sorted=False).values.min()
        scores = scores.masked_fill(scores < kth, float("-inf"))
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

    Driven by the manager's thread through a ``ContinuousBatchingLogitsProcessor`` adapter:
    ``prepare`` receives the ids of the rows of the next forward pass, ``process`` their logits.
    """

    def __init__(self) -> None:
        self.sequences: dict[str, SampledSequence] = {}
        self._rows: list[str] = []

    def prepare(self, request_ids: list[str]) -> None:
        self._rows = request_ids

    def process(self, scores: torch.Tensor) -> torch.Tensor:
        """Pick one token per row; return scores whose argmax is that token."""
        import torch

        picked = []
        for i, rid in enumerate(self._rows[: scores.size(0)]):
            seq = self.sequences.get(rid)  # None for warmup rows or requests aborted meanwhile
            picked.append(seq.pick(scores[i]) if seq is not None else int(torch.argmax(scores[i])))
        out = torch.full_like(scores, float("-inf"))
        rows = torch.arange(len(picked), device=scores.device)
        out[rows, torch.tensor(picked, device=scores.device)] = 0.0
        return out


def _processor_list(table: SamplerTable) -> Any:
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
            table.prepare([r.state.request_id for r in requests_with_new_token])
            return torch.zeros(len(requests_with_new_token), dtype=torch.int32)

        def __call__(self, scores: torch.Tensor, tensor_arg: torch.Tensor) -> torch.Tensor:
            return table.process(scores)

    processors = ContinuousBatchingLogitsProcessorList(LogitsProcessorList([DaskgenSampler()]))
    processors.tensors_required = 1  # one (unused) row of per-request tensor args
    return processors


# --------------------------------------------------------------------------- loading


@dataclass
class LoadedBackend:
    """A loaded model, its (not yet started) continuous-batching manager and what the engine reads from them."""

    model: Any
    manager: Any
    eos_ids: frozenset[int]
    vocab_size: int
    capacity: int | None
    max_total_tokens: int
    identity: dict[str, Any]


def load_backend(path: str, args: TransformersArgs, table: SamplerTable) -> LoadedBackend:
    """Load the model at ``path`` and create its manager with ``table`` as the sampler (blocking)."""
    import torch

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = _resolve_device(args.device)
    dtype = _resolve_dtype(args.dtype, device)
    model = _load_model(path, args, device, dtype)
    eos = _eos_ids(model)
    manager = _create_manager(model, table, args, device)
    return LoadedBackend(
        model=model,
        manager=manager,
        eos_ids=eos,
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        capacity=_cb_defaults(args, device)["max_requests_per_batch"],
        max_total_tokens=_max_total_tokens(manager, model.config.get_text_config(), args),
        identity=_identity(model, args, device, dtype, eos),
    )


def _resolve_device(device: str) -> str:

    if device == "auto":
        return "cuda" if cuda_available() else "cpu"
    if device.startswith("cuda") and not cuda_available():
        raise ConfigError(
            f"transformers engine: device {device!r} requested but CUDA is not available; use device='cpu' or 'auto'"
        )
    return device


def _resolve_dtype(dtype: str, device: str) -> torch.dtype:
    import torch

    if dtype == "auto":
        return torch.float32 if device == "cpu" else torch.bfloat16
    return getattr(torch, dtype)


def _load_model(path: str, args: TransformersArgs, device: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": args.trust_remote_code}
    if args.revision is not None:
        kwargs["revision"] = args.revision
    if args.attn_implementation is not None:
        kwargs["attn_implementation"] = args.attn_implementation
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise EngineError(f"transformers engine could not load model {path!r}: {exc}") from exc
    # PreTrainedModel.to is decorated with functools.wraps, whose typing leaves `self` unbound.
    return model.to(device).eval()  # type: ignore[arg-type]


def _eos_ids(model: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config.get_text_config()):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return frozenset(i for i in ids if i >= 0)


def _cb_defaults(args: TransformersArgs, device: str) -> dict[str, Any]:
    """Batch and cache limits: the user's, else the CPU defaults (on CPU) or transformers' own."""
    values = {key: getattr(args, key) for key in _CPU_DEFAULTS}
    if device == "cpu":
        values = {key: _CPU_DEFAULTS[key] if value is None else value for key, value in values.items()}
    return values


def _create_manager(model: Any, table: SamplerTable, args: TransformersArgs, device: str) -> Any:
    """Create the continuous-batching manager with the engine's sampler; allocate its cache."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    limits = _cb_defaults(args, device)
    tokens = limits["kv_cache_tokens"]
    cb_config = ContinuousBatchingConfig(
        page_size=args.page_size,
        num_blocks=None if tokens is None else math.ceil(tokens / args.page_size),
        max_batch_tokens=limits["max_batch_tokens"],
        max_requests_per_batch=limits["max_requests_per_batch"],
        max_memory_percent=args.max_memory_percent,
        allow_block_sharing=args.prefix_sharing,
        use_async_batching=False,  # the sampler runs Python per step: no async double-buffering,
        use_cuda_graph=False,  # no CUDA graphs and no compile
        default_compile_level=0,
        return_logprobs=False,
    )
    generation_config = GenerationConfig(do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=cb_config)
    manager.logit_processor = _processor_list(table)
    manager.warmup()  # creates the paged cache now, so sizing errors surface in start()
    return manager


def _max_total_tokens(manager: Any, config: Any, args: TransformersArgs) -> int:
    from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens

    limits = [infer_max_single_request_tokens(manager.batch_processor.cache)]
    context = getattr(config, "max_position_embeddings", None)
    limits += [v for v in (context, args.max_model_len) if isinstance(v, int) and v > 0]
    return min(limits)


def _identity(model: Any, args: TransformersArgs, device: str, dtype: Any, eos: frozenset[int]) -> dict[str, Any]:
    import torch
    import transformers

    config = model.config
    return {
        "model_type": getattr(config, "model_type", None),
        "architectures": list(getattr(config, "architectures", None) or []),
        "name_or_path": getattr(config, "_name_or_path", None),
        "commit_hash": getattr(config, "_commit_hash", None),
        "revision": args.revision,
        "num_parameters": int(sum(p.numel() for p in model.parameters())),
        "vocab_size": int(model.get_input_embeddings().num_embeddings),
        "bos_token_id": getattr(config.get_text_config(), "bos_token_id", None),
        "eos_token_ids": sorted(eos),
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "sampler": "daskgen-gumbel-v1",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }


def free_device_memory() -> None:
    """Return cached accelerator memory to the device (after the model is dropped)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
