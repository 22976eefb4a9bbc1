"""Loading the model and the continuous-batching manager of the ``transformers`` engine.

:func:`load_backend` loads the model and creates the manager (device, dtype, CPU defaults,
limits, identity), with the seeded sampler of :mod:`daskgen.engines.transformers.sampler` as its
logits processor, returned as one :class:`LoadedBackend`; :func:`free_device_memory` after it is
dropped.  Heavy imports (torch, transformers) happen inside functions only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from daskgen.engines.inprocess import cuda_available
from daskgen.engines.transformers.args import TransformersArgs
from daskgen.engines.transformers.sampler import SamplerTable, processor_list
from daskgen.engines.transformers.vision import GenerateManager, is_vision_model
from daskgen.errors import ConfigError, EngineError

if TYPE_CHECKING:
    import torch

__all__ = ["LoadedBackend", "free_device_memory", "load_backend"]


#: Requests a vision-language model's engine takes at once (they queue, and run one after the other).
VISION_CAPACITY = 8
#: Defaults that keep a CPU worker's memory small; on a GPU, ``None`` lets transformers size from free memory.
_CPU_DEFAULTS = {"max_batch_tokens": 512, "max_requests_per_batch": 64, "kv_cache_tokens": 16384}


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


def load_backend(
    path: str, args: TransformersArgs, table: SamplerTable, adapters: dict[str, str] | None = None
) -> LoadedBackend:
    """Load the model at ``path`` (with the LoRA ``adapters``, name -> folder) and create its manager with
    ``table`` as the sampler (blocking)."""
    import torch

    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    device = _resolve_device(args.device)
    dtype = _resolve_dtype(args.dtype, device)
    vision = is_vision_model(path, args.trust_remote_code)
    model = _load_model(path, args, device, dtype, vision)
    if adapters:
        model = _with_adapters(model, adapters, table, device)
    eos = _eos_ids(model)
    manager = _vision_manager(model, table) if vision else _create_manager(model, table, args, device)
    return LoadedBackend(
        model=model,
        manager=manager,
        eos_ids=eos,
        vocab_size=int(model.get_input_embeddings().num_embeddings),
        capacity=VISION_CAPACITY if vision else _cb_defaults(args, device)["max_requests_per_batch"],
        max_total_tokens=_max_total_tokens(manager, model.config.get_text_config(), args),
        identity={**_identity(model, args, device, dtype, eos), **({"adapters": sorted(adapters)} if adapters else {})},
    )


def _with_adapters(model: Any, adapters: dict[str, str], table: SamplerTable, device: str) -> Any:
    """``model`` with the LoRA ``adapters`` loaded, each request's tokens routed to its own (``table.on_batch``)."""
    from daskgen.engines.transformers.lora import LoraRouting, attach_adapters

    routing = LoraRouting(table.adapter_of)
    model = attach_adapters(model, adapters, routing)
    table.on_batch = lambda requests: routing.route(requests, device)
    return model


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


def _vision_manager(model: Any, table: SamplerTable) -> GenerateManager:
    """The backend of a vision-language model (:mod:`daskgen.engines.transformers.vision`)."""
    text = model.config.get_text_config()
    pad = getattr(text, "pad_token_id", None)
    return GenerateManager(model, table, int(pad if pad is not None else min(_eos_ids(model), default=0)))


def _load_model(path: str, args: TransformersArgs, device: str, dtype: torch.dtype, vision: bool = False) -> Any:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": args.trust_remote_code}
    if args.revision is not None:
        kwargs["revision"] = args.revision
    if args.attn_implementation is not None:
        kwargs["attn_implementation"] = args.attn_implementation
    try:
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise EngineError(f"transformers engine could not load model {path!r}: {exc}") from exc
    return model.to(device).eval()


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
    manager.logit_processor = processor_list(table)
    manager.warmup()  # creates the paged cache now, so sizing errors surface in start()
    return manager


def _max_total_tokens(manager: Any, config: Any, args: TransformersArgs) -> int:
    from transformers.generation.continuous_batching.model_runner import infer_max_single_request_tokens

    cache = getattr(manager.batch_processor, "cache", None)  # none: model.generate sizes its own per request
    limits = [] if cache is None else [infer_max_single_request_tokens(cache)]
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
        "torch_version": str(torch.__version__),
    }


def free_device_memory() -> None:
    """Return cached accelerator memory to the device (after the model is dropped)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
