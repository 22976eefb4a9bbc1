"""The ``transformers`` engine's backend for vision-language models: ``model.generate`` one request at a time.

transformers' continuous-batching manager takes token ids only, so a model with a vision tower (Qwen2-VL and
its kin, loaded with ``AutoModelForImageTextToText``) is driven by :class:`GenerateManager` instead: a thread
that takes the engine's requests in order and runs ``model.generate`` on each, with the request's pixel values
and grids (:class:`~daskgen.engines.media.ImageInput`) and the engine's own sampler
(:class:`~daskgen.engines.transformers.sampler.SamplerTable`) as the only logits processor under a greedy
generation config, so seeds, stops, penalties, structured outputs and logprobs mean what they mean for text
models.  It offers the slice of the manager's interface the engine uses (``add_request``, ``cancel_request``,
the output queue, ``stop``), so the engine's request bookkeeping is the same for both backends.  Requests run
one after the other: correct and exact, not fast (the CPU lanes' tiny models; a GPU user runs ``vllm`` or
``sglang`` for throughput).  Heavy imports happen inside functions.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from daskgen.engines.media import ImageInput
from daskgen.engines.transformers.sampler import SamplerTable

logger = logging.getLogger(__name__)

__all__ = ["GenerateManager", "is_vision_model"]


def is_vision_model(path: str, trust_remote_code: bool = False) -> bool:
    """True when the model folder's config has a vision tower (``vision_config``)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return False
    return getattr(config, "vision_config", None) is not None


@dataclass
class _Output:
    """A finished request, shaped like the continuous-batching manager's outputs the engine reads."""

    request_id: str
    generated_tokens: list[int]
    error: str | None = None

    def is_finished(self) -> bool:
        return True


@dataclass
class _Request:
    request_id: str
    ids: list[int]
    max_new_tokens: int
    eos: list[int]
    images: tuple[ImageInput, ...] = ()


@dataclass
class _State:
    request_id: str


@dataclass
class _Pass:
    """A forward pass as the LoRA routing sees it: one request's, all of its positions (``query_length`` None)."""

    state: _State
    query_length: int | None = None


@dataclass
class _Status:
    fatal_error: BaseException | None = None


@dataclass
class _Busy:
    """What the engine's weight refresh asks of the manager's batch processor: whether a request runs."""

    running: set[str] = field(default_factory=set)

    def has_pending_requests(self) -> bool:
        return bool(self.running)


class GenerateManager:
    """Runs the engine's requests on a vision-language ``model`` with ``model.generate`` (see the module docstring)."""

    def __init__(self, model: Any, table: SamplerTable, pad_token_id: int) -> None:
        self.model, self.table, self.pad = model, table, pad_token_id
        #: The image token, for a model whose generate needs the token types (``mm_token_type_ids``: without them
        #: Qwen2-VL's positions silently stay 1-D); ``None`` for a model that takes none.
        self._typed = image_token_for_types(model)
        self.input_queue: queue.Queue[_Request | None] = queue.Queue()
        self.cancel_queue: queue.Queue[str] = queue.Queue()  # cancellations act at once; kept empty
        self.output_router = type("Router", (), {"output_queue": queue.Queue()})()
        self.background_thread_status = _Status()
        self.batch_processor = _Busy()
        self._cancelled: set[str] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._serve, name="daskgen-transformers-vision", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def add_request(
        self, ids: list[int], request_id: str, max_new_tokens: int, eos_token_id: list[int], images: tuple = ()
    ) -> str | None:
        if not self.is_running():
            return None
        self.input_queue.put(_Request(request_id, list(ids), max_new_tokens, list(eos_token_id), tuple(images)))
        return request_id

    def cancel_request(self, request_id: str) -> None:
        self._cancelled.add(request_id)

    def stop(self, block: bool = True, timeout: float | None = None, hard_stop: bool = False) -> None:
        self.input_queue.put(None)
        if block and self._thread is not None:
            self._thread.join(timeout)

    def destroy(self) -> None:
        """Nothing to free beyond the model (the engine drops it)."""

    def _serve(self) -> None:
        try:
            while (request := self.input_queue.get()) is not None:
                if request.request_id in self._cancelled:
                    self._cancelled.discard(request.request_id)
                    continue
                self.batch_processor.running.add(request.request_id)
                try:
                    output = self._generate(request)
                finally:
                    self.batch_processor.running.discard(request.request_id)
                    self._cancelled.discard(request.request_id)
                self.output_router.output_queue.put(output)
        except BaseException as exc:  # the engine's health check reports it
            logger.exception("the vision generation thread stopped")
            self.background_thread_status.fatal_error = exc

    def _generate(self, request: _Request) -> _Output:
        """One request, as ``model.generate`` with the engine's sampler (blocking)."""
        import torch
        from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

        table, rid, cancelled = self.table, request.request_id, self._cancelled

        class Pick(LogitsProcessor):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                return table.process(scores.float(), table.handles([rid]))

        class Cancelled(StoppingCriteria):
            def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
                return torch.tensor([rid in cancelled], device=input_ids.device)

        try:  # whatever fails here fails this request alone: the thread goes on with the next one
            if table.on_batch is not None:  # LoRA routing: every position of every pass is this request's
                table.on_batch([_Pass(_State(rid))])
            device = self.model.device
            ids = torch.tensor([request.ids], device=device)
            config = GenerationConfig(
                max_new_tokens=request.max_new_tokens, do_sample=False, eos_token_id=request.eos, pad_token_id=self.pad
            )
            images = image_inputs(request.images, device, self.model.dtype)
            if images and self._typed is not None:  # the model computes its mRoPE positions from the token types
                images["mm_token_type_ids"] = (ids == self._typed).int()
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), generation_config=config,
                    logits_processor=[Pick()], stopping_criteria=[Cancelled()], **images,
                )  # fmt: skip
        except Exception as exc:  # this request fails alone
            logger.warning("vision request %s failed: %s: %s", rid, type(exc).__name__, exc)
            return _Output(rid, [], f"{type(exc).__name__}: {exc}")
        return _Output(rid, out[0, len(request.ids) :].tolist())


def image_token_for_types(model: Any) -> int | None:
    """The image token of a model whose forward takes ``mm_token_type_ids`` (1 at image tokens), else ``None``."""
    import inspect

    if "mm_token_type_ids" not in inspect.signature(model.forward).parameters:
        return None
    token = getattr(model.config, "image_token_id", None)
    return None if token is None else int(token)


def image_inputs(images: tuple[ImageInput, ...], device: Any, dtype: Any = None) -> dict[str, Any]:
    """``pixel_values`` and ``image_grid_thw`` of a request's images, as Qwen2-VL-style models take them."""
    import torch

    if not images:
        return {}
    pixels = np.concatenate([np.asarray(image.pixel_values, dtype=np.float32) for image in images])
    return {
        "pixel_values": torch.from_numpy(pixels).to(device, dtype=dtype),
        "image_grid_thw": torch.tensor([list(image.grid) for image in images], device=device),
    }
