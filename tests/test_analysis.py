"""The ``ds.daskgen`` accessor: selections, statistics and decoding, on stores built with the real store API.

``build_store`` writes a store the way a run does (``store.create``, ``write_region`` per partition,
``commit``) with known content: byte-tokenizer text (so decoding is checkable), tool tokens
(``response_mask`` 0 inside a response), logprobs, stop/length/error finish reasons, one failed
row, a sample that was never generated (finish reason -1, as a verifier run leaves unneeded
samples) and a pending partition whose data landed but was never committed (a run still writing).
The export and report tests reuse it.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import xarray as xr

from daskgen import store
from daskgen.analysis.accessor import open_store
from daskgen.engines.base import FinishReason
from daskgen.errors import StoreError, StoreMismatchError
from daskgen.input.rows import fingerprint, tokenize_rows
from daskgen.input.tokenizer import ByteTokenizer, tokenizer_identity
from daskgen.store.layout import VERSION_ARRAYS

T0 = 1_760_000_000.0  # commit time of the first partition (seconds since 1970)
GAP = 90.0  # seconds between partition commits


@dataclass
class Truth:
    """A store built by :func:`build_store` and what was written into it."""

    path: Path
    input_path: Path
    arrays: dict[str, np.ndarray]
    status: np.ndarray
    committed_at: np.ndarray
    prompt_texts: list[str]
    response_texts: dict[tuple[int, ...], str] = field(default_factory=dict)

    def units(self) -> list[tuple[int, ...]]:
        """(prompt, sample[, trajectory]) keys of done rows, in export order."""
        return [k for k in self.response_texts if self.status[k[0]] == store.DONE]


def _response(i: int, s: int, t: int, max_new: int, rng: np.random.Generator, tok: ByteTokenizer):
    """Token ids, finish reason and text of one generated response."""
    if (i, s, t) == (1, 0, 0):
        return [], FinishReason.ERROR, ""
    text = f"r{i}-{s}-{t}:" + "ab" * int(rng.integers(0, 8))
    ids = tok(text)["input_ids"][1:]
    if len(ids) + 1 <= max_new:
        return ids + [tok.eos_token_id], FinishReason.STOP, text
    return ids[:max_new], FinishReason.LENGTH, tok.decode(ids[:max_new])


def build_store(
    tmp_path: Path,
    *,
    n: int = 10,
    samples: int = 3,
    partition: int = 4,
    max_new: int = 12,
    trajectories: int = 1,
    logprobs: bool = True,
    name: str = "s.zarr",
    done: dict[int, int] | None = None,
) -> Truth:
    """A store with known content; ``done`` maps partition start -> status written (default: 2 partitions)."""
    tok, rng = ByteTokenizer(), np.random.default_rng(0)
    rows = [{"messages": [{"role": "user", "content": f"prompt {i}"}], "id": f"q{i}"} for i in range(n)]
    input_path = tmp_path / f"{name}.prompts.jsonl"
    input_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    layout = store.Layout(n, samples, 64, max_new, partition, tok.pad_token_id, n_trajectories=trajectories)
    attrs = {
        "identity": {
            "model": "sim",
            "engine": "simulated",
            "n_samples": samples,
            "max_new_tokens": max_new,
            "logprobs": logprobs,
            "temperature": 1.0,
            "partition_size": partition,
        },
        "input": {"fingerprint": fingerprint(rows), "n_prompts": n},
        "tokenizer": tokenizer_identity(tok),
        "config": {"prompts": str(input_path), "engine_args": {}, "agent": "tool"},  # tool tokens in responses
        "simulated": True,
    }
    path = tmp_path / name
    store.GenerationStore.create(path, store.StoreAttrs(layout, **attrs), [r["id"] for r in rows])
    truth = Truth(path, input_path, {}, np.zeros(n, dtype=np.int8), np.full(n, np.nan), [])
    prompt_ids = tokenize_rows(rows, tok)
    truth.prompt_texts = [tok.decode(ids) for ids in prompt_ids]
    arrays = _arrays(layout, prompt_ids, truth, rng, tok)
    truth.arrays = arrays
    names = [k for k in arrays if k in layout.data_arrays()]
    for start in layout.partitions():  # every partition's data lands, like workers writing
        store.GenerationStore.open(path).write_region(start, {k: arrays[k][start : start + partition] for k in names})
    done = {0: store.DONE, partition: store.DONE} if done is None else done
    for k, (start, code) in enumerate(sorted(done.items())):
        status = np.full(min(partition, n - start), code, dtype=np.int8)
        errors = None
        if code == store.DONE and start == partition:  # one failed row in the second partition
            status[1] = store.FAILED
            errors = [""] * len(status)
            errors[1] = "engine crashed on this prompt"
        when = np.full(len(status), T0 + k * GAP)
        store.GenerationStore.open(path).commit(start, status, errors, when)
        truth.status[start : start + len(status)] = status
        truth.committed_at[start : start + len(status)] = when
    return truth


def _arrays(
    layout: store.Layout, prompt_ids: list[list[int]], truth: Truth, rng: np.random.Generator, tok: ByteTokenizer
) -> dict[str, np.ndarray]:
    n, s, t, r = layout.n_prompts, layout.n_samples, layout.n_trajectories, layout.max_new_tokens
    shape = (n, s, t)
    a = {
        "prompt_ids": np.zeros((n, layout.max_prompt_tokens), np.int32),
        "prompt_length": np.array([len(p) for p in prompt_ids], np.int32),
        "response_ids": np.zeros((*shape, r), np.int32),
        "response_length": np.zeros(shape, np.int32),
        "response_mask": np.zeros((*shape, r), np.uint8),
        "logprobs": np.full((*shape, r), np.nan, np.float32),
        "finish_reason": np.full(shape, -1, np.int8),
        "num_turns": np.zeros(shape, np.int16),
        "num_trajectories": rng.integers(1, t + 1, size=(n, s)).astype(np.int16),
        **{name: np.full(shape, -1, np.int32) for name in VERSION_ARRAYS},
    }
    for i in range(n):
        a["prompt_ids"][i, : len(prompt_ids[i])] = prompt_ids[i]
        for j in range(s):
            if (i, j) == (2, 2):  # never generated (a verifier run needed no more samples)
                a["num_trajectories"][i, j] = 0
            for k in range(int(a["num_trajectories"][i, j])):
                ids, reason, text = _response(i, j, k, r, rng, tok)
                truth.response_texts[(i, j, k) if t > 1 else (i, j)] = text
                m = len(ids)
                a["response_ids"][i, j, k, :m] = ids
                a["response_length"][i, j, k] = m
                a["response_mask"][i, j, k, :m] = 1
                if j == 1 and m > 4:  # a tool result inside the response: not model tokens
                    a["response_mask"][i, j, k, 2:4] = 0
                a["num_turns"][i, j, k] = 2 if j == 1 and m > 4 else 1
                model = a["response_mask"][i, j, k, :m] == 1
                a["logprobs"][i, j, k, :m][model] = -rng.random(int(model.sum()), dtype=np.float32)
                a["finish_reason"][i, j, k] = int(reason)
                if m > 2:  # sample 1 continued onto the next policy version at position 2
                    a["policy_version"][i, j, k] = i % 3
                    a["policy_version_end"][i, j, k] = i % 3 + (j == 1)
                    a["version_changed_at"][i, j, k] = 2 if j == 1 else -1
    if t == 1:
        a = {k: v[:, :, 0] if k not in ("prompt_ids", "prompt_length", "num_trajectories") else v for k, v in a.items()}
        del a["num_trajectories"]
    return a


@pytest.fixture
def truth(tmp_path) -> Truth:
    return build_store(tmp_path)


def test_importing_analysis_loads_no_torch_or_matplotlib():
    code = (
        "import sys, daskgen.analysis.accessor; "
        "print(sorted(m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_open_store_adds_labels_and_plain_xarray_still_opens(truth):
    ds = open_store(truth.path)
    labels = ds.finish_label.values
    assert labels[1, 0] == "error" and set(np.unique(labels)) <= {"stop", "length", "error", "not_generated"}
    codes = truth.arrays["finish_reason"]
    assert ((labels == "stop") == (codes == 0)).all() and ((labels == "length") == (codes == 1)).all()
    plain = xr.open_zarr(truth.path)
    assert "finish_label" not in plain and plain.daskgen.counts() == ds.daskgen.counts()
    with pytest.raises(StoreError, match="not a daskgen store"):
        open_store(truth.path / "status")


def test_counts_and_done_rows_are_a_lazy_selection(truth):
    acc = open_store(truth.path).daskgen
    assert acc.counts() == {"pending": 2, "done": 7, "failed": 1, "total": 10}
    assert acc.rows("done").tolist() == [0, 1, 2, 3, 4, 6, 7] and acc.rows("failed").tolist() == [5]
    done = acc.done()
    assert hasattr(done.response_ids.data, "dask"), "selecting done rows must not load the data"
    np.testing.assert_array_equal(done.response_ids.values, truth.arrays["response_ids"][acc.rows("done")])
    with pytest.raises(ValueError, match="which must be one of"):
        acc.rows("finished")


def _expected_lengths(truth: Truth) -> dict[str, np.ndarray]:
    done = truth.status == store.DONE
    lengths, codes = truth.arrays["response_length"][done], truth.arrays["finish_reason"][done]
    lengths, codes = lengths[codes >= 0], codes[codes >= 0]
    return {label: lengths[codes == code] for label, code in (("stop", 0), ("length", 1), ("error", 3))}


def test_length_histogram_and_stats_count_done_rows_only(truth):
    acc = open_store(truth.path).daskgen
    hist = acc.length_histogram()
    expected = _expected_lengths(truth)
    for label, values in expected.items():
        np.testing.assert_array_equal(hist.sel(finish_reason=label).values, np.bincount(values, minlength=13))
    assert hist.sum() == 7 * 3 - 1, (
        "pending rows with data on disk, the failed row and the sample never generated must not count"
    )
    assert hist.sel(finish_reason="not_generated").sum() == 0
    stats = acc.length_stats()
    for label, values in {**expected, "all": np.concatenate(list(expected.values()))}.items():
        row = stats.loc[label]
        assert row["samples"] == len(values) and row["min"] == values.min() and row["max"] == values.max()
        assert math.isclose(row["mean"], values.mean())
        for q in (0.5, 0.9, 0.99):
            assert row[f"p{q * 100:g}"] == np.quantile(values, q, method="inverted_cdf")
    assert math.isclose(stats["share"].drop("all").sum(), 1.0)


def test_totals_and_tokens_per_prompt(truth):
    acc = open_store(truth.path).daskgen
    done = truth.status == store.DONE
    totals = acc.totals()
    assert totals["samples"] == 21 and totals["generated"] == 20
    assert totals["prompt_tokens"] == truth.arrays["prompt_length"][done].sum()
    assert totals["response_tokens"] == truth.arrays["response_length"][done].sum()
    per_prompt = acc.tokens_per_prompt().values
    np.testing.assert_array_equal(per_prompt[done], truth.arrays["response_length"][done].sum(axis=1))
    assert np.isnan(per_prompt[~done]).all()


def test_throughput_bins_commit_times(truth):
    frame = open_store(truth.path).daskgen.throughput(bin_seconds=60)
    tokens = truth.arrays["response_length"].sum(axis=1)
    first, second = [0, 1, 2, 3], [4, 6, 7]
    assert frame["prompts"].tolist() == [4, 3]
    assert frame["tokens"].tolist() == [tokens[first].sum(), tokens[second].sum()]
    assert frame["prompts_per_min"].tolist() == [4.0, 3.0] and frame.attrs["bin_seconds"] == 60
    assert frame["start"][0].timestamp() == pytest.approx(T0)
    auto = open_store(truth.path).daskgen.throughput()
    assert auto["prompts"].sum() == 7 and auto.attrs["bin_seconds"] in (2.0, 5.0)


def test_nothing_done_gives_empty_statistics(tmp_path):
    acc = open_store(build_store(tmp_path, done={}).path).daskgen
    assert acc.counts()["done"] == 0 and acc.length_histogram().sum() == 0
    assert acc.length_stats().empty and acc.throughput().empty


def test_pass_rates_count_generated_samples_and_unbiased_pass_at_k(truth):
    ds = open_store(truth.path)
    scores = np.random.default_rng(1).random((10, 3))
    ds["score"] = (("prompt", "sample"), scores)
    out = ds.daskgen.pass_rates(threshold=0.5, ks=(1, 2, 3))
    rows = ds.daskgen.rows("done")
    generated = truth.arrays["finish_reason"][rows] >= 0
    hits, used = ((scores[rows] >= 0.5) & generated).sum(axis=1), generated.sum(axis=1)
    assert used.tolist() == [3, 3, 2, 3, 3, 3, 3]
    np.testing.assert_allclose(out.pass_rate.values, hits / used)
    for k in (1, 2, 3):
        ok = used >= k
        brute = np.mean([1 - math.comb(n - c, k) / math.comb(n, k) for n, c in zip(used[ok], hits[ok], strict=True)])
        assert out.pass_at_k.sel(k=k).item() == pytest.approx(brute)
        assert out.pass_at_k_prompts.sel(k=k).item() == ok.sum()
    with pytest.raises(ValueError, match="add per-sample scores"):
        ds.daskgen.pass_rates("reward")
    with pytest.raises(ValueError, match="1 <= k <= n_samples=3"):
        ds.daskgen.pass_rates(ks=(4,))


def test_texts_decode_with_the_stores_tokenizer(truth):
    frame = open_store(truth.path).daskgen.texts()
    assert len(frame) == 20 and frame["prompt_index"].tolist() == [k[0] for k in truth.units()]
    for row in frame.itertuples():
        assert row.prompt == truth.prompt_texts[row.prompt_index]
        assert row.response == truth.response_texts[(row.prompt_index, row.sample)]
    assert frame.loc[(frame.prompt_index == 1) & (frame["sample"] == 0), "finish_reason"].item() == "error"
    assert len(open_store(truth.path).daskgen.texts(rows=[8], limit=1)) == 3


def test_decoding_refuses_a_different_tokenizer(truth):
    attrs = store.read_store_attrs(truth.path)
    store.GenerationStore.open(truth.path).update_attrs(tokenizer={**attrs.tokenizer, "vocab_size": 32000})
    with pytest.raises(StoreMismatchError, match="vocab_size: store has 32000"):
        open_store(truth.path).daskgen.texts(limit=1)


def test_texts_with_a_real_hugging_face_tokenizer(tmp_path, tiny_model):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_model)
    truth = build_store(tmp_path)
    ds = open_store(truth.path)
    store.GenerationStore.open(truth.path).update_attrs(
        tokenizer=tokenizer_identity(hf),
        identity={**ds.daskgen.attrs.identity, "model": str(tiny_model), "engine": "transformers"},
    )
    frame = open_store(truth.path).daskgen.texts(limit=2, skip_special_tokens=False)
    ids = truth.arrays["response_ids"][0, 0, : truth.arrays["response_length"][0, 0]]
    prompt = truth.arrays["prompt_ids"][0, : truth.arrays["prompt_length"][0]]
    assert frame.response[0] == hf.decode(ids) and frame.prompt[0] == hf.decode(prompt)


def test_trajectory_axis_counts_only_real_trajectories(tmp_path):
    truth = build_store(tmp_path, trajectories=3)
    ds = open_store(truth.path)
    assert ds.attrs["daskgen"]["schema_version"] == 2 and "trajectory" in ds.response_ids.dims
    real = int(truth.arrays["num_trajectories"][truth.status == store.DONE].sum())
    assert ds.daskgen.totals()["generated"] == real == len(truth.units())
    assert ds.daskgen.length_histogram().sum() == real
    assert ds.daskgen.length_histogram().sel(finish_reason="not_generated").sum() == 0
    frame = ds.daskgen.texts()
    assert [tuple(k) for k in frame[["prompt_index", "sample", "trajectory"]].values] == truth.units()
    assert frame.response.tolist() == [truth.response_texts[k] for k in truth.units()]


def test_raw_prompts_stream_from_the_matching_input(truth, tmp_path):
    acc = open_store(truth.path).daskgen
    assert acc.input_path() == truth.input_path
    assert [json.loads(p)[0]["content"] for p in acc.raw_prompts(rows=[3, 1])] == ["prompt 1", "prompt 3"]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"prompt": "something else"}) + "\n")
    with pytest.raises(StoreMismatchError, match="fingerprint differs"):
        acc.raw_prompts(path=other)
    truth.input_path.write_text(other.read_text())  # the recorded file changed: silently unavailable
    assert acc.raw_prompts() is None
