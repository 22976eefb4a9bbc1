"""Progress bar for a run: prompts done, prompts/s, generated tokens/s, ETA (tqdm), and the live view's address."""

from __future__ import annotations

import time
from types import TracebackType

from tqdm.auto import tqdm


def announce_page(url: str | None, *, enabled: bool = True) -> None:
    """Print the address of the run's page on the Dask dashboard above the progress bars."""
    if url and enabled:
        tqdm.write(f"daskgen: live view at {url}")


class Progress:
    """A tqdm bar over prompts with generated tokens/s and failures in its postfix."""

    def __init__(self, total: int, *, enabled: bool = True) -> None:
        self._bar = tqdm(
            total=total, unit="prompt", desc="daskgen", disable=not enabled, dynamic_ncols=True, smoothing=0.1
        )
        self._t0 = time.perf_counter()
        self.total = total
        self.prompts = 0
        self.tokens = 0
        self.failed = 0
        #: Partitions in flight after the last top-up, against the target (e.g. ``"16/16"``).
        self.in_flight: str | None = None

    def in_flight_now(self, partitions: int, target: int, *, stopping: bool) -> None:
        """Partitions in flight against the target (``"14/16"``); once a stop began nothing more goes out and the
        target means nothing: the count alone."""
        self.in_flight = str(partitions) if stopping else f"{partitions}/{target}"

    def update(self, prompts: int, tokens: int, failed: int = 0) -> None:
        """Record a committed partition (the postfix also shows :attr:`in_flight` when set)."""
        self.prompts += prompts
        self.tokens += tokens
        self.failed += failed
        if self._bar.disable:  # --no-progress: count only (the postfix is never shown)
            return
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        postfix = {"tok_s": f"{self.tokens / elapsed:.0f}", "failed": self.failed}
        if self.in_flight is not None:
            postfix["in_flight"] = self.in_flight
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(prompts)

    def grow(self, prompts: int) -> None:
        """``prompts`` more to generate (rows sent back for generation while the run goes on)."""
        self.total += prompts
        if not self._bar.disable:
            self._bar.total = self.total
            self._bar.refresh()

    @property
    def postfix(self) -> str:
        """The bar's postfix as shown (empty for a hidden bar: nothing is formatted)."""
        return str(getattr(self._bar, "postfix", None) or "")

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.close()
