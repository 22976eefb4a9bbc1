"""Human-readable views of a store: status report and decoded answers."""

from __future__ import annotations

import json

import numpy as np

from daskgen.store.generation_store import GenerationStore
from daskgen.store.images import storage_summary, stored_images
from daskgen.store.layout import DONE, FAILED, PENDING
from daskgen.store.location import StoreRef
from daskgen.store.policy import PolicyVersion, WorkerPolicy, read_versions, read_worker_policies
from daskgen.store.records.cursors import not_acknowledged


def status_report(path: StoreRef) -> str:
    """Counts, tokens generated and settings of a store, as text."""
    store = GenerationStore.open(path)
    attrs = store.attrs
    status = store.read_status()
    done = status == DONE
    lengths = store.read_region(0, len(status), ("response_length",))["response_length"]
    tokens = int(lengths[done].sum())
    lines = [
        f"store:    {path}",
        f"prompts:  {len(status)}  done {int(done.sum())}  pending {int((status == PENDING).sum())}  "
        f"failed {int((status == FAILED).sum())}",
        f"tokens generated (done prompts): {tokens}",
        f"created:  {attrs.created}" + ("  [SIMULATED: not model output]" * attrs.simulated),
        "settings: " + json.dumps(attrs.identity, sort_keys=True),
        "input:    " + json.dumps(attrs.input, sort_keys=True),
        "checksums: " + _checksum_summary(store),
        *_image_line(store),
        *_thread_slots_line(attrs),
        *_cursor_lines(store, status),
        *_policy_lines(store, done),
        *_first_errors(store, status),
    ]
    return "\n".join(lines)


def _image_line(store: GenerationStore) -> list[str]:
    """How a store with images keeps them: as bytes, or as references to files outside it (nothing without)."""
    layout = store.layout
    return (
        [f"images:   {storage_summary(stored_images(store.location))}"]
        if layout.max_images or layout.tool_images
        else []
    )


def _thread_slots_line(attrs: object) -> list[str]:
    """The last run's note that workers' thread slots kept its engines underfed, if it made one."""
    note = (getattr(attrs, "engine", None) or {}).get("thread_slots")
    return [f"workers:  {note}"] if note else []


def _policy_lines(store: GenerationStore, done: np.ndarray) -> list[str]:
    """The published policy versions (``daskgen policy publish``), the workers' states (runs with ``refresh``)
    and the generated samples of done prompts per policy version."""
    versions = read_versions(store.location)
    lines = ["policy versions:", *(f"  {v.version}: {v.path} (published {v.time}{_digest(v)})" for v in versions)]
    for w in read_worker_policies(store.location):
        note = {"loading": f", loading version {w.asked}", "failed": f", loading version {w.asked} failed: {w.error}"}
        lines.append(f"  worker {w.worker}: version {w.version}{note.get(w.state, '')} ({w.time}){_cost(w)}")
    return [*lines, *_samples_per_version(store, done)] if len(lines) > 1 else []


def _cost(w: WorkerPolicy) -> str:
    """What a worker's refresh to its running version cost, as status shows it (nothing before a refresh)."""
    if w.state != "running" or w.paused_seconds is None:
        return ""
    read = "" if w.shared_bytes is None else f"read {w.shared_bytes:,} bytes from shared storage, "
    wait = "" if w.step_wait_seconds is None else f", of it {w.step_wait_seconds:.3g} s for the step in progress to end"
    paused = f"paused the engine {w.paused_seconds:.3g} s (load {w.load_seconds:.3g} s{wait})"
    if w.interrupted is not None:
        paused += f"; {w.interrupted} requests continued, {w.interrupted_tokens or 0:,} tokens to prefill again"
    return f"; its refresh {read}{paused}"


def _digest(version: PolicyVersion) -> str:
    """The version's fingerprint as status shows it (its digest and tensor count), or nothing when it has none;
    for a delta version, the version it applies to and its delta's key."""
    delta = f", a delta on version {version.base} ({version.delta})" if version.delta else ""
    return (f", fingerprint {version.digest} of {len(version.tensors or ())} tensors" if version.digest else "") + delta


