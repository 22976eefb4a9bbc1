"""What a partition's input rows give the worker beside their tokens: their prompts tokenized (with their images
read, stored and placed: :mod:`daskgen.worker.images`), and the per-prompt texts stored with them (kept input
columns, the response format, the adapter)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from daskgen.input.rows import tokenize_rows
from daskgen.store.layout import Layout, column_array

if TYPE_CHECKING:
    from daskgen.engines.base import SamplingParams
    from daskgen.input.chat_template import ChatTemplate
    from daskgen.input.response_format import ResponseFormat
    from daskgen.store.generation_store import GenerationStore


class PartitionTask(Protocol):
    """What these functions read of a :class:`daskgen.worker.task.PartitionTask` (and set: prompts, images)."""

    store: GenerationStore
    rows: list[int]
    inputs: list[dict[str, Any]] | None
    prompts: list[list[int]] | None
    images: Any
    preprocessed: Any
    params: SamplingParams
    chat_template: ChatTemplate | None
    image_storage: str

    @property
    def layout(self) -> Layout: ...


async def tokenize_inputs(task: PartitionTask, plugin: Any) -> None:
    """Set ``task.prompts`` to its rows' token ids (chat template included) and, when rows name images,
    ``task.images`` to their images with the placeholders expanded in the prompts (``plugin``: the worker's
    engine plugin, for its tokenizer, model and engine args)."""
    inputs = task.inputs or []
    with_images = any(row.get("image_urls") for row in inputs)
    images = None
    if with_images:
        from daskgen.worker.images import preparer

        images = preparer(str(plugin.model), bool(plugin.engine_args.get("trust_remote_code", False)))
    vision = None if images is None else await asyncio.to_thread(lambda: images.vision)
    prompts = await asyncio.to_thread(
        lambda: tokenize_rows(inputs, plugin.tokenizer(), task.chat_template, task.rows, vision)
    )
    if images is not None:
        prompts, task.images = await images.prepare(
            inputs, prompts, task.store.location, task.preprocessed, storage=task.image_storage, numbers=task.rows
        )
    task.prompts = prompts


def place_row_texts(region: dict[str, np.ndarray], task: PartitionTask, offsets: list[int]) -> None:
    """Store each pending row's extra input columns and (in a structured store) its response format."""
    layout = task.layout
    if not task.inputs and not layout.structured and not layout.adapters:
        return
    for i, r in enumerate(offsets):
        for name, text in (task.inputs[i].get("columns", {}) if task.inputs else {}).items():
            region[column_array(name)][r] = text
        if layout.structured:
            region["response_format"][r] = row_format.text() if (row_format := input_format(task, i)) else ""
        if layout.adapters:
            region["adapter"][r] = input_adapter(task, i) or ""


def input_format(task: PartitionTask, i: int) -> ResponseFormat | None:
    """The structured-output format of the task's ``i``-th row (its own or the run's), or ``None``."""
    return task.inputs[i].get("response_format") if task.inputs else task.params.response_format


def input_adapter(task: PartitionTask, i: int) -> str | None:
    """The LoRA adapter of the task's ``i``-th row (its own or the run's), or ``None`` for the base model."""
    return task.inputs[i].get("adapter") if task.inputs else task.params.adapter
