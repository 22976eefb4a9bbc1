"""Top-k logprobs (``top_logprobs: k``) from engine results to the store, its checks, exports and follow formats.

A real run of the simulated engine (its made-up top-k entries are the sampled token, with its logprob, then the
next ids 0.5 apart below it) gives a store whose expected contents follow from its own ``response_ids`` and
``logprobs``; the engines' real distributions are checked by the conformance suite and, on transformers,
against a direct forward pass (:func:`check_stored_top_logprobs`, used by ``tests/test_run.py``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import daskgen
from daskgen.agents.base import Trajectory
from daskgen.analysis.accessor import open_store
from daskgen.analysis.export import export, load_tensordict
from daskgen.engines.base import FinishReason, GenerationResult
from daskgen.engines.openai.top_logprobs import retokenized_top, server_top, token_id_top
from daskgen.store.layout import Layout, empty_region
from daskgen.store.tools.verify import verify
from daskgen.worker.samples.top_logprobs import place_top_logprobs, stored_top_logprobs
from tests.conftest import run_cli, simulated_run, write_prompts

pytestmark = pytest.mark.timeout(300)
K = 3


def check_stored_top_logprobs(ds, model: str, k: int) -> None:
    """Every stored response's top-k ids equal a forward pass's of ``model`` over prompt + response, and their
    logprobs are within 1e-4 (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids, values = ds.top_logprob_ids.values, ds.top_logprobs.values
    for i in range(ds.sizes["prompt"]):
        prompt = ds.prompt_ids.values[i, : int(ds.prompt_length.values[i])].tolist()
        for s in range(ds.sizes["sample"]):
            n = int(ds.response_length.values[i, s])
            response = ds.response_ids.values[i, s, :n].tolist()
            with torch.no_grad():
                logits = reference(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].float()
            expected = torch.topk(torch.log_softmax(logits, dim=-1), k)
            assert ids[i, s, :n].tolist() == expected.indices.tolist(), (i, s)
            assert np.allclose(values[i, s, :n], expected.values.numpy(), atol=1e-4, rtol=0), (i, s)
            assert (ids[i, s, n:] == -1).all() and np.isnan(values[i, s, n:]).all(), (i, s)


@pytest.fixture(scope="module")
def top_store(tmp_path_factory):
    base = tmp_path_factory.mktemp("top")
    prompts = write_prompts(base / "p.jsonl", 6)
    args = ["run", "--prompts", prompts, "--store", base / "out.zarr", *simulated_run(max_new_tokens=8)]
    res = run_cli(*args, "--logprobs", "--top-logprobs", str(K), "--temperature", "1.0")
    assert res.returncode == 0, res.stdout + res.stderr
    return base / "out.zarr"


def _expected(ds):
    """Per (prompt, sample): the stored ``(id, logprob)`` entries of its tokens."""
    out = {}
    for i in range(ds.sizes["prompt"]):
        for s in range(ds.sizes["sample"]):
            n = int(ds.response_length.values[i, s])
            ids, values = ds.top_logprob_ids.values[i, s, :n].tolist(), ds.top_logprobs.values[i, s, :n].tolist()
            out[i, s] = [list(zip(a, b, strict=True)) for a, b in zip(ids, values, strict=True)]
    return out


def test_the_store_holds_each_tokens_top_k_and_verifies(top_store):
    """The simulated engine's entries: the sampled token first with its logprob, then others, most likely first."""
    ds = open_store(top_store)
    assert ds.top_logprob_ids.dims == ("prompt", "sample", "response_position", "top_rank")
    assert ds.top_logprob_ids.shape == (6, 2, 8, K) and ds.attrs["daskgen"]["layout"]["top_logprobs"] == K
    for (i, s), entries in _expected(ds).items():
        n = len(entries)
        assert n and ds.top_logprob_ids.values[i, s, :n, 0].tolist() == ds.response_ids.values[i, s, :n].tolist()
        assert np.allclose(ds.top_logprobs.values[i, s, :n, 0], ds.logprobs.values[i, s, :n])
        assert all(
            len({t for t, _ in e}) == K and [v for _, v in e] == sorted((v for _, v in e), reverse=True)
            for e in entries
        )
        assert (ds.top_logprob_ids.values[i, s, n:] == -1).all() and np.isnan(ds.top_logprobs.values[i, s, n:]).all()
    assert verify(top_store, progress=False).sound


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_parquet_and_jsonl_rows_hold_the_entries_as_lists(top_store, tmp_path, fmt):
    out = tmp_path / f"x.{fmt}"
    export(top_store, out, fmt, text=False)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        records = pq.read_table(out).to_pylist()
    else:
        records = [json.loads(line) for line in out.read_text().splitlines()]
    expected = _expected(open_store(top_store))
    assert len(records) == len(expected)
    for record in records:
        entries = expected[record["prompt_index"], record["sample"]]
        assert record["top_logprob_ids"] == [[t for t, _ in e] for e in entries]
        assert np.allclose(np.array(record["top_logprobs"]), [[v for _, v in e] for e in entries], atol=1e-6)


def _check_batch_fields(ids, values, prompt_index, sample, expected) -> None:
    """verl-layout ``top_logprob_ids``/``top_logprobs`` rows: the entries, then ``-1``/``-inf``."""
    for row, (i, s) in enumerate(zip(prompt_index, sample, strict=True)):
        entries = expected[int(i), int(s)]
        n = len(entries)
        assert ids[row, :n].tolist() == [[t for t, _ in e] for e in entries]
        assert np.allclose(values[row, :n], [[v for _, v in e] for e in entries], atol=1e-6)
        assert (ids[row, n:] == -1).all() and np.isneginf(values[row, n:]).all()


def test_tensordict_export_holds_the_entries_in_its_batch(top_store, tmp_path):
    export(top_store, tmp_path / "x.td", "tensordict", text=False)
    td = load_tensordict(tmp_path / "x.td")
    expected = _expected(open_store(top_store))
    ids, values = td["top_logprob_ids"].numpy(), td["top_logprobs"].numpy()
    _check_batch_fields(ids, values, td["prompt_index"].numpy(), td["sample"].numpy(), expected)


def test_every_follow_format_carries_the_entries(top_store):
    expected = _expected(open_store(top_store))
    follow = {
        fmt: next(iter(daskgen.follow(top_store, format=fmt, wait=False, auto_ack=False)))
        for fmt in ("xarray", "tensordict", "dataproto", "rows")
    }
    ds = follow["xarray"].data
    assert ds.top_logprob_ids.shape[-1] == K
    td = follow["tensordict"].data
    _check_batch_fields(
        td["top_logprob_ids"].numpy(),
        td["top_logprobs"].numpy(),
        td["prompt_index"].numpy(),
        td["sample"].numpy(),
        expected,
    )
    proto = follow["dataproto"].data
    _check_batch_fields(
        proto.batch["top_logprob_ids"].numpy(),
        proto.batch["top_logprobs"].numpy(),
        proto.non_tensor_batch["prompt_index"],
        proto.non_tensor_batch["sample"],
        expected,
    )
    for record in follow["rows"].data:
        assert record["top_logprob_ids"] == [
            [t for t, _ in e] for e in expected[record["prompt_index"], record["sample"]]
        ]


def test_an_engine_without_top_logprobs_is_refused_before_it_starts(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    args = [*simulated_run(), "--engine", "daskgen.testing.engines:RecordingEngine", "--top-logprobs", "2"]
    res = run_cli("run", "--prompts", prompts, "--store", tmp_path / "out.zarr", *args)
    assert res.returncode != 0
    assert "cannot serve what this run asks for" in res.stderr and "top-k logprobs ('top_logprobs')" in res.stderr
    assert "transformers" in res.stderr
    assert not (tmp_path / "out.zarr").exists()


def test_observation_tokens_get_no_entries_and_model_tokens_keep_theirs():
    traj = Trajectory(logprobs=None, top_logprobs=[])
    traj.add_model_tokens(
        GenerationResult("r", [5, 6], FinishReason.STOP, None, top_logprobs=[[(5, -0.1)], [(6, -0.2)]])
    )
    traj.add_observation_tokens([7, 8, 9])
    traj.add_model_tokens(GenerationResult("r", [10], FinishReason.STOP, None, top_logprobs=None))
    assert traj.top_logprobs == [[(5, -0.1)], [(6, -0.2)], [], [], [], []]


def test_server_alternatives_map_to_ids_ranked_and_cut_to_k(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    one, two = tok.decode([40]), tok.decode([41])
    chat = {
        "content": [
            {
                "token": one,
                "logprob": -0.5,
                "top_logprobs": [{"token": two, "logprob": -0.9}, {"token": one, "logprob": -0.5}],
            }
        ]
    }
    completions = {"top_logprobs": [{one: -0.5, two: -0.9, one + two + two: -2.0}]}
    expected = [[(40, -0.5), (41, -0.9)]]
    assert retokenized_top(server_top(chat), 2, tok) == expected
    assert retokenized_top(server_top(completions), 5, tok) == expected  # a text of several tokens is left out
    vllm = {"top_logprobs": [{"token_id:7": -3.0, "token_id:3": -0.1, "token_id:9": -1.0}]}  # k = 2 plus the sampled
    assert token_id_top(server_top(vllm), 2) == [[(3, -0.1), (9, -1.0)]]


def test_region_round_trip_keeps_each_tokens_entries():
    """Full rows take the one-conversion path, short rows (fewer entries, tool tokens) the other; reading back
    gives the entries (what a continued sample starts from)."""
    layout = Layout(2, 1, 4, 5, 2, 0, top_logprobs=2)
    region = empty_region(layout, 2)
    full = [[(5, -0.1), (6, -2.0)], [(7, -0.3), (1, -1.5)]]
    short = [[(5, -0.1), (6, -2.0)], [], [(9, -0.2)]]
    place_top_logprobs(region, (0, 0), full, 2)
    place_top_logprobs(region, (1, 0), short, 3)
    assert region["top_logprob_ids"][0, 0].tolist() == [[5, 6], [7, 1], [-1, -1], [-1, -1], [-1, -1]]
    assert stored_top_logprobs(region, (0, 0), 2) == [
        [(5, pytest.approx(-0.1)), (6, -2.0)],
        [(7, pytest.approx(-0.3)), (1, -1.5)],
    ]
    assert [[t for t, _ in e] for e in stored_top_logprobs(region, (1, 0), 3)] == [[5, 6], [], [9]]


def test_more_top_logprobs_than_vllm_gives_is_refused_at_plan_time_naming_k_the_limit_and_the_fix(tiny_model, tmp_path):
    from daskgen.client.plan import prepare
    from daskgen.config import RunConfig
    from daskgen.engines import get_engine_class
    from daskgen.engines.features import check_top_logprobs
    from daskgen.errors import ConfigError

    prompts = write_prompts(tmp_path / "p.jsonl", 2)
    settings = dict(model=str(tiny_model), prompts=str(prompts), engine="vllm", max_new_tokens=4)
    with pytest.raises(ConfigError) as info:  # vLLM's own default max_logprobs is 20
        prepare(RunConfig(**settings, store=str(tmp_path / "a.zarr"), top_logprobs=21))
    text = str(info.value)
    assert (
        "top_logprobs=21 is more than engine 'vllm' gives per request: at most 20 (its engine arg max_logprobs" in text
    )
    assert "Lower top_logprobs to 20 or less" in text and "--engine-arg max_logprobs=21" in text
    assert not (tmp_path / "a.zarr").exists()  # refused before the store or any engine
    vllm, sglang = get_engine_class("vllm"), get_engine_class("sglang")
    with pytest.raises(ConfigError, match="top_logprobs=9 is more .* at most 8 "):
        check_top_logprobs("vllm", vllm, 9, {"max_logprobs": 8})
    raised = prepare(RunConfig(**settings, store=str(tmp_path / "c.zarr"), top_logprobs=32,
                               engine_args={"max_logprobs": 32}))  # fmt: skip
    assert raised.layout.top_logprobs == 32
    assert vllm.top_logprobs_limit({"max_logprobs": -1}) is None  # vLLM's "no cap"
    assert sglang.top_logprobs_limit({}) is None and get_engine_class("transformers").top_logprobs_limit({}) is None
