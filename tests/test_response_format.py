"""Structured outputs (``response_format``): a real run of SmolLM2 on the transformers engine, each row with its own
format or the run's, where every response that finished by ``stop`` conforms to its format; the store keeps each
row's format and refuses a resume with another one; bad formats fail at input scan naming row, key and fix; an
engine without structured outputs is refused at plan time naming the engines that have them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from daskgen.analysis.accessor import open_store
from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.engines.base import FinishReason
from daskgen.errors import ConfigError, InputError, StoreMismatchError
from daskgen.input.response_format import ResponseFormat, from_setting
from daskgen.input.rows import scan_prompts
from daskgen.input.tokenizer import ByteTokenizer
from daskgen.testing.structured import CASES, PERSON
from tests.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # one real SmolLM2 run through the CLI

#: The run's format (the first row, without its own, uses it), then one row per kind of format.
RUN_FORMAT = CASES[0][1]
ROWS = [(CASES[0][0], None), *CASES[1:]]


def input_rows(formats=None) -> list[dict]:
    formats = formats or [fmt for _, fmt in ROWS]
    out = []
    for i, ((question, _), fmt) in enumerate(zip(ROWS, formats, strict=True)):
        row = {"id": f"q{i}", "messages": [{"role": "user", "content": question}]}
        out.append(row if fmt is None else {**row, "response_format": fmt})
    return out


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One real run: SmolLM2 on the transformers engine, two sampled responses per row."""
    from daskgen.models import smollm2_instruct

    tmp = tmp_path_factory.mktemp("structured")
    prompts, store = write_rows(tmp / "p.jsonl", input_rows()), str(tmp / "out.zarr")
    options = {"model": str(smollm2_instruct()), "store": store, "engine": "transformers", "max_new_tokens": 160,
               "n_samples": 2, "partition_size": 4, "response_format": RUN_FORMAT, "seed": 3}  # fmt: skip
    flags = [f"--{key.replace('_', '-')}={json.dumps(value) if key == 'response_format' else value}"
             for key, value in options.items()]  # fmt: skip
    result = run_cli("run", "--prompts", prompts, *flags, "--n-workers", "1", "--no-progress")
    assert result.returncode == 0, result.stdout + result.stderr
    return prompts, options, tmp


def test_every_response_ends_by_stop_and_conforms_to_its_rows_format(run):
    from transformers import AutoTokenizer

    prompts, options, _ = run
    ds = open_store(options["store"])
    tokenizer = AutoTokenizer.from_pretrained(options["model"])
    wanted = [fmt or RUN_FORMAT for _, fmt in ROWS]
    assert [json.loads(t) for t in ds["response_format"].values] == [ResponseFormat.parse(w).as_dict() for w in wanted]
    for row, raw in enumerate(wanted):
        fmt = ResponseFormat.parse(raw)
        for sample in range(2):
            n = int(ds["response_length"][row, sample])
            text = tokenizer.decode(ds["response_ids"][row, sample, :n].values, skip_special_tokens=True)
            reason = FinishReason(int(ds["finish_reason"][row, sample]))
            assert reason == FinishReason.STOP, (row, sample, reason.name, n, text)  # a truncated one says LENGTH
            assert fmt.violation(text) is None, (row, sample, text, fmt.violation(text))


def test_a_resume_with_another_format_is_refused(run):
    prompts, options, tmp = run
    changed = write_rows(tmp / "changed.jsonl", input_rows([None, {"json_schema": PERSON}, {"regex": "[0-9]+"}, None]))
    with pytest.raises(StoreMismatchError, match="fingerprint"):
        prepare(RunConfig(**options), changed)
    with pytest.raises(StoreMismatchError, match="response_format"):
        prepare(RunConfig(**{**options, "response_format": {"choice": ["no", "yes"]}}), prompts)
    assert prepare(RunConfig(**options), prompts).layout.structured  # the same settings resume


def test_bad_formats_fail_at_input_scan_naming_row_key_and_fix():
    rows = [
        {"prompt": "a", "response_format": {"json_schema": {"type": "objekt"}}},
        {"prompt": "b", "response_format": {"regex": "([0-9]"}},
        {"prompt": "c", "response_format": {"choice": []}},
        {"prompt": "d", "response_format": {"regex": "a", "choice": ["a"]}},
        {"prompt": "e", "response_format": {"grammar": 'start ::= "x"'}},
        {"prompt": "f", "response_format": {"choice": ["fine"]}},
    ]
    with pytest.raises(InputError) as info:
        scan_prompts(rows, ByteTokenizer(), max_prompt_tokens=64)
    message = str(info.value)
    assert "5 problem(s)" in message
    for needle in (
        "row 0: column 'response_format': 'json_schema' is not a valid JSON Schema at type",
        "row 1: column 'response_format': 'regex' '([0-9]' does not compile",
        "row 2: column 'response_format': 'choice' must be a non-empty list of non-empty strings",
        "row 3: column 'response_format': expected an object with exactly one of the keys",
        "row 4: column 'response_format': 'grammar' is not valid EBNF",
    ):
        assert needle in message
    assert "fix" in message.lower() and "row 6" not in message
    assert scan_prompts(rows[5:], ByteTokenizer(), max_prompt_tokens=64).structured