def _samples_per_version(store: GenerationStore, done: np.ndarray) -> list[str]:
    """``samples per version: 0: n0, 1: n1 (k continued across a refresh)`` over the done prompts' samples."""
    if not store.has_array("policy_version") or not done.any():
        return []
    region = store.read_region(0, len(done), ("policy_version", "version_changed_at"))
    first, changed = region["policy_version"][done], region["version_changed_at"][done]
    values, counts = np.unique(first[first >= 0], return_counts=True)
    per = ", ".join(f"{v}: {c}" for v, c in zip(values.tolist(), counts.tolist(), strict=True))
    return [f"  samples per version (first token): {per} ({int((changed >= 0).sum())} continued across a refresh)"]


def _cursor_lines(store: GenerationStore, status: np.ndarray) -> list[str]:
    """One line per consumer cursor kept in the store (``daskgen follow``): what it acknowledged and how many
    finished prompts were committed after its position."""
    cursors = store.cursors()
    if not cursors:
        return []
    seq = store.read_region(0, len(status), ("commit_seq",))["commit_seq"] if store.has_array("commit_seq") else None
    finished, rows = status != PENDING, np.arange(len(status))
    lines = ["cursors:"]
    for name, state in cursors:
        line = f"  {name}: {state.prompts} prompts acknowledged ({state.failed} failed) in {state.batches} batches"
        if seq is not None:
            after = not_acknowledged(state, seq, rows)
            line += f", {int((finished & after).sum())} finished prompts after it"
        if state.order == "window":
            line += (
                f"; window of {state.window} prompts, head at prompt {state.head}, prompts held back by the head "
                f"{state.head_wait:.1f} s in total (longest before one batch {state.max_head_wait:.1f} s)"
            )
        if state.max_staleness is not None or state.stale or state.requeued:
            line += (
                f"; max staleness {state.max_staleness}: {state.stale} stale samples delivered flagged, "
                f"{state.requeued} prompts requeued for generation"
            )
        lines.append(line)
    return lines


def _checksum_summary(store: GenerationStore) -> str:
    """Whether the store's chunks carry checksums, and how to check or add them."""
    if store.checksummed:
        return "CRC32C on every chunk (`daskgen verify` checks them)"
    return "none (made before daskgen checksummed chunks; `daskgen pack` adds them)"


def _first_errors(store: GenerationStore, status: np.ndarray) -> list[str]:
    """Report lines with the errors of the first five failed prompts (none when nothing failed)."""
    failed = np.flatnonzero(status == FAILED)
    if not len(failed):
        return []
    errors = store.read_region(0, len(status), ("error",))["error"]
    return [f"failed prompts (first {min(5, len(failed))}):", *(f"  row {i}: {errors[i]}" for i in failed[:5])]


def print_answers(path: StoreRef, n: int) -> None:
    """Print the first ``n`` done prompts with their first sample, decoded with the model's tokenizer."""
    from daskgen.engines.tokenizer import load_tokenizer

    store = GenerationStore.open(path)
    identity = store.attrs.identity
    tok = load_tokenizer(identity.get("model", ""), identity.get("engine", ""), store.attrs.config.get("engine_args"))
    status = store.read_status()
    for i in np.flatnonzero(status == DONE)[:n]:
        data = store.read_region(int(i), int(i) + 1, ("prompt_ids", "prompt_length", "response_ids", "response_length"))
        prompt = data["prompt_ids"][0, : data["prompt_length"][0]].tolist()
        response = data["response_ids"][0, 0, : data["response_length"][0, 0]].tolist()
        print(f"--- prompt {i}: {tok.decode(prompt, skip_special_tokens=True).strip()[-200:]!r}")
        print(f"    answer: {tok.decode(response, skip_special_tokens=True).strip()[:400]!r}")
