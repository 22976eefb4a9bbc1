"""A resumed run reuses the input scan of an unchanged file; any change makes it scan again."""

from __future__ import annotations

import json
import os
import time

import pytest

from daskgen import store
from daskgen.client import plan as run_plan
from daskgen.config import RunConfig
from daskgen.errors import StoreMismatchError
from tests.conftest import write_prompts


def _config(tmp_path, prompts, **extra):
    return RunConfig(
        model="sim",
        engine="simulated",
        prompts=str(prompts),
        store=str(tmp_path / "s.zarr"),
        max_new_tokens=8,
        max_prompt_tokens=64,
        partition_size=4,
        **extra,
    )


@pytest.fixture
def scans(monkeypatch):
    """Count real scans of the input."""
    calls = []
    real = run_plan.scan_prompts

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(run_plan, "scan_prompts", counting)
    return calls


def test_unchanged_input_is_not_scanned_again(tmp_path, scans):
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    first = run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 1 and store.read_store_attrs(tmp_path / "s.zarr").input_scan["n_rows"] == 10
    second = run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 1  # reused
    assert (second.prompts.n_rows, second.prompts.fingerprint) == (first.prompts.n_rows, first.prompts.fingerprint)
    status = second.store.read_status()
    assert list(run_plan.pending_rows(second, status)) == list(run_plan.pending_rows(first, status))
    assert not [p.name for p in (tmp_path / "s.zarr").iterdir() if p.is_file() and p.name != "zarr.json"]


def test_a_changed_file_is_scanned_and_still_refused(tmp_path, scans):
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    run_plan.prepare(_config(tmp_path, prompts))
    text = prompts.read_text()
    prompts.write_text(text.replace("Question 3:", "Question 9:"))  # same size, other content
    os.utime(prompts, ns=(os.stat(prompts).st_atime_ns, os.stat(prompts).st_mtime_ns + 10**9))
    with pytest.raises(StoreMismatchError, match="fingerprint"):
        run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 2


def test_a_rewrite_that_restores_the_modification_time_is_still_seen(tmp_path, scans):
    """Same size, same mtime (``touch -r``/``rsync``-style restore): the change time differs."""
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    run_plan.prepare(_config(tmp_path, prompts))
    before = os.stat(prompts)
    time.sleep(0.01)
    prompts.write_text(prompts.read_text().replace("Question 3:", "Question 9:"))
    os.utime(prompts, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(StoreMismatchError, match="fingerprint"):
        run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 2


def test_a_touched_file_is_scanned_again_and_the_new_scan_kept_under_the_lock(tmp_path, scans):
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    run_plan.prepare(_config(tmp_path, prompts))
    os.utime(prompts)
    plan = run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 2 and plan.scan_record is not None
    run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 3  # not kept yet: only a run holding the lock writes the attrs
    plan.store.update_attrs(input_scan=plan.scan_record)  # what a run does with it under the lock
    run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 3


def test_other_scan_settings_or_in_memory_input_scan_again(tmp_path, scans):
    prompts = write_prompts(tmp_path / "p.jsonl", 10)
    run_plan.prepare(_config(tmp_path, prompts, skip_overlong=True))
    run_plan.prepare(_config(tmp_path, prompts))  # skip_overlong is part of the key
    assert len(scans) == 2
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    run_plan.prepare(_config(tmp_path, prompts), rows)
    run_plan.prepare(_config(tmp_path, prompts), rows)
    assert len(scans) == 4


def test_overlong_rows_survive_the_cache(tmp_path, scans):
    prompts = write_prompts(tmp_path / "p.jsonl", 6)
    with prompts.open("a") as fh:
        fh.write(json.dumps({"prompt": "word " * 200, "id": "long"}) + "\n")
    first = run_plan.prepare(_config(tmp_path, prompts, skip_overlong=True))
    second = run_plan.prepare(_config(tmp_path, prompts, skip_overlong=True))
    assert len(scans) == 1 and list(first.prompts.overlong) == [6]
    assert second.prompts.overlong == first.prompts.overlong


@pytest.mark.parametrize("kept", ["garbage", {"key": None}, "key-only"])
def test_a_kept_scan_of_another_format_means_a_rescan(tmp_path, scans, kept):
    prompts = write_prompts(tmp_path / "p.jsonl", 5)
    run_plan.prepare(_config(tmp_path, prompts))
    path = tmp_path / "s.zarr"
    if kept == "key-only":  # e.g. written by another version
        kept = {"key": store.read_store_attrs(path).input_scan["key"]}
    store.GenerationStore.open(path).update_attrs(input_scan=kept)
    run_plan.prepare(_config(tmp_path, prompts))
    assert len(scans) == 2
