"""What each refresh of ``benchmarks/refresh.py`` cost the workers: shared-storage reads and the serving pause.

Every worker records, with its policy state (``daskgen.policy.workers/<worker>.json``,
:class:`daskgen.store.policy.WorkerPolicy`), what the refresh to a version cost it: the bytes it read from shared
storage (the store's policy area and published checkpoint folders), the seconds getting the version's folder (a
delta version's rebuild in the node's cache) and staging it (``Engine.stage_weights``: the ``transformers`` engine
reads and fingerprints the tensors), both while the engine goes on generating, the seconds its engine paused
(from holding no request of the run to admitting again) and, of those, the seconds loading
(``Engine.apply_staged``; of them, the wait for the generation step in progress to end, where the engine tells it:
a forward pass cannot be interrupted) and checking what the engine holds against the published fingerprint.
:func:`cost_rows` reads the first such record of each worker and version.

The engine's own load-from-memory time (:func:`memory_load_seconds`) is, for ``transformers``,
``model.load_state_dict`` of a checkpoint's tensors already in memory into a model of the same checkpoint in
this process (one torch thread, the fastest of 3); for ``sglang`` and ``vllm`` it is the fastest load of the run
(:func:`fill_baseline`): ``sglang`` loads staged tensors from host memory (``update_weights_from_tensor``), ``vllm``
reloads from the copy of the version's folder it staged in host memory (``/dev/shm``).  Under ``continue``, each
worker also records the requests its refresh interrupted and their tokens, which its engine prefills again on the
new weights (:func:`carried_rows`, beside :func:`prefill_rate`, the engine's prefill rate).  :func:`read_bandwidth`
is the page cache's read rate of a checkpoint's weights, the "shared storage" of a one-machine run
(``benchmarks/refresh_scaling.py`` uses it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

#: The header of the per-version cost table (``benchmarks/refresh_scaling.py`` reads the table by it).
COST_HEADER = [
    "publish",
    "policy",
    "version",
    "kind",
    "version bytes",
    "loaded on every worker (s)",
    "shared-storage bytes read, all workers",
    "fetch s, slowest worker",
    "stage s, slowest worker",
    "pause s, slowest worker",
    "load s, slowest worker",
    "check s, slowest worker",
    "step wait s, slowest worker",
    "pause without the step wait s, slowest worker",
    "engine load from memory (s)",
    "pause / load from memory",
    "pause without the step wait / load from memory",
]
#: Each column's index in a cost row.
AT = {name: i for i, name in enumerate(COST_HEADER)}


def weight_bytes(folder: Path) -> int:
    """The bytes of the safetensors files of the checkpoint folder ``folder``."""
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def read_bandwidth(folder: Path, rounds: int = 3) -> float:
    """Bytes per second reading the safetensors files of ``folder`` (the fastest of ``rounds`` reads)."""
    files, best = sorted(folder.glob("*.safetensors")), float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for file in files:
            with open(file, "rb") as handle:
                while handle.read(1 << 24):
                    pass
        best = min(best, time.perf_counter() - started)
    return weight_bytes(folder) / best


def memory_load_seconds(engine: str, checkpoint: Path, rounds: int = 3) -> float | None:
    """``transformers``: the fastest of ``rounds`` ``load_state_dict`` of ``checkpoint``'s tensors, already in
    memory, into a model of it (one torch thread); ``None`` for the other engines (taken from their runs)."""
    if engine != "transformers":
        return None
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint))
    tensors = {}
    for file in sorted(checkpoint.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    best = float("inf")
    with torch.no_grad():
        for _ in range(rounds):
            started = time.perf_counter()
            model.load_state_dict(tensors, strict=False)
            best = min(best, time.perf_counter() - started)
    return best


def prefill_rate(engine: str, checkpoint: Path, tokens: int = 512, rounds: int = 3) -> float | None:
    """``transformers``: prompt tokens per second the model prefills, one forward pass over ``tokens`` tokens (the
    CPU default of its ``max_batch_tokens`` per step) with one torch thread, the fastest of ``rounds``; ``None``
    for the other engines."""
    if engine != "transformers":
        return None
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint)).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    best = float("inf")
    with torch.no_grad():
        for _ in range(rounds):
            started = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            best = min(best, time.perf_counter() - started)
    return tokens / best


#: The header of the table of what a ``continue`` refresh carried onto the new version.
CARRIED_HEADER = [
    "version",
    "requests continued, all workers",
    "tokens to prefill again, all workers",
    "tokens to prefill again, most on one worker",
    "their prefill at the engine's rate (s)",
]


def carried_rows(run: dict[str, Any], rate: float | None) -> list[list[Any]]:
    """Per published version of a ``continue`` run: the requests its refresh interrupted on every worker, the
    prompt and generated tokens of those that had begun (which each engine prefills again on the new weights), the
    most-loaded worker's prefill of them at ``rate`` tokens/s (:func:`prefill_rate`)."""
    costs, rows = first_records(run["records"]), []
    for version in sorted(run["published"]):
        mine = [rec for (_, v), rec in costs.items() if v == version and rec.interrupted is not None]
        tokens = [rec.interrupted_tokens or 0 for rec in mine]
        most = max(tokens, default=None)
        seconds = None if most is None or not rate else most / rate
        rows.append([version, sum(r.interrupted for r in mine) if mine else None, sum(tokens), most, seconds])
    return rows


