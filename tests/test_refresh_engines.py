"""Policy refresh in a real run on every lane engine that declares it: vLLM, in-process sglang, the managed sglang
server (the ``openai`` engine with ``managed=true``).

One ``daskgen run --refresh continue`` per engine, greedy, on a
LocalCluster of one worker, with the probe engine (:mod:`daskgen.testing.probes`) around the engine under test:
row 0 generates on the run's model (version 0); row 1 gets :data:`PAUSE` tokens from the engine and waits part-way
at a gate while a checkpoint with other weights (version 1) is published; the refresh aborts it, loads version 1,
and row 1 goes on from its tokens on the new weights; row 2 generates on version 1.

Each sample is checked against its recorded versions' checkpoints with one forward pass (transformers, float32):
every token is the most likely one (end-of-sequence excluded: ``--min-new-tokens`` is the budget), a continued
sample's tokens before ``version_changed_at`` under the old checkpoint and from there under the new one; and a
sample of version 1 is not the old checkpoint's answer; and each sample's fingerprints are version 1's published
digest where its version is 1 (the worker checked the engine's loaded tensors against it), 0 for version 0.
Every prompt begins with the same text of more than one
KV-cache block (vLLM's CPU block is 128 tokens, sglang's page one token), so a prefix cache that kept what the old
weights computed would give the later rows (and the continued one) the old checkpoint's keys and values.

Each run is also a start and stop of its engine on a real worker: the files the engine makes while it runs
(sglang's load-report file in the shared-memory folder, vLLM's rendezvous file and ZeroMQ sockets in the folder
daskgen gives its processes) are seen during the run and are all gone after it (:mod:`daskgen.engines.leftovers`).
Each lane runs its tests one at a time, so no other engine adds such files meanwhile.

Why ``continue`` and not ``drain``: the two policies differ in the worker (:mod:`daskgen.worker.refresh`), not in
the engine.  Under either the engine loads a version with no request in flight; ``continue`` also aborts requests
part-way and continues them on the new weights, so its engine calls are ``drain``'s and more.  ``drain`` is run end
to end on transformers in the main lane (``tests/test_policy_refresh.py``, ``tests/test_rl_loop.py``).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from importlib.util import find_spec
from pathlib import Path

import numpy as np
import pytest

import daskgen
from daskgen import store
from daskgen.engines.leftovers import SGLANG_LOADS, SHARED_MEMORY
from daskgen.store.fingerprint import digest_number
from daskgen.store.policy import read_versions, read_worker_policies
from daskgen.testing.probes import read_events, row_of
from tests.conftest import popen_cli
from tests.probing import gate_args, wait_until

HELD = 1  # the row held while the refresh is asked for
PAUSE = 4  # continue: the tokens the held row gets on the old weights before it waits
NEW_TOKENS = 8
ROWS = 3
#: More than one vLLM CPU cache block (128 tokens) of text shared by every prompt.
SHARED = " ".join(f"w{j}" for j in range(60))

_SGLANG = [pytest.mark.sglang, pytest.mark.skipif(find_spec("sglang") is None, reason="needs sglang (its lane)")]
_VLLM = [pytest.mark.vllm, pytest.mark.skipif(find_spec("vllm") is None, reason="needs vllm (its lane)")]
#: case -> (lane marks and the engine whose refresh it proves, engine args of the engine under test)
ENGINES = {
    "vllm": ([*_VLLM, pytest.mark.proves("vllm", "refresh")], ["inner=vllm", "dtype=float32", "max_model_len=1024"]),
    "sglang": ([*_SGLANG, pytest.mark.proves("sglang", "refresh")], ["inner=sglang"]),
    "sglang-server": (
        [*_SGLANG, pytest.mark.proves("openai", "refresh")],  # a managed server (engine arg managed=true)
        ["inner=openai", "managed=true", "server_start_timeout_s=600"],
    ),
}
CASES = [
    pytest.param(engine, marks=[*ENGINES[engine][0], pytest.mark.timeout(900)], id=f"{engine}-continue")
    for engine in ENGINES
]


#: What vLLM's processes make in the temporary folder: the folder daskgen gives them, and (should one be made
#: outside it) the rendezvous file and ZeroMQ sockets named by a uuid.
VLLM_NAMES = re.compile(
    r"vllm_dist_[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|daskgen-vllm-tmp-.*"
)


def engine_files(engine: str) -> set[str]:
    """The files of the kind ``engine`` leaves when it does not clean up: sglang's in the shared-memory folder,
    vLLM's in the temporary folder."""
    if engine == "vllm":
        return {name for name in os.listdir(tempfile.gettempdir()) if VLLM_NAMES.fullmatch(name)}
    return {name for name in os.listdir(SHARED_MEMORY) if name.startswith(SGLANG_LOADS)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[int, Path]:
    """Version 0 (the run's model) and version 1 (other seeded weights): the tiny Llama with 32-wide heads (vLLM's
    CPU kernels need them)."""
    from daskgen.models import build_tiny_model

    folder = tmp_path_factory.mktemp("refresh-policies")
    return {v: build_tiny_model(folder / f"v{v}", seed=v, head_dim=32) for v in (0, 1)}


def workers_running(out: Path, version: int):
    """The workers whose recorded policy state is running ``version``."""
    return [w for w in read_worker_policies(store.locate(out)) if w.state == "running" and w.version == version]


def event_of(events: Path, kind: str, row: int) -> bool:
    return any(e.kind == kind and row_of(e.request_id) == row for e in read_events(events))


@pytest.mark.parametrize("engine", CASES)
def test_a_run_refreshes_mid_run_and_every_sample_is_its_versions_greedy_answer(
    engine: str, checkpoints: dict[int, Path], tmp_path: Path
) -> None:
    out, events, gate = tmp_path / "out.zarr", tmp_path / "events.log", tmp_path / "gate"
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{SHARED} q{i}", "id": f"q{i}"}) + "\n" for i in range(ROWS)))
    inner = [x for arg in ENGINES[engine][1] for x in ("--engine-arg", arg)]
    paused = ["--engine-arg", f"pause_after={PAUSE}", "--engine-arg", f"pause_rows={[HELD]}"]
    before = engine_files(engine)
    proc = popen_cli(
        *("run", "--prompts", prompts, "--store", out, "--model", checkpoints[0], "--refresh", "continue"),
        *("--engine", "daskgen.testing.probes:ProbeEngine", *inner, "--engine-arg", f"events_path={events}"),
        *gate_args(gate, [HELD]), *paused,
        *("--temperature", "0", "--max-new-tokens", str(NEW_TOKENS), "--min-new-tokens", str(NEW_TOKENS)),
        *("--max-prompt-tokens", "512", "--partition-size", "1", "--window", "1", "--n-workers", "1"),
        "--no-progress",
        env={"DASK_DASKGEN__POLICY__POLL_INTERVAL": "0.1s"},
    )  # fmt: skip
    try:
        wait_until(lambda: event_of(events, "pause", HELD), proc, "row 1", 600)  # its first tokens, then it waits
        assert engine_files(engine) - before, f"{engine} made none of its files while it ran (the check below is void)"
        if engine == "vllm":
            check_compiler_cache_is_shared(engine_files(engine) - before)
        daskgen.publish_policy(out, str(checkpoints[1]), 1)
        # the held row was aborted with its tokens; it waits at its gate again until the load is done
        wait_until(lambda: workers_running(out, 1), proc, "the load", 600)
        gate.touch()
        assert proc.wait(timeout=600) == 0, proc.stdout.read()[-6000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    check_samples(out, checkpoints)
    # a worker the nanny killed while its engine shut down leaves vLLM's folder to a watcher that removes it once the
    # worker process has exited: wait for that, within a bound
    deadline = time.monotonic() + 60
    while (left := engine_files(engine) - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"{engine} left files behind: {left}"


def check_compiler_cache_is_shared(names: set[str]) -> None:
    """The temporary folder daskgen gave vLLM's processes links torch's compiler cache of the machine (where torch
    keeps its precompiled headers), so no engine start compiles them again."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    shared = Path(default_cache_dir())
    folders = [Path(tempfile.gettempdir()) / name for name in names if name.startswith("daskgen-vllm-tmp-")]
    assert folders, names
    for folder in folders:
        link = folder / shared.name
        assert link.is_symlink() and link.resolve() == shared.resolve(), (link, shared)


def check_samples(out: Path, checkpoints: dict[int, Path]) -> None:
    """Versions as the scenario made them; each sample its versions' greedy answer (see the module doc)."""
    made = store.GenerationStore.open(out)
    got = made.read_region(0, ROWS, made.layout.data_arrays())
    first, last, changed = (
        got[k][:, 0].tolist() for k in ("policy_version", "policy_version_end", "version_changed_at")
    )
    assert first == [0, 0, 1] and last == [0, 1, 1], (first, last)
    assert changed == [-1, PAUSE, -1], changed
    digest = digest_number(read_versions(made.location)[0].digest)  # version 1's, checked on the engine's tensors
    for name, versions in (("policy_fingerprint", first), ("policy_fingerprint_end", last)):
        assert got[name][:, 0].tolist() == [digest if v == 1 else 0 for v in versions], (name, got[name])
    assert (got["response_length"][:, 0] == NEW_TOKENS).all(), got["response_length"]
    for r in range(ROWS):
        prompt = got["prompt_ids"][r, : got["prompt_length"][r]].tolist()
        assert len(prompt) > 128, len(prompt)  # more than one cache block of the engines here
        response = got["response_ids"][r, 0, :NEW_TOKENS].tolist()
        # each position's version: the first one's up to version_changed_at, the last one's from there on
        version = np.where(np.arange(NEW_TOKENS) < (changed[r] if changed[r] >= 0 else NEW_TOKENS), first[r], last[r])
        greedy = {v: greedy_positions(checkpoints[v], prompt, response) for v in (0, 1)}
        for v in (0, 1):
            assert greedy[v][version == v].all(), (r, v, version, greedy[v])
        if (version == 1).any():  # the old weights would have answered otherwise
            assert not greedy[0][version == 1].all(), (r, response, greedy[0])


def greedy_positions(model: Path, prompt: list[int], response: list[int]) -> np.ndarray:
    """Per response token: whether it is the checkpoint's most likely token after what precedes it (one forward
    pass in float32, end-of-sequence excluded, up to float noise between kernels)."""
    import torch
    from transformers import AutoModelForCausalLM

    checkpoint = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        logits = checkpoint(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1)
    eos = checkpoint.generation_config.eos_token_id
    logprobs[:, [eos] if isinstance(eos, int) else list(eos)] = -float("inf")
    chosen = logprobs.gather(1, torch.tensor(response)[:, None])[:, 0]
    return (chosen >= logprobs.max(-1).values - 2e-3).numpy()
