"""Human-readable views of a store: status report and decoded answers."""

from __future__ import annotations

import json

import numpy as np

from daskgen.store import generation_store as store


def status_report(path: store.Where) -> str:
    """Counts, tokens generated and settings of a store, as text."""
    attrs = store.read_attrs(path)
    if attrs is None:
        from daskgen.errors import StoreError

        raise StoreError(f"{path!r} is not a daskgen store; pass the --store path of a daskgen run.")
    status = store.read_status(path)
    done = status == store.DONE
    lengths = store.read_region(path, 0, len(status), ("response_length",))["response_length"]
    tokens = int(lengths[done].sum())
    lines = [
        f"store:    {path}",
        f"prompts:  {len(status)}  done {int(done.sum())}  pending {int((status == store.PENDING).sum())}  "
        f"failed {int((status == store.FAILED).sum())}",
        f"tokens generated (done prompts): {tokens}",
        f"created:  {attrs.get('created')}" + ("  [SIMULATED: not model output]" * bool(attrs.get("simulated"))),
        "settings: " + json.dumps(attrs.get("identity", {}), sort_keys=True),
        "input:    " + json.dumps(attrs.get("input", {}), sort_keys=True),
    ]
    failed = np.flatnonzero(status == store.FAILED)
    if len(failed):
        errors = store.read_region(path, 0, len(status), ("error",))["error"]
        lines.append(f"failed prompts (first {min(5, len(failed))}):")
        lines += [f"  row {i}: {errors[i]}" for i in failed[:5]]
    return "\n".join(lines)


def print_answers(path: store.Where, n: int) -> None:
    """Print the first ``n`` done prompts with their first sample, decoded with the model's tokenizer."""
    from daskgen.input.tokenizer import load_tokenizer

    attrs = store.read_attrs(path) or {}
    identity = attrs.get("identity", {})
    tok = load_tokenizer(
        identity.get("model", ""), identity.get("engine", ""), attrs.get("config", {}).get("engine_args")
    )
    status = store.read_status(path)
    for i in np.flatnonzero(status == store.DONE)[:n]:
        data = store.read_region(
            path, int(i), int(i) + 1, ("prompt_ids", "prompt_length", "response_ids", "response_length")
        )
        prompt = data["prompt_ids"][0, : data["prompt_length"][0]].tolist()
        response = data["response_ids"][0, 0, : data["response_length"][0, 0]].tolist()
        print(f"--- prompt {i}: {tok.decode(prompt, skip_special_tokens=True).strip()[-200:]!r}")
        print(f"    answer: {tok.decode(response, skip_special_tokens=True).strip()[:400]!r}")
