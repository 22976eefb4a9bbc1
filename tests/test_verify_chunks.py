"""``daskgen verify`` finds a deleted chunk of every worker-written array in a finished partition.

The arrays come from the layout with every optional array on (:func:`daskgen.store.layout.every_array_layout`,
one kept column ``answer``), so an array added to the layout is covered here without a change: every array but
the trajectory axis's is checked on a store written by a real run (the simulated engine taking structured
outputs and LoRA adapters, ``--logprobs``, ``--top-logprobs``, stop ids, per-row settings, a verifier, a kept
column); the trajectory axis's on a store written through the store API.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest

from daskgen import store
from daskgen.engines.base import GenerationRequest, GenerationResult
from daskgen.engines.simulated import SimulatedEngine
from daskgen.store.images import image_hash, write_blob
from daskgen.store.layout import empty_region, every_array_layout
from daskgen.store.tools.expected_chunks import UNDERIVABLE
from daskgen.store.tools.verify import chunk_key, verify
from tests.conftest import run_cli, simulated_run, write_prompts

pytestmark = pytest.mark.timeout(300)

#: Every array a store can have, with the kept column of :data:`RUN`.
ARRAYS = every_array_layout(columns=("answer",)).data_arrays()


class FormatsAndAdapters(SimulatedEngine):
    """Test double: the simulated engine taking structured outputs and LoRA adapters (its outputs the same with
    either or without), so that its stores hold ``response_format`` and ``adapter``."""

    features = SimulatedEngine.features | {"structured_outputs", "lora"}

    def __init__(self, model: str = "simulated", adapters: dict[str, str] | None = None, **engine_args) -> None:
        super().__init__(model, **engine_args)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        params = dataclasses.replace(request.params, adapter=None, response_format=None)
        return await super().generate(dataclasses.replace(request, params=params))


#: 12 prompts in 3 partitions of 4 (each row with its own sampling settings), logprobs and top-2 logprobs
#: recorded, stop token ids (so ``stop_reason`` is stored), outputs of about 12 of the 16 tokens (most end at
#: the end-of-sequence token), every response scored, a run-level response format, the column ``answer`` kept and
#: the adapters the input rows name (the adapter folder is added by :func:`_run`).
RUN = [
    *("tests.test_verify_chunks:FormatsAndAdapters" if arg == "simulated" else arg for arg in simulated_run()),
    *("--logprobs", "--top-logprobs", "2", "--stop-token-ids", "7", "--engine-arg", "length_mean=12"),
    *("--verifier", "tests.verifiers:even_first_token"),
    *("--response-format", '{"choice": ["yes", "no"]}', "--keep-columns", "answer"),
]
#: The partition whose chunks are deleted.
ROWS = list(range(4, 8))


def _row(i: int) -> dict:
    """Row ``i``'s own columns: its sampling settings; its answer (a number, text, or empty in the last partition
    and row 6); the adapter ``math`` for row 5 alone."""
    answer = "" if i >= 8 or i == 6 else (i if i % 2 else f"answer {i}")
    return {"sampling": {"top_k": 50}, "answer": answer, **({"adapter": "math"} if i == 5 else {})}


def _run(prompts, out):
    adapter = prompts.parent / "lora-math"
    adapter.mkdir(exist_ok=True)
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    res = run_cli("run", "--prompts", prompts, "--store", out, *RUN, "--adapter-path", f"math={adapter}")
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.fixture(scope="module")
def run_store(tmp_path_factory):
    """A finished store of a real run, and its prompts (copied per test)."""
    base = tmp_path_factory.mktemp("run")
    prompts = write_prompts(base / "p.jsonl", 12)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    prompts.write_text("".join(json.dumps({**row, **_row(i)}) + "\n" for i, row in enumerate(rows)))
    _run(prompts, base / "out.zarr")
    return base


@pytest.fixture(scope="module")
def trajectory_store(tmp_path_factory):
    """A finished store with a trajectory axis (two per sample; the second used by sample 0 only), each prompt
    holding one image and each trajectory one image a tool returned (between its two model tokens)."""
    out = tmp_path_factory.mktemp("traj") / "out.zarr"
    layout = store.Layout(12, 2, 6, 5, 4, 0, n_trajectories=2, max_images=1, tool_images=1)
    image = {"image_token_id": 6, "image_processor": {"settings": {"merge_size": 2}}, "images": "one"}
    attrs = store.StoreAttrs(layout, input=image, config={"agent": "tool"})  # tool tokens in its responses
    made = store.GenerationStore.create(out, attrs, [f"q{i}" for i in range(12)])
    region = empty_region(layout, 12)
    region["prompt_ids"][:, :3], region["prompt_length"][:] = [5, 6, 7], 3  # 6: one image of one token
    digest = image_hash(b"an image")
    write_blob(made.location, digest, b"an image")
    region["image_hash"][:, 0], region["image_modality"][:, 0] = digest, "image"
    region["image_offset"][:, 0], region["image_length"][:, 0], region["image_grid"][:, 0] = 1, 1, (1, 2, 2)
    region["num_trajectories"][:] = [2, 1]
    for t in (0, 1):
        region["response_ids"][:, : 2 - t, t, :3] = [8, 6, 9]  # 6: the tool's image, one token
        region["response_length"][:, : 2 - t, t] = 3
        region["response_mask"][:, : 2 - t, t, :3] = [1, 0, 1]
        region["tool_image_hash"][:, : 2 - t, t, 0] = digest
        region["tool_image_modality"][:, : 2 - t, t, 0] = "image"
        region["tool_image_offset"][:, : 2 - t, t, 0], region["tool_image_length"][:, : 2 - t, t, 0] = 1, 1
        region["tool_image_grid"][:, : 2 - t, t, 0] = (1, 2, 2)
        region["finish_reason"][:, : 2 - t, t] = 0
        region["num_turns"][:, : 2 - t, t] = 1
        region["policy_version"][:, : 2 - t, t] = region["policy_version_end"][:, : 2 - t, t] = 0
    made.write_region(0, region)
    made.commit(0, np.full(12, store.DONE, dtype="int8"), [""] * 12)
    return out


def _store_for(name, run_store, trajectory_store, tmp_path):
    """A copy of the store whose layout has ``name``, and its prompts file (None for the trajectory store)."""
    run_layout = store.GenerationStore.open(run_store / "out.zarr").layout
    if name in run_layout.data_arrays():
        shutil.copytree(run_store, tmp_path, dirs_exist_ok=True)
        return tmp_path / "out.zarr", tmp_path / "p.jsonl"
    shutil.copytree(trajectory_store, tmp_path / "out.zarr")
    return tmp_path / "out.zarr", None


def _chunk_file(out, name):
    """The key and file of ``name``'s (first) chunk of the partition holding :data:`ROWS`."""
    key = chunk_key(store.GenerationStore.open(out), name, ROWS[0])
    return key, out / key


