"""``tool`` agent loop: generate, parse tool calls, run tools, append results, generate again.

Token-exact: the next turn's prompt is the original prompt plus every response token so far
(model tokens and tool-result tokens, in order).  Tool results are rendered with the model's
chat template as ``tool`` messages (the template's delta after a conversation, so the tokens
are exactly what the template would produce).  The loop ends when the model calls no tool,
after ``max_turns`` assistant turns, or when the response-length budget (``max_new_tokens``,
shared by model and tool tokens) runs out — then the finish reason is ``length``.

Images: with ``max_tool_images`` above 0, a tool may return images as content parts (``{"type": "image_url",
"image_url": {"url": ...}}``, a URL, the file's bytes or a Pillow image; :func:`~daskgen.agents.tools.content_parts`).
Each is read, kept in the store and preprocessed by the worker (:class:`~daskgen.agents.base.ToolMedia`), rendered
in the ``tool`` message as the template renders an image, its placeholder expanded to the image's tokens; every
later turn sends it with its span in the context, and the trajectory records it (``Trajectory.images``, stored in
the ``tool_image_*`` arrays).  A sample takes at most ``max_tool_images``: a tool result with more, or with an image
that cannot be read or processed, reaches the model as an error text; an observation with images that does not fit
the budget is left out whole (the finish reason is ``length``), never cut inside an image.

Context resets: when the model calls the tool named ``context_reset_tool`` (default
``delete_context``), the trajectory so far is kept as a snapshot and a new trajectory starts
from the original prompt plus the tool's argument ``summary`` (if any) as a tool message.  At
most ``max_trajectories`` trajectories per sample; the store gains a ``trajectory`` axis when
that is above 1.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

from daskgen.agents.base import AgentLoop, EngineHandle, ToolMedia, Trajectory
from daskgen.agents.parsers import ToolCall, resolve_parser
from daskgen.agents.tools import call_tool, load_tools
from daskgen.engines.base import FinishReason, GenerationResult, SamplingParams
from daskgen.engines.media import ImageInput
from daskgen.errors import ConfigError, DaskgenError
from daskgen.input.image_refs import template_messages
from daskgen.input.image_tokens import expand
from daskgen.input.tokenizer import load_hf_tokenizer

logger = logging.getLogger(__name__)

_ARGS = {"tools", "max_turns", "tool_timeout_s", "parser", "max_trajectories", "context_reset_tool", "max_tool_images"}
#: What a tool call gives the model: a text, or content parts with images (:func:`~daskgen.agents.tools.content_parts`).
ToolResult = str | list[dict[str, Any]]


@functools.lru_cache(maxsize=4)
def _tokenizer(model: str) -> Any:
    return load_hf_tokenizer(model)


def _ids(encoded: Any) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


class ToolLoop(AgentLoop):
    """Multi-turn tool calling (see the module docstring).

    Agent args: ``tools`` (names or ``module:function``, or a mapping name -> path),
    ``max_turns`` (assistant turns, default 4), ``tool_timeout_s`` (default 30),
    ``parser`` (default ``hermes``), ``max_trajectories`` (default 1),
    ``context_reset_tool`` (default ``delete_context``), ``max_tool_images`` (images a sample's tools may return,
    default 0: none).
    """

    def __init__(self, model: str, **agent_args: Any) -> None:
        unknown = sorted(set(agent_args) - _ARGS)
        if unknown:
            raise ConfigError(f"unknown agent_args {unknown} for agent 'tool'; valid: {sorted(_ARGS)}")
        super().__init__(model, **agent_args)
        self.tools = load_tools(agent_args.get("tools"))
        self.max_turns = int(agent_args.get("max_turns", 4))
        self.tool_timeout_s = float(agent_args.get("tool_timeout_s", 30.0))
        self.parser = resolve_parser(agent_args.get("parser", "hermes"))
        self.max_trajectories = int(agent_args.get("max_trajectories", 1))
        self.reset_tool = agent_args.get("context_reset_tool", "delete_context")
        self.max_tool_images = int(agent_args.get("max_tool_images", 0))
        if self.max_turns < 1 or self.max_trajectories < 1:
            raise ConfigError("agent 'tool': max_turns and max_trajectories must be >= 1")
        if self.max_tool_images < 0:
            raise ConfigError(f"agent 'tool': max_tool_images must be >= 0, found {self.max_tool_images}")

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer (loaded once per worker process)."""
        return _tokenizer(self.model)

    async def run(
        self, engine: EngineHandle, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> list[Trajectory]:
        done: list[Trajectory] = []
        context = list(prompt_ids)
        traj = self._new(params)
        placed: list[ImageInput] = []  # the tools' images at their places in the context (shared by later turns)
        for turn in range(self.max_turns):
            images = (*params.images, *placed)
            result = await self._model_turn(engine, f"{request_id}-t{turn}", context, traj, params, turn, images)
            calls = self._tool_calls(result)
            if not calls or turn == self.max_turns - 1:
                break
            reset = next((c for c in calls if c.name == self.reset_tool), None)
            if reset is not None and len(done) + 1 < self.max_trajectories:
                done.append(traj)
                traj, fits = self._restart(reset, params)
                placed = []
            else:
                results = await self._results(calls, self.max_tool_images - len(traj.images))
                before = len(traj.images)
                fits = await self._append_results(traj, results, params.max_new_tokens, engine.media)
                placed += _in_context(traj.images[before:], len(context))
            if not fits:
                break
        return [*done, traj]

    @staticmethod
    async def _model_turn(
        engine: EngineHandle,
        request_id: str,
        context: list[int],
        traj: Trajectory,
        params: SamplingParams,
        turn: int,
        images: tuple[ImageInput, ...],
    ) -> GenerationResult:
        """Generate the model's next turn after ``context`` and ``traj`` within the budget left; add it to ``traj``.

        ``images``: the request's images (the prompt's and every one the tools returned so far, each at its place
        in ``context`` + the response)."""
        budget = params.max_new_tokens - len(traj.response_ids)
        turn_params = dataclasses.replace(  # a continuation's tokens so far precede its first turn only
            params,
            max_new_tokens=budget,
            seed=None if params.seed is None else params.seed + turn,
            continued=params.continued if turn == 0 else 0,
            images=images,
        )
        result = await engine.generate(request_id, context + traj.response_ids, turn_params)
        traj.add_model_tokens(result)
        return result

    def _tool_calls(self, result: GenerationResult) -> list[ToolCall]:
        """The tool calls of a turn that stopped normally (none after an error or a ``length``/``abort`` finish)."""
        if result.error is not None or result.finish_reason != FinishReason.STOP:
            return []
        return self.parser.parse(self.tokenizer.decode(result.output_ids, skip_special_tokens=True))

    def _restart(self, reset: ToolCall, params: SamplingParams) -> tuple[Trajectory, bool]:
        """A new trajectory after a context reset, holding the reset call's ``summary`` (if any) as a tool message.

        The flag is False when the summary did not fit the token budget (the trajectory then finishes at ``length``).
        """
        traj = self._new(params)
        summary = str(reset.arguments.get("summary", ""))
        return traj, not summary or self._append(traj, [summary], params.max_new_tokens)

    @staticmethod
    def _new(params: SamplingParams) -> Trajectory:
        return Trajectory.for_params(params)

    async def _results(self, calls: list[ToolCall], room: int) -> list[ToolResult]:
        """Each call's result; with images, at most ``room`` images in all (a result with more is an error text)."""
        results: list[ToolResult] = []
        for call in calls:
            result = await self._call(call)
            n = image_count(result)
            if n > room:
                logger.warning(
                    "tool %r returned %d image(s), more than the sample can still take (%d)", call.name, n, room
                )
                result = (
                    f"Error: tool {call.name!r} returned {n} image(s), but this sample can take {room} more "
                    f"(agent_args max_tool_images: {self.max_tool_images})"
                )
            room -= image_count(result)
            results.append(result)
        return results

    async def _call(self, call: ToolCall) -> ToolResult:
        if call.name == self.reset_tool:
            return "Error: context cannot be reset again (max_trajectories reached)"
        return await call_tool(self.tools, call, self.tool_timeout_s, images=self.max_tool_images > 0)

    def _append(self, traj: Trajectory, results: list[str], max_new_tokens: int) -> bool:
        """Append text tool results; False (finish ``length``) when the budget runs out."""
        ids = self.observation_ids(results)
        room = max_new_tokens - len(traj.response_ids)
        if len(ids) >= room:
            traj.add_observation_tokens(ids[: max(room, 0)])
            traj.finish_reason = FinishReason.LENGTH
            return False
        traj.add_observation_tokens(ids)
        return True

    async def _append_results(
        self, traj: Trajectory, results: list[ToolResult], max_new_tokens: int, media: ToolMedia | None
    ) -> bool:
        """Append tool results, images placed (see the module docstring); False (finish ``length``) when the budget
        runs out."""
        if not any(image_count(r) for r in results):
            return self._append(traj, [r if isinstance(r, str) else _text_of(r) for r in results], max_new_tokens)
        if media is None:
            raise ConfigError("the tool loop got images but the worker gave it no way to place them (no media)")
        results, images = await _prepared(results, media)
        ids = self.observation_ids(results)
        if images:
            ids, spans = expand(ids, media.image_token, [image.span[1] for image in images])
        else:
            spans = []
        if len(ids) >= max_new_tokens - len(traj.response_ids):  # never cut inside an image: left out whole
            traj.finish_reason = FinishReason.LENGTH
            return False
        start = len(traj.response_ids)
        traj.images += [dataclasses.replace(i, span=(start + o, n)) for i, (o, n) in zip(images, spans, strict=True)]
        traj.add_observation_tokens(ids)
        return True

    def observation_ids(self, results: Sequence[ToolResult]) -> list[int]:
        """Tokens the chat template adds for ``tool`` messages, ending with the assistant prompt (one placeholder per
        image of the results)."""
        return observation_ids(self.tokenizer, results)


def observation_ids(tokenizer: Any, results: Sequence[ToolResult]) -> list[int]:
    """Tokens ``tokenizer``'s chat template adds for ``tool`` messages holding ``results`` (each image part
    rendered as the template renders an image), ending with the assistant prompt."""
    head_msgs = [{"role": "user", "content": "."}]
    tool_msgs = template_messages([{"role": "tool", "content": r} for r in results])
    head = _ids(tokenizer.apply_chat_template(head_msgs, tokenize=True, add_generation_prompt=False))
    full = _ids(tokenizer.apply_chat_template(head_msgs + tool_msgs, tokenize=True, add_generation_prompt=True))
    if full[: len(head)] != head:
        raise ConfigError(
            "the model's chat template does not render tool messages as a suffix; "
            "the tool loop cannot build token-exact observations for it"
        )
    return full[len(head) :]


def check_tool_image_template(tokenizer: Any, image_token: int) -> None:
    """Refuse (:class:`ConfigError`) a chat template that does not render an image a tool returns as one image
    placeholder: the tool loop could not place the image."""
    ids = observation_ids(tokenizer, [[{"type": "image", "image": ""}, {"type": "text", "text": "."}]])
    found = ids.count(image_token)
    if found != 1:
        raise ConfigError(
            f"the model's chat template renders an image in a tool message as {found} image placeholder(s) (token "
            f"{image_token}), not one: the tool loop cannot place the images tools return with this template; "
            "set agent_args max_tool_images: 0, or give a chat template (chat_template) that renders image parts "
            "of tool messages"
        )


def image_count(result: ToolResult) -> int:
    """How many images a tool result holds."""
    return 0 if isinstance(result, str) else sum(1 for part in result if part["type"] == "image")


def _text_of(parts: list[dict[str, Any]]) -> str:
    return "".join(part["text"] for part in parts if part["type"] == "text")


async def _prepared(results: list[ToolResult], media: ToolMedia) -> tuple[list[ToolResult], list[ImageInput]]:
    """The results with each image prepared (a result with an image that cannot be read or processed: an error text
    instead), and the images in order (``span``: ``(0, tokens)``)."""
    out: list[ToolResult] = []
    images: list[ImageInput] = []
    for result in results:
        if isinstance(result, str):
            out.append(result)
            continue
        try:
            prepared = [await media.prepare(part["image"]) for part in result if part["type"] == "image"]
        except (DaskgenError, OSError, ValueError) as exc:
            logger.warning("an image a tool returned cannot be used: %s", exc)
            out.append(f"Error: an image the tool returned cannot be used: {exc}")
            continue
        out.append(result)
        images += prepared
    return out, images


def _in_context(images: list[ImageInput], offset: int) -> list[ImageInput]:
    """Images a trajectory's tools returned, each span moved from the response into the request's prompt (the
    prompt's ``offset`` tokens, then the response)."""
    return [dataclasses.replace(i, span=(offset + i.span[0], i.span[1])) for i in images]