def test_the_setting_is_checked_and_read_from_json_text():
    given = RunConfig(model="m", response_format='{"regex": "[a-z]+"}')
    assert given.to_dict()["response_format"] == {"regex": "[a-z]+"}, "kept as an object in the store's record"
    assert from_setting({"choice": ["a", "b"]}) == ResponseFormat("choice", ("a", "b"))
    with pytest.raises(ConfigError, match="setting 'response_format': not valid JSON"):
        RunConfig(model="m", response_format="{regex")
    with pytest.raises(ConfigError, match="setting 'response_format': expected an object with exactly one"):
        RunConfig(model="m", response_format={"schema": {}})


def test_an_engine_without_structured_outputs_is_refused_at_plan_time(tmp_path):
    rows = [{"prompt": "hello", "response_format": {"choice": ["a"]}}]
    config = RunConfig(model="sim", engine="simulated", store=str(tmp_path / "s.zarr"), max_prompt_tokens=64)
    with pytest.raises(ConfigError) as info:
        prepare(config, rows)
    for name in ("'simulated'", "openai", "sglang", "transformers", "vllm"):
        assert name in str(info.value)
    assert not (tmp_path / "s.zarr").exists()


def test_violation_checks_each_kind():
    schema = ResponseFormat.parse({"json_schema": PERSON})
    assert schema.violation('{"name": "Ann", "age": 3}') is None
    assert "not valid under the schema" in str(schema.violation('{"name": "Ann"}'))
    assert "not JSON" in str(schema.violation("Ann"))
    regex = ResponseFormat.parse({"regex": "[0-9]{1,3}"})
    assert regex.violation("12") is None and regex.violation("12a") is not None
    grammar = ResponseFormat.parse({"grammar": ROWS[3][1]["grammar"]})
    assert grammar.violation("The answer is green.") is None and grammar.violation("The answer is") is not None
    choice = ResponseFormat.parse({"choice": ['say "hi"', "no"]})
    assert choice.violation('say "hi"') is None and choice.violation("hi") is not None
    assert choice.ebnf() == 'root ::= "say \\"hi\\"" | "no"'
    assert np.array_equal(json.loads(choice.text())["choice"], ['say "hi"', "no"])


def test_each_engine_maps_every_kind_to_its_own_fields():
    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.openai.protocol import openai_payload
    from daskgen.engines.openai.vllm_protocol import vllm_completions_payload
    from daskgen.engines.sglang.mapping import sampling_params_for
    from daskgen.engines.vllm.mapping import vllm_sampling_kwargs

    grammar = CASES[3][1]["grammar"]
    expected = {  # kind -> (sglang's sampling field, vLLM's structured_outputs)
        "json_schema": ({"json_schema": json.dumps(PERSON, sort_keys=True)}, {"json": PERSON}),
        "regex": ({"regex": "[0-9]{1,3}"}, {"regex": "[0-9]{1,3}"}),
        "choice": ({"ebnf": 'root ::= "yes" | "no"'}, {"choice": ["yes", "no"]}),
        "grammar": ({"ebnf": grammar}, {"grammar": grammar}),
    }
    for _, raw in CASES:
        fmt = ResponseFormat.parse(raw)
        params = SamplingParams(8, response_format=fmt)
        sglang, vllm = expected[fmt.kind]
        assert sglang.items() <= sampling_params_for(params).items()
        assert vllm_sampling_kwargs(params)["structured_outputs"] == vllm
        request = GenerationRequest("r", [1, 2], params)
        assert vllm_completions_payload("m", request, {})["structured_outputs"] == vllm
        _, body = openai_payload("chat", "m", "hi", request, {})
        if fmt.kind == "json_schema":
            assert body["response_format"] == {
                "type": "json_schema",
                "json_schema": {"name": "response", "schema": PERSON},
            }
        else:
            assert body["structured_outputs"] == vllm
    plain = SamplingParams(8)
    assert not {"json_schema", "regex", "ebnf"} & set(sampling_params_for(plain))
    assert "structured_outputs" not in vllm_sampling_kwargs(plain)