def first_records(seen: dict[tuple[str, str, int], Any]) -> dict[tuple[str, int], Any]:
    """Each worker's first ``running`` record of each version that carries a refresh's cost."""
    return {(w, v): rec for (w, state, v), rec in seen.items() if state == "running" and rec.paused_seconds is not None}


def cost_rows(
    mode: str, policy: str, run: dict[str, Any], sizes: dict[int, int], baseline: float | None
) -> list[list[Any]]:
    """One row per published version of a run: its kind and bytes (``sizes``: a full version's weights, a delta
    version's delta), reads over every worker, the slowest worker's costs.  Without
    ``baseline`` (vllm, sglang) the rows' load-from-memory column is filled in later (:func:`fill_baseline`)."""
    costs, rows = first_records(run["records"]), []
    for version, published in sorted(run["published"].items()):
        mine = [rec for (_, v), rec in costs.items() if v == version]
        loaded = [published_to(r, published) for r in mine]
        waits = [r.step_wait_seconds for r in mine if r.step_wait_seconds is not None]
        row = [mode, policy, version, run["kinds"][version], sizes[version], max(loaded, default=None),
               sum(r.shared_bytes or 0 for r in mine) if mine else None,
               max((r.fetch_seconds for r in mine), default=None),
               max((r.stage_seconds for r in mine if r.stage_seconds is not None), default=None),
               max((r.paused_seconds for r in mine), default=None),
               max((r.load_seconds for r in mine), default=None), max((r.check_seconds for r in mine), default=None),
               max(waits, default=None), max((pause_past_the_step(r) for r in mine), default=None),
               None, None, None]  # fmt: skip
        rows.append(set_baseline(row, baseline))
    return rows


def pause_past_the_step(record: Any) -> float:
    """A worker's pause less its wait for the generation step in progress to end (0 where the engine cannot tell):
    the part of the pause the refresh itself costs.  The slowest worker's is the table's column."""
    return float(record.paused_seconds - (record.step_wait_seconds or 0))


def set_baseline(row: list[Any], baseline: float | None) -> list[Any]:
    """``row`` with ``baseline`` as its load-from-memory time and its pauses over it (the one rule for both ratios)."""
    pause, rest = row[AT["pause s, slowest worker"]], row[AT["pause without the step wait s, slowest worker"]]
    row[AT["engine load from memory (s)"]] = baseline
    row[AT["pause / load from memory"]] = over(pause, baseline)
    row[AT["pause without the step wait / load from memory"]] = over(rest, baseline)
    return row


def over(seconds: float | None, baseline: float | None) -> float | None:
    """``seconds / baseline``, or ``None`` where either is missing."""
    return None if seconds is None or not baseline else seconds / baseline


def published_to(record: Any, published: float) -> float:
    """Seconds from the publish to the worker's ``running`` record."""
    import datetime as dt

    return dt.datetime.fromisoformat(record.time).timestamp() - published


def fill_baseline(rows: list[list[Any]]) -> float | None:
    """For ``sglang`` and ``vllm``: the fastest load of the rows as every row's load-from-memory time, and each
    row's pauses over it."""
    loads = [row[AT["load s, slowest worker"]] for row in rows if row[AT["load s, slowest worker"]]]
    if not loads:
        return None
    best = float(np.min(loads))
    for row in rows:
        set_baseline(row, best)
    return best
