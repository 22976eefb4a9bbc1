"""Test doubles (labelled as such): wrappers around real engines for fault and accounting tests.

``RecordingEngine`` delegates every request to a real registered engine and appends the
request id of each ``generate`` call to a log file, so a test can count how often a prompt
was generated across processes and crashes.  It can also be told to misbehave, to exercise
failure handling: raise on chosen prompts (``poison_rows``), never answer chosen prompts
(``hang_rows``), kill its own process at once on chosen prompts (``kill_rows``: a real SIGKILL,
as an engine segfault or an OOM kill would end it), or hang completely — health checks included —
until it is restarted (``hang_once_flag``: after ``hang_after`` generate calls, the first engine
instance that finds no file at that path creates it and hangs).  It accepts and ignores an
``api_key`` (for secret-leak tests).  Never use these for real runs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

from daskgen.engines import resolve_engine_class
from daskgen.engines.base import Engine, GenerationRequest, GenerationResult
from daskgen.input.tokenizer import load_hf_tokenizer
from daskgen.testing.probes import append_prompt


class _Wrapper(Engine):
    """Delegates start/abort/shutdown/health token/crash to the real ``inner`` engine."""

    inner: Engine
    #: Copied from the inner engine.
    supports_seed: bool = False

    async def load(self) -> None:
        await self.inner.start()

    async def unload(self) -> None:
        await self.inner.shutdown()

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    def health_token_id(self) -> int:
        return self.inner.health_token_id()

    def crash(self) -> str | None:
        return self.inner.crash()


class RecordingEngine(_Wrapper):
    """Test double: a real inner engine plus a per-call log and optional poison rows.

    Engine args: ``inner`` (engine name), ``log_path`` (file to append request ids to),
    ``prompts_log`` (file to append one JSON line per request to: its id and the token ids it was sent),
    ``timing_log`` (file to append ``id start end output_tokens`` to as each request finishes, wall-clock
    seconds: where a benchmark sees the engine's own span),
    ``poison_rows`` (rows whose requests raise, simulating an engine crash), ``kill_rows`` (rows whose
    requests SIGKILL the process the engine runs in, after logging the call), ``hold_rows`` and ``hold_until``
    (rows whose requests, once logged, wait until the file ``hold_until`` exists: a test then knows a partition
    is in flight on the worker), and every other key is passed to the inner engine.
    """

    name = "recording"

    def __init__(
        self,
        model: str,
        inner: str = "simulated",
        log_path: str | None = None,
        poison_rows: list[int] | None = None,
        kill_rows: list[int] | None = None,
        hang_rows: list[int] | None = None,
        hang_once_flag: str | None = None,
        hang_after: int = 0,
        api_key: str | None = None,
        prompts_log: str | None = None,
        timing_log: str | None = None,
        hold_rows: list[int] | None = None,
        hold_until: str | None = None,
        **inner_args: Any,
    ) -> None:
        super().__init__(model, inner=inner, log_path=log_path, poison_rows=poison_rows, **inner_args)
        self.prompts_log, self.timing_log = prompts_log, timing_log
        self.inner = resolve_engine_class(inner)(model, **inner_args)
        self.simulated = self.inner.simulated
        self.supports_seed = self.inner.supports_seed
        self.continues = self.inner.continues
        self.log_path = log_path
        self.poison = {f"p{r}-" for r in (poison_rows or [])}
        self.hang = {f"p{r}-" for r in (hang_rows or [])}
        self.kill = {f"p{r}-" for r in (kill_rows or [])}
        self.hold, self.hold_until = {f"p{r}-" for r in (hold_rows or [])}, hold_until
        self.hang_all = False
        self.hang_once_flag, self.hang_after, self.calls = hang_once_flag, hang_after, 0

    @classmethod
    def is_simulated(cls, engine_args: dict[str, Any]) -> bool:
        return resolve_engine_class(engine_args.get("inner", "simulated")).is_simulated(engine_args)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        if request.request_id != "daskgen-health" and self.log_path:
            with open(self.log_path, "a") as fh:
                fh.write(f"{request.request_id} {os.getpid()}\n")
        if request.request_id != "daskgen-health" and self.prompts_log:
            append_prompt(self.prompts_log, request)
        if request.request_id != "daskgen-health":
            self.calls += 1
        if self.hang_once_flag and self.calls > self.hang_after and not os.path.exists(self.hang_once_flag):
            open(self.hang_once_flag, "w").close()
            self.hang_all = True
        if any(request.request_id.startswith(p) for p in self.kill):
            os.kill(os.getpid(), signal.SIGKILL)  # the whole process dies at once, as in a segfault
        if any(request.request_id.startswith(p) for p in self.poison):
            raise RuntimeError(f"poison prompt crashed the engine ({request.request_id})")
        if self.hang_all or any(request.request_id.startswith(p) for p in self.hang):
            await asyncio.Event().wait()  # never answers
        if self.hold_until and any(request.request_id.startswith(p) for p in self.hold):
            while not os.path.exists(self.hold_until):
                await asyncio.sleep(0.05)
        start = time.time()
        result = await self.inner.generate(request)
        if self.timing_log and request.request_id != "daskgen-health":
            with open(self.timing_log, "a") as fh:  # one O_APPEND write per line
                fh.write(f"{request.request_id} {start} {time.time()} {len(result.output_ids)}\n")
        return result


class ScriptedToolEngine(_Wrapper):
    """Test double: scripted model text on chosen turns, the real inner engine otherwise.

    A tiny random model never emits tool calls, so tests script the assistant text of chosen
    turns (``script``: turn number -> text; the engine tokenizes it with the model's tokenizer
    and ends it with EOS).  Every other turn is generated by the real ``inner`` engine.  The
    turn number comes from the tool loop's request id suffix ``-t<k>``.
    """

    name = "scripted-tool"

    @classmethod
    def features_with(cls, engine_args: dict[str, Any]) -> frozenset[str]:
        """The inner engine's features: every turn not scripted is its own (images, for one)."""
        return cls.features | resolve_engine_class(engine_args.get("inner", "transformers")).features_with(engine_args)

    def __init__(
        self, model: str, inner: str = "transformers", script: dict[str, str] | None = None, **inner_args: Any
    ) -> None:
        super().__init__(model, inner=inner, script=script, **inner_args)
        self.inner = resolve_engine_class(inner)(model, **inner_args)
        self.supports_seed = self.inner.supports_seed
        self.continues = self.inner.continues
        self.script = {int(k): v for k, v in (script or {}).items()}
        self.tokenizer: Any = None

    async def load(self) -> None:
        self.tokenizer = load_hf_tokenizer(self.model)
        await self.inner.start()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        turn = int(request.request_id.rpartition("-t")[2]) if "-t" in request.request_id else 0
        text = self.script.get(turn)
        if text is None:
            return await self.inner.generate(request)
        from daskgen.engines.base import FinishReason

        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        ids = ids[: request.params.max_new_tokens]
        finish = FinishReason.STOP if ids[-1] == self.tokenizer.eos_token_id else FinishReason.LENGTH
        logprobs = [-0.5] * len(ids) if request.params.logprobs else None
        return GenerationResult(request.request_id, ids, finish, logprobs)
