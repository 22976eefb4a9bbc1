"""The distillation example a user runs: ``examples/distill.yaml`` through the CLI on the real SmolLM2 (each row's
own settings, a stop string, a JSON schema, thinking off, the kept ground truth, top-k logprobs), and the trainer
side, ``examples/follow_trainer.py``, on the store it made."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from daskgen.analysis.accessor import open_store
from daskgen.engines.base import FinishReason
from daskgen.engines.stops import EOS, NO_STOP
from tests.conftest import REPO, cli_env, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # one real SmolLM2 run through the CLI

EXAMPLES = REPO / "examples"
ROWS = [json.loads(line) for line in (EXAMPLES / "distill.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    """The example's config run as it is, but for one sample per row (the test's time) and its store path."""
    from daskgen.models import smollm2_instruct

    store = tmp_path_factory.mktemp("distill") / "distill.zarr"
    config, prompts = EXAMPLES / "distill.yaml", EXAMPLES / "distill.jsonl"
    args = ["--config", config, "--prompts", prompts, "--store", store, "--model", smollm2_instruct()]
    result = run_cli("run", *args, "--n-samples", "1", "--n-workers", "1", "--no-progress", timeout=540)
    assert result.returncode == 0, result.stdout + result.stderr
    return store


def test_the_distill_example_runs_each_row_with_its_own_settings(distilled):
    ds = open_store(distilled)
    attrs = ds.daskgen.attrs
    assert ds.daskgen.counts()["done"] == len(ROWS)
    assert attrs.tokenizer["chat_template_kwargs"] == {"enable_thinking": False}
    assert ds["column_answer"].values.tolist() == [r["answer"] for r in ROWS]
    settings = ds.daskgen.settings()
    assert settings["temperature"].tolist() == [r.get("sampling", {}).get("temperature", 0.7) for r in ROWS]
    tokenizer = ds.daskgen.tokenizer()
    for i, row in enumerate(ROWS):
        used = json.loads(str(ds["sampling"].values[i]))
        n, finish = int(ds.response_length[i, 0]), int(ds.finish_reason[i, 0])
        assert n <= used["max_new_tokens"] == row.get("sampling", {}).get("max_new_tokens", 48), row["id"]
        text = tokenizer.decode(ds.response_ids.values[i, 0, :n], skip_special_tokens=True)
        reason = int(ds.stop_reason[i, 0])
        if reason >= 0:  # a stop string ended it: the response ends with that string (kept in the response)
            assert text.endswith(used["stop"][reason]) and finish == FinishReason.STOP, (row["id"], text)
        else:
            assert reason == (EOS if finish == FinishReason.STOP else NO_STOP), row["id"]
        if "response_format" in row and finish == FinishReason.STOP:
            jsonschema.validate(json.loads(text), row["response_format"]["json_schema"])


def test_the_distill_example_stores_the_teachers_top_k(distilled):
    ds = open_store(distilled)
    k = ds.sizes["top_rank"]
    assert k == 5
    n = int(ds.response_length[0, 0])
    values = ds.top_logprobs.values[0, 0, :n]
    assert (np.diff(values, axis=-1) <= 0).all() and np.isfinite(values).all()  # most likely first
    sampled = ds.response_ids.values[0, 0, :n]  # the greedy row: its token is the most likely one
    assert (ds.top_logprob_ids.values[0, 0, :n, 0] == sampled).all()


def test_the_trainer_example_takes_every_sample_once_with_its_ground_truth(distilled):
    command = [sys.executable, str(EXAMPLES / "follow_trainer.py"), str(distilled), "--no-wait"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=240, env=cli_env())
    assert first.returncode == 0, first.stdout + first.stderr
    shown = {line.split(" #")[0]: line for line in first.stdout.splitlines() if " #0  answer=" in line}
    assert len(shown) == 4, first.stdout  # the first batch: the first 4 prompts committed
    for row in (r for r in ROWS if r["id"] in shown):  # each with its ground truth and its own settings
        temperature = row.get("sampling", {}).get("temperature", 0.7)
        assert f"answer={row['answer']!r}" in shown[row["id"]] and f"'temperature': {temperature}" in shown[row["id"]]
    assert "top-5 token ids at the first response position" in first.stdout
    assert f"{len(ROWS)} samples taken" in first.stdout and "batch 1: 1 prompts, 1 samples" in first.stdout
    again = subprocess.run(command, capture_output=True, text=True, timeout=240, env=cli_env())
    assert again.returncode == 0 and "0 samples taken" in again.stdout, again.stdout + again.stderr


@pytest.mark.timeout(300)
def test_the_vision_example_runs_and_stores_each_image_once(tmp_path):
    """``examples/vision.yaml`` as its header says (the tiny Qwen2-VL; 8 new tokens for the test's time), then
    ``verify --deep``: every row done,
    three distinct images stored once though rows share them, two samples per row."""
    from daskgen.models import build_tiny_vl_model
    from daskgen.store.generation_store import GenerationStore
    from daskgen.store.images import stored_hashes

    store = tmp_path / "vision.zarr"
    config, prompts = EXAMPLES / "vision.yaml", EXAMPLES / "vision.jsonl"
    args = ["--config", config, "--prompts", prompts, "--store", store, "--model", build_tiny_vl_model()]
    result = run_cli("run", *args, "--n-workers", "1", "--max-new-tokens", "8", "--no-progress", timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    ds = open_store(store)
    assert ds.daskgen.counts()["done"] == 4 and ds.sizes["sample"] == 2
    assert len(stored_hashes(GenerationStore.open(store).location)) == 3
    result = run_cli("verify", store, "--deep", "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
