"""The options of the ``transformers`` engine (:class:`TransformersArgs`) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from daskgen.engines.args import check_positive_int
from daskgen.errors import ConfigError

__all__ = ["TransformersArgs"]

_DEVICES = ("auto", "cpu", "cuda")
_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class TransformersArgs:
    """Options of the ``transformers`` engine.

    Attributes
    ----------
    device:
        ``"auto"`` (CUDA when available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    dtype:
        ``"auto"`` (float32 on CPU, bfloat16 on GPU), ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    max_batch_tokens:
        Tokens per forward step (prefill chunks plus one per decoding request).  Default 512 on
        CPU, sized by transformers on GPU.
    max_requests_per_batch:
        Requests per forward step.  Default 64 on CPU.
    kv_cache_tokens:
        KV-cache capacity in tokens (all requests together).  Default 16384 on CPU; on GPU
        sized from free memory (``max_memory_percent``).
    page_size:
        Tokens per KV-cache page.
    max_memory_percent:
        Fraction of free accelerator memory for the cache when ``kv_cache_tokens`` is unset.
    prefix_sharing:
        Reuse the KV cache of shared prompt prefixes (the n samples of one prompt).
    attn_implementation:
        Passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``, a flash implementation...).
    num_threads:
        ``torch.set_num_threads`` for CPU inference (process-wide); default: torch's choice.
    max_model_len:
        Cap on prompt plus new tokens; default the model's ``max_position_embeddings``.
    revision, trust_remote_code:
        Passed to ``from_pretrained``.
    """

    device: str = "auto"
    dtype: str = "auto"
    max_batch_tokens: int | None = None
    max_requests_per_batch: int | None = None
    kv_cache_tokens: int | None = None
    page_size: int = 128
    max_memory_percent: float | None = None
    prefix_sharing: bool = True
    attn_implementation: str | None = None
    num_threads: int | None = None
    max_model_len: int | None = None
    revision: str | None = None
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or (self.device not in _DEVICES and not self.device.startswith("cuda:")):
            raise ConfigError(
                f"transformers engine: device must be one of {list(_DEVICES)} or 'cuda:N', got {self.device!r}"
            )
        if self.dtype not in _DTYPES:
            raise ConfigError(f"transformers engine: dtype must be one of {list(_DTYPES)}, got {self.dtype!r}")
        for name in (
            "max_batch_tokens",
            "max_requests_per_batch",
            "kv_cache_tokens",
            "page_size",
            "num_threads",
            "max_model_len",
        ):
            check_positive_int("transformers", name, getattr(self, name))
        if self.max_memory_percent is not None and not 0 < self.max_memory_percent <= 1:
            raise ConfigError(
                f"transformers engine: max_memory_percent must be in (0, 1], got {self.max_memory_percent!r}"
            )
        for name in ("prefix_sharing", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"transformers engine: {name} must be true or false, got {getattr(self, name)!r}")
