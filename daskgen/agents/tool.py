"""``tool`` agent loop: generate, parse tool calls, run tools, append results, generate again.

Token-exact: the next turn's prompt is the original prompt plus every response token so far
(model tokens and tool-result tokens, in order).  Tool results are rendered with the model's
chat template as ``tool`` messages (the template's delta after a conversation, so the tokens
are exactly what the template would produce).  The loop ends when the model calls no tool,
after ``max_turns`` assistant turns, or when the response-length budget (``max_new_tokens``,
shared by model and tool tokens) runs out — then the finish reason is ``length``.

Context resets: when the model calls the tool named ``context_reset_tool`` (default
``delete_context``), the trajectory so far is kept as a snapshot and a new trajectory starts
from the original prompt plus the tool's argument ``summary`` (if any) as a tool message.  At
most ``max_trajectories`` trajectories per sample; the store gains a ``trajectory`` axis when
that is above 1.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from daskgen.agents.base import AgentLoop, EngineHandle, Trajectory
from daskgen.agents.parsers import ToolCall, resolve_parser
from daskgen.agents.tools import call_tool, load_tools
from daskgen.engines.base import FinishReason, GenerationResult, SamplingParams
from daskgen.errors import ConfigError
from daskgen.input.tokenizer import load_hf_tokenizer

_ARGS = {"tools", "max_turns", "tool_timeout_s", "parser", "max_trajectories", "context_reset_tool"}


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
    ``context_reset_tool`` (default ``delete_context``).
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
        if self.max_turns < 1 or self.max_trajectories < 1:
            raise ConfigError("agent 'tool': max_turns and max_trajectories must be >= 1")

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
        for turn in range(self.max_turns):
            result = await self._model_turn(engine, f"{request_id}-t{turn}", context, traj, params, turn)
            calls = self._tool_calls(result)
            if not calls or turn == self.max_turns - 1:
                break
            reset = next((c for c in calls if c.name == self.reset_tool), None)
            if reset is not None and len(done) + 1 < self.max_trajectories:
                done.append(traj)
                traj, fits = self._restart(reset, params)
            else:
                fits = self._append(traj, [await self._call(c) for c in calls], params.max_new_tokens)
            if not fits:
                break
        return [*done, traj]

    @staticmethod
    async def _model_turn(
        engine: EngineHandle, request_id: str, context: list[int], traj: Trajectory, params: SamplingParams, turn: int
    ) -> GenerationResult:
        """Generate the model's next turn after ``context`` and ``traj`` within the budget left; add it to ``traj``."""
        budget = params.max_new_tokens - len(traj.response_ids)
        turn_params = dataclasses.replace(  # a continuation's tokens so far precede its first turn only
            params,
            max_new_tokens=budget,
            seed=None if params.seed is None else params.seed + turn,
            continued=params.continued if turn == 0 else 0,
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

    async def _call(self, call: ToolCall) -> str:
        if call.name == self.reset_tool:
            return "Error: context cannot be reset again (max_trajectories reached)"
        return await call_tool(self.tools, call, self.tool_timeout_s)

    def _append(self, traj: Trajectory, results: list[str], max_new_tokens: int) -> bool:
        """Append tool results; False (finish ``length``) when the budget runs out."""
        ids = self.observation_ids(results)
        room = max_new_tokens - len(traj.response_ids)
        if len(ids) >= room:
            traj.add_observation_tokens(ids[: max(room, 0)])
            traj.finish_reason = FinishReason.LENGTH
            return False
        traj.add_observation_tokens(ids)
        return True

    def observation_ids(self, results: list[str]) -> list[int]:
        """Tokens the chat template adds for ``tool`` messages, ending with the assistant prompt."""
        tok = self.tokenizer
        head_msgs = [{"role": "user", "content": "."}]
        tool_msgs = [{"role": "tool", "content": r} for r in results]
        head = _ids(tok.apply_chat_template(head_msgs, tokenize=True, add_generation_prompt=False))
        full = _ids(tok.apply_chat_template(head_msgs + tool_msgs, tokenize=True, add_generation_prompt=True))
        if full[: len(head)] != head:
            raise ConfigError(
                "the model's chat template does not render tool messages as a suffix; "
                "the tool loop cannot build token-exact observations for it"
            )
        return full[len(head) :]
