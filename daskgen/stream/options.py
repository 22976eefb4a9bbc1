"""The options of following a store, each declared once (see :mod:`daskgen.declare`).

:class:`FollowOptions` are the keywords of :func:`daskgen.follow` and the settings of a
:class:`~daskgen.stream.batches.Follower`; those with a flag are options of ``daskgen follow`` too.
:class:`SinkOptions` are the flags of ``daskgen follow`` that say where the batches go.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.declare import option
from daskgen.errors import FollowError

if TYPE_CHECKING:
    from daskgen.store.location import StoreRef

#: How the tensor formats pad a batch: to the store's widths, or to the batch's own longest prompt and response.
PADDINGS = ("store", "batch")


#: The orders a follower delivers in (:mod:`daskgen.stream.order`).
ORDERS = ("commit", "window")
#: What a follower with ``max_staleness`` does with a sample too stale (:mod:`daskgen.stream.staleness`).
STALE_MODES = ("flag", "regenerate")


@dataclass(frozen=True)
class FollowOptions:
    """How a follower reads a store; the help of each option is in its declaration."""

    batch_prompts: int = option(
        64,
        "Done prompt groups (all samples of a prompt) per batch. While a run writes the store, a batch is "
        "handed out once this many are committed; the last batch may be smaller.",
        flags=("--batch",),
    )
    order: str = option(
        "commit",
        "commit: prompts as they were committed (short samples first); window: input order within a sliding "
        "window of --window prompts (a finished prompt past the window waits for the first undelivered one; "
        "failed prompts and the end of the run move the window on).",
    )
    window: int | None = option(
        None, "Prompts in the sliding window of order window (default: the tunable daskgen.follow.window)."
    )
    max_staleness: int | None = option(
        None,
        "Deliver as fresh only samples whose first token's policy version is at most this many versions behind "
        "the newest published one (daskgen policy publish), read when each batch is formed; default: no bound.",
    )
    stale: str = option(
        "flag",
        "With --max-staleness, what is too stale: flag (delivered, with a per-sample boolean field stale) or "
        "regenerate (the whole prompt group is not delivered and is generated again by the next run on the store).",
    )
    cursor: str = option("default", "The name of the durable position (independent names follow independently).")
    fields: tuple[str, ...] | list[str] | None = option(
        None,
        "Data arrays to read (default: all for xarray; the tensor and row formats always read the token arrays "
        "they are built from).",
        flags=None,
    )
    format: str = option(
        "xarray",
        "xarray (a Dataset over prompt), tensordict, dataproto (verl), rows (a list of dicts, one per "
        "generated sample) or arrow (a pyarrow Table of those rows).",
        flags=None,
    )
    pad: str = option(
        "store",
        "How the tensor formats pad a batch: store (to the store's max_prompt_tokens and max_new_tokens: every batch "
        "has one shape, so batches concatenate) or batch (to the batch's own longest prompt and response).",
        flags=None,
    )
    multi_modal: bool = option(
        True,
        "Give the tensordict and dataproto formats of a store with images verl's multi_modal_data (the images) and "
        "multi_modal_inputs (pixel_values, image_grid_thw), made from the stored images by the model's image "
        "processor once per distinct image; off: only the images' hashes, spans and grids.",
        flags=None,
    )
    image_model: str | None = option(
        None,
        "The model folder whose image processor makes multi_modal_inputs (default: the run's model, as the store "
        "records it); its processor must be the one the run used.",
        flags=None,
    )
    wait: bool = option(
        True, "Wait while a run writes the store (or one is starting); off: deliver what is committed now, then stop."
    )
    timeout: float | None = option(
        None,
        "Seconds to wait for one batch; then a FollowTimeout error (exit status 2 on the command line), the "
        "cursor keeping the last acknowledged position. Default: wait as long as a run writes the store.",
    )
    auto_ack: bool = option(
        True,
        "Acknowledge each batch when the next one is asked for (and the last when the iteration ends); off: "
        "call Batch.ack yourself (acknowledging a batch acknowledges the ones before it).",
        flags=None,
    )
    client: Any = option(
        None,
        "A distributed.Client of the run's cluster: commits are noticed through the run's commit events at "
        "once, not only at the next poll (the tunable daskgen.follow.poll-interval).",
        flags=None,
    )
    cursor_dir: StoreRef | None = option(
        None, "Keep the cursor in this folder or URL instead of inside the store.", flags=None
    )
    storage_options: dict[str, Any] | None = option(
        None, "obstore options of an object-storage store (as for daskgen run).", flags=None
    )

    def __post_init__(self) -> None:
        if not isinstance(self.batch_prompts, int) or self.batch_prompts < 1:
            raise FollowError(f"batch_prompts must be an integer >= 1, got {self.batch_prompts!r}")
        if self.order not in ORDERS:
            raise FollowError(
                f"unknown follow order {self.order!r}: choose 'commit' (as committed) or 'window' (input order "
                "within a sliding window)."
            )
        w = self.window
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
            raise FollowError(f"window must be an integer >= 1 (prompts), got {w!r}; e.g. window=256.")
        if self.pad not in PADDINGS:
            raise FollowError(f"pad must be one of {', '.join(PADDINGS)}, got {self.pad!r}.")
        k = self.max_staleness
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise FollowError(f"max_staleness must be an integer >= 0 (policy versions), got {k!r}; e.g. 1.")
        if self.stale not in STALE_MODES:
            raise FollowError(
                f"unknown stale mode {self.stale!r}: choose 'flag' (deliver, flagged) or 'regenerate' (send the "
                "prompt back to be generated again)."
            )


@dataclass(frozen=True)
class SinkOptions:
    """Where ``daskgen follow`` writes the batches."""

    sink: str = option("jsonl", "jsonl (stdout) or parquet-dir (one file per batch).", flags=("--format", "-f"))
    out: Path | None = option(None, "Folder of the parquet-dir batches.")