def test_the_stores_are_sound_and_cover_every_worker_array(run_store, trajectory_store):
    names = set()
    for out in (run_store / "out.zarr", trajectory_store):
        report = verify(out, progress=False)
        assert report.sound, report.lines()
        names |= set(store.GenerationStore.open(out).layout.data_arrays())
    assert names == set(ARRAYS)


def test_partitions_whose_text_arrays_hold_only_empty_strings_have_no_chunk_and_are_sound(run_store):
    out = run_store / "out.zarr"
    opened = store.GenerationStore.open(out)
    assert not (out / chunk_key(opened, "adapter", 0)).exists(), "rows 0..3 use the base model"
    assert not (out / chunk_key(opened, "column_answer", 8)).exists(), "rows 8..11 answer ''"
    assert (out / chunk_key(opened, "response_format", 8)).is_file(), "every row has the run's format"
    report = verify(out, progress=False)
    assert report.sound and not report.notes, report.lines()


@pytest.mark.parametrize("name", ARRAYS)
def test_a_deleted_chunk_of_every_array_is_named(name, run_store, trajectory_store, tmp_path):
    out, _ = _store_for(name, run_store, trajectory_store, tmp_path)
    key, path = _chunk_file(out, name)
    if name in UNDERIVABLE:  # all fill values in a run that was never interrupted: no chunk to lose
        assert UNDERIVABLE[name], "the reason no value shows the chunk is needed is recorded"
        assert not path.exists() and verify(out, progress=False).sound
        return
    assert path.is_file(), key
    path.unlink()
    report = verify(out, progress=False)
    missing = [(p.array, p.chunk, p.start, p.stop) for p in report.problems if p.kind == "missing chunk"]
    assert missing == [(name, key, ROWS[0], ROWS[-1] + 1)], report.lines()
    assert report.rows() == ROWS, report.lines()
    assert {p.array for p in report.problems} <= {name, "rows"}, report.lines()
    line = f"missing chunk: {name} chunk {key}, rows 4..7 (id 'q4', 'q5', 'q6', ...)"
    assert any(text.startswith(line) for text in report.lines()), report.lines()


def test_a_deleted_logprobs_chunk_is_repaired_and_regenerated(run_store, tmp_path):
    out, prompts = _store_for("logprobs", run_store, None, tmp_path)
    before = store.GenerationStore.open(out)
    values = before.read_region(0, 12, before.layout.data_arrays())
    key, path = _chunk_file(out, "logprobs")
    path.unlink()
    res = run_cli("verify", out, "--no-progress")
    assert res.returncode == 1 and f"missing chunk: logprobs chunk {key}, rows 4..7" in res.stdout, res.stdout
    res = run_cli("verify", out, "--repair", "--no-progress")
    assert res.returncode == 1 and "repaired: 1 partition(s)" in res.stdout, res.stdout
    status = store.GenerationStore.open(out).read_status()
    assert (status[4:8] == store.PENDING).all() and (np.delete(status, ROWS) == store.DONE).all()
    _run(prompts, out)
    after = store.GenerationStore.open(out)
    assert path.is_file() and (after.read_status() == store.DONE).all()
    for name, regenerated in after.read_region(0, 12, after.layout.data_arrays()).items():
        np.testing.assert_array_equal(regenerated, values[name], err_msg=name)  # seeded: the same again
    assert verify(out, progress=False).sound


def test_a_lost_kept_column_or_row_adapter_chunk_goes_unchecked_with_a_note_once_the_input_changed(run_store, tmp_path):
    out, prompts = _store_for("column_answer", run_store, None, tmp_path)
    prompts.write_text(prompts.read_text().replace('"answer 4"', '"answer four"'))
    opened = store.GenerationStore.open(out)
    opened.update_attrs(config={**opened.attrs.config, "prompts": str(prompts)})
    for name in ("column_answer", "adapter", "response_format"):
        _chunk_file(out, name)[1].unlink()
    report = verify(out, progress=False)
    assert [p.array for p in report.problems] == ["response_format"], "the run's format needs no input"
    assert report.notes == [
        f"adapter, column_answer not checked for lost chunks: the run's input file {str(prompts)!r} is gone or no "
        "longer holds the store's input (its fingerprint); restore it to check them"
    ]
    assert f"note: {report.notes[0]}" in report.lines()
