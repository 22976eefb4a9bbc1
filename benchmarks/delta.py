"""Delta policy versions: the share of bfloat16 values a real Adam step leaves unchanged, and a delta's bytes.

For each model (``--models``: the tiny test model, SmolLM2-135M-Instruct) and learning rate (``--lrs``), the
model is loaded in float32 (the trainer's master weights) and trained with ``torch.optim.Adam`` for ``--steps``
steps, each on a causal-LM loss over ``--batch`` of the builtin prompts (chat template, at most ``--seq``
tokens).  Before the first step and after every step the weights are saved in bfloat16 (``save_pretrained`` of a
bfloat16 copy: what an engine serves) and published to a store: the first save in full, each later one with
``daskgen.publish_policy(..., delta=True)``, a delta on the save before it.  Per step the record gives the share
of bfloat16 values the step left unchanged (from the delta's per-tensor counts of changed values), the delta's
bytes against the full version's safetensors bytes, the time to publish it (make, compress, write), and the
time to rebuild the newest version from the full one plus every delta in a fresh node-local cache
(``daskgen.store.policy_cache.checkpoint_for``), whose fingerprint is checked against the published one.

    python benchmarks/delta.py                                    # tiny model and SmolLM2, lr 1e-6 and 1e-5
    python benchmarks/delta.py --models tiny --steps 2 --no-record
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from common import cli, records
from common.prompts import builtin_prompts

TITLE = "Delta policy versions: bf16 values unchanged after Adam steps, delta bytes vs a full version"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--models", default="tiny,smollm2", help="comma-separated: tiny, smollm2")
    p.add_argument("--lrs", default="1e-6,1e-5", help="comma-separated Adam learning rates")
    p.add_argument("--steps", type=int, default=3, help="Adam steps (each published as a delta version)")
    p.add_argument("--batch", type=int, default=4, help="prompts per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per prompt at most")
    return cli.parse(p, argv)


def model_folder(name: str, work: Path) -> str:
    """The folder of model ``name`` (the tiny model is built in ``work``)."""
    from daskgen.models import build_tiny_model, smollm2_instruct

    return str(build_tiny_model(work / "tiny", seed=0)) if name == "tiny" else str(smollm2_instruct())


def batch(tokenizer: Any, n: int, seq: int) -> dict[str, Any]:
    """``n`` builtin prompts, chat-templated and tokenized (padded, at most ``seq`` tokens), as LM inputs."""
    texts = [
        tokenizer.apply_chat_template(row["messages"], tokenize=False) if tokenizer.chat_template else str(row)
        for row in builtin_prompts(n)
    ]
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=seq)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {**enc, "labels": labels}


def save_bf16(model: Any, folder: Path) -> int:
    """Save ``model`` in bfloat16 to ``folder`` (its float32 weights untouched); the safetensors bytes."""
    import copy

    import torch

    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(folder)
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def one_run(a: argparse.Namespace, work: Path, name: str, lr: float) -> list[list[Any]]:
    """Train model ``name`` at ``lr``, publish every step; one table row per delta version."""
    import dask.config
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import daskgen
    from daskgen import store
    from daskgen.store.delta_codec import unpack
    from daskgen.store.fingerprint import checkpoint_fingerprint
    from daskgen.store.policy import read_versions
    from daskgen.store.policy_cache import checkpoint_for

    torch.manual_seed(0)
    folder, root = model_folder(name, work), work / f"{name}-{lr:g}"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    inputs = batch(AutoTokenizer.from_pretrained(folder), a.batch, a.seq)
    out = root / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(store.Layout(1, 1, 4, 4, 1, 0)), ["q0"])
    location = store.locate(out)
    full = save_bf16(model, root / "v1")
    daskgen.publish_policy(out, str(root / "v1"), 1)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    rows = []
    for step in range(1, a.steps + 1):
        optimizer.zero_grad()
        model(**inputs).loss.backward()
        optimizer.step()
        save_bf16(model, root / f"v{step + 1}")
        started = time.perf_counter()
        entry = daskgen.publish_policy(out, str(root / f"v{step + 1}"), step + 1, delta=True)
        publish_s = time.perf_counter() - started
        raw = location.read_bytes(entry.delta or "") or b""
        tensors = unpack(raw).tensors.values()
        values = sum(int(torch.Size(t.shape).numel()) for t in tensors)
        changed = sum(t.changed for t in tensors)
        kinds = {k: sum(t.kind == k for t in tensors) for k in ("same", "sparse", "dense")}
        with dask.config.set({"daskgen.policy.cache-dir": str(root / f"cache-{step}")}):
            started = time.perf_counter()
            rebuilt = checkpoint_for(location, read_versions(location)[-1])
            rebuild_s = time.perf_counter() - started
        found = checkpoint_fingerprint(rebuilt.path)
        same = found is not None and found.digest == entry.digest
        rows.append(
            [name, f"{lr:g}", step, 1 - changed / values, len(raw), full, len(raw) / full,
             "/".join(str(kinds[k]) for k in ("same", "sparse", "dense")), publish_s, rebuild_s, same]
        )  # fmt: skip
    return rows


def part_delta(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Every model × learning rate, one row per step."""
    rows = []
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        for lr in [float(x) for x in a.lrs.split(",") if x.strip()]:
            rows += one_run(a, work, name, lr)
    rec.table(
        ["model", "lr", "step", "bf16 values unchanged", "delta bytes", "full bytes", "delta / full",
         "tensors same/sparse/dense", "publish s", "rebuild s (full + every delta)", "rebuilt = published"],
        rows,
        f"Adam, {a.steps} steps of {a.batch} prompts (at most {a.seq} tokens), float32 master weights saved in "
        "bfloat16 after each; version 1 is the weights before the first step, published in full; each step's "
        "version is a delta on the one before. The rebuild starts from version 1 in an empty cache.",
    )  # fmt: skip


PARTS = {"delta": part_delta}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
