"""The outcome of a run: counts over the whole store, what this invocation did, and its closing line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from daskgen.store.layout import DONE, FAILED, PENDING
from daskgen.tail import tail_share

if TYPE_CHECKING:
    from daskgen.client.live import LiveRun


@dataclass
class RunSummary:
    """Outcome of a run (counts cover the whole store, not only this invocation)."""

    store: str
    total: int
    done: int
    failed: int
    pending: int
    generated_prompts: int = 0
    response_tokens: int = 0
    seconds: float = 0.0
    stopped: str | None = None
    interrupted: str | None = None
    partial_samples: int = 0
    partial_tokens: int = 0
    carried_tokens: int = 0
    tail_share: float | None = None
    peak_prompts_in_flight: int = 0
    #: Done prompts followers sent back as too stale (``stale="regenerate"``), set pending again by this run.
    requeued: int = 0
    #: Engine vs committed tokens over the run and per-worker totals, from the dashboard plugin (or ``None``).
    engines: dict | None = None

    @property
    def ok(self) -> bool:
        """True when every prompt is done."""
        return self.failed == 0 and self.pending == 0

    def line(self) -> str:
        """The closing summary line."""
        rate = self.generated_prompts / self.seconds if self.seconds else 0.0
        tps = self.response_tokens / self.seconds if self.seconds else 0.0
        text = (
            f"daskgen: {self.done} done, {self.failed} failed, {self.pending} pending of {self.total} prompts; "
            f"this run generated {self.generated_prompts} prompts in {self.seconds:.1f} s "
            f"({rate:.2f} prompts/s, {tps:.0f} tokens/s) -> {self.store}"
        )
        if self.tail_share is not None:
            text += f"; the last 10% of prompts took {100 * self.tail_share:.0f}% of the generating time"
        if self.requeued:
            text += f"\n{self.requeued} prompts requeued by followers, regenerated"
        if self.carried_tokens:
            text += f"\nkept {self.carried_tokens} tokens stored by interrupted attempts instead of regenerating them"
        if self.interrupted and not self.pending:
            text += f"\ninterrupted ({self.interrupted}) after every prompt had ended: nothing is left to resume."
        elif self.interrupted:
            text += (
                f"\ninterrupted ({self.interrupted}): kept {self.done} done prompts and saved "
                f"{self.partial_samples} partial responses ({self.partial_tokens} tokens); rerun the same "
                "command to resume — they continue where they stopped."
            )
        elif self.stopped:
            text += (
                f"\nstopped early: {self.stopped}; in-flight prompts were aborted and stay pending "
                f"({self.partial_samples} partial responses, {self.partial_tokens} tokens saved) — rerun "
                "the same command (without the stop condition) to finish them."
            )
        if self.failed:
            text += (
                f"\n{self.failed} prompt(s) failed: `daskgen status {self.store}` shows why; rerun the same "
                "command with --retry-failed to retry them."
            )
        return text


def summarize(run: LiveRun, seconds: float) -> RunSummary:
    """Counts over the whole store."""
    s = run.status
    return RunSummary(
        str(run.plan.config.store),
        len(s),
        int((s == DONE).sum()),
        int((s == FAILED).sum()),
        int((s == PENDING).sum()),
        run.generated_prompts,
        run.response_tokens,
        seconds,
        stopped=run.stop.reason,
        interrupted=run.stop.interrupted(),
        partial_samples=run.partial_samples,
        partial_tokens=run.partial_tokens,
        carried_tokens=run.carried_tokens,
        tail_share=None if run.generating_since is None else tail_share(run.committed_at, run.generating_since),
        peak_prompts_in_flight=run.peak_prompts,
        requeued=run.requeued_prompts,
        engines=run.engine_record,
    )
