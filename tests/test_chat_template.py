"""Chat-template options on the tiny model's real tokenizer: a template file that reads a variable and renders
tools, run-level and per-row ``chat_template_kwargs``, what the store records, resume refusals, bad values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from daskgen.client.plan import prepare
from daskgen.config import RunConfig
from daskgen.engines.tokenizer import load_tokenizer
from daskgen.errors import ConfigError, InputError, StoreMismatchError
from daskgen.input.chat_template import ChatTemplate
from daskgen.input.rows import scan_prompts, tokenize_rows
from daskgen.store import GenerationStore
from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(300)

#: A template that branches on ``enable_thinking`` and renders ``tools`` (by name).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools:{% for t in tools %} {{ t.name }}{% endfor %}<|im_end|>\n{% endif -%}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor -%}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"name": "search", "parameters": {"type": "object"}}, {"name": "calc", "parameters": {"type": "object"}}]


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(str(tiny_model), "transformers")


def text_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_rendered_ids_differ_exactly_as_the_template_says(tokenizer, template_file):
    plain = ChatTemplate.from_settings(template_file, None)
    off = ChatTemplate.from_settings(template_file, {"enable_thinking": False})
    base = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenize_rows([{"messages": HI}], tokenizer, plain) == [text_ids(tokenizer, base)]
    assert tokenize_rows([{"messages": HI}], tokenizer, off) == [text_ids(tokenizer, base + "<think></think>")]
    row_on = {"messages": HI, "chat_template_kwargs": {"enable_thinking": True}}  # the row's own value wins
    assert tokenize_rows([row_on], tokenizer, off) == [text_ids(tokenizer, base)]
    with_tools = tokenize_rows([{"messages": HI, "tools": TOOLS}], tokenizer, off)
    tools_text = "<|im_start|>system\ntools: search calc<|im_end|>\n"
    assert with_tools == [text_ids(tokenizer, tools_text + base + "<think></think>")]
    own = tokenize_rows([{"messages": HI}], tokenizer)[0]
    assert own == list(tokenizer.apply_chat_template(HI, add_generation_prompt=True, return_dict=False))
    assert own != tokenize_rows([{"messages": HI}], tokenizer, plain)[0], "the file overrides the model's template"


def test_bad_values_name_the_row_the_key_and_the_fix(tokenizer, tmp_path):
    rows = [
        {"messages": HI, "chat_template_kwargs": ["enable_thinking"]},
        {"messages": HI, "tools": {"name": "search"}},
        {"messages": HI, "tools": ["search"]},
        {"prompt": "Hi", "tools": TOOLS},
        {"messages": HI, "chat_template_kwargs": {"tokenize": False}},
    ]
    with pytest.raises(InputError) as err:
        scan_prompts(rows, tokenizer, max_prompt_tokens=100)
    text = str(err.value)
    assert "row 0: column 'chat_template_kwargs': expected an object of template variables" in text
    assert "row 1: column 'tools': expected a list of JSON-schema objects (one per tool), found dict" in text
    assert "row 2: column 'tools': expected a list of JSON-schema objects (one per tool), found a list holding" in text
    assert "row 3: columns 'chat_template_kwargs'/'tools' apply to 'messages' rows only" in text
    assert "row 4: column 'chat_template_kwargs': ['tokenize'] are not template variables" in text
    with pytest.raises(ConfigError, match=r"setting 'chat_template': cannot read .*nope.jinja.* UTF-8 text file"):
        ChatTemplate.from_settings(tmp_path / "nope.jinja", None)
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ConfigError, match=r"not a valid Jinja template \(line 1: .*fix the template"):
        ChatTemplate.from_settings(broken, None)
    with pytest.raises(ConfigError, match="setting 'chat_template_kwargs' must be dict"):
        RunConfig(model="m", store="s", chat_template_kwargs=["x"])  # type: ignore[arg-type]
    failing = tmp_path / "raise.jinja"
    failing.write_text("{{ raise_exception('no tools here') if tools else 'ok' }}")
    with pytest.raises(InputError, match=r"row 0: the chat template failed on this row .*no tools here"):
        scan_prompts([{"messages": HI, "tools": TOOLS}], tokenizer, max_prompt_tokens=100,
                     template=ChatTemplate.from_settings(failing, None))  # fmt: skip


def test_the_simulated_engines_byte_tokenizer_refuses_chat_template_options(template_file, tmp_path):
    """A model that is no folder with tokenizer files gets the simulated engine's byte tokenizer, which renders
    ``messages`` rows as plain lines: a template file, template variables or tools are refused at the input scan,
    naming the row, the options, the tokenizer found and the fix; a row without options still renders."""
    byte_tokenizer = load_tokenizer("sim", "simulated")
    assert tokenize_rows([{"messages": HI}], byte_tokenizer) == [byte_tokenizer("user: Hi\nassistant: ")["input_ids"]]
    cases = [
        ([{"messages": HI}, {"messages": HI, "chat_template_kwargs": {"enable_thinking": False}}], None, 1,
         "['enable_thinking']"),
        ([{"messages": HI, "tools": TOOLS}], None, 0, "['tools']"),
        ([{"messages": HI}], ChatTemplate.from_settings(template_file, None), 0, "['chat_template']"),
        ([{"messages": HI}], ChatTemplate(None, {"enable_thinking": False}), 0, "['enable_thinking']"),
    ]  # fmt: skip
    for rows, template, number, options in cases:
        with pytest.raises(InputError) as err:
            scan_prompts(rows, byte_tokenizer, max_prompt_tokens=100, template=template)
        assert str(err.value).startswith(
            f"row {number}: chat-template options {options} need the model's Hugging Face tokenizer, found the "
            "simulated engine's byte tokenizer (the model is no folder with tokenizer files), which has no template. "
            "Give a model folder with tokenizer files, or drop the chat_template and chat_template_kwargs settings"
        ), str(err.value)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": HI, "id": "a"}) + "\n")
    out = tmp_path / "out.zarr"
    res = run_cli("run", "--prompts", prompts, "--store", out, "--model", "sim", "--engine", "simulated",
                  "--chat-template-kwarg", "enable_thinking=false", "--n-workers", "1", "--no-progress")  # fmt: skip
    assert res.returncode == 2, res.stdout + res.stderr
    assert "error: row 0: chat-template options ['enable_thinking'] need the model's Hugging Face tokenizer" in (
        res.stderr
    )
    assert not out.exists(), "refused before any store is made"


def test_a_run_renders_with_the_options_records_them_and_refuses_a_resume_with_others(
    tiny_model, tokenizer, template_file, tmp_path
):
    prompts = tmp_path / "p.jsonl"
    rows = [{"messages": HI, "id": "a"}, {"messages": HI, "id": "b", "chat_template_kwargs": {"enable_thinking": True}}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.zarr"
    base = ["run", "--prompts", prompts, "--store", out, "--model", tiny_model, "--chat-template", template_file]
    quick = [*("--engine", "simulated", "--engine-arg", "time_scale=0", "--max-new-tokens", "4"), "--no-progress"]
    quick += ["--max-prompt-tokens", "64", "--partition-size", "2", "--n-workers", "1"]
    res = run_cli(*base, "--chat-template-kwarg", "enable_thinking=false", *quick)
    assert res.returncode == 0, res.stdout + res.stderr
    store = GenerationStore.open(out)
    ids = store.read_region(0, 2, ("prompt_ids", "prompt_length"))
    rendered = [ids["prompt_ids"][i, : ids["prompt_length"][i]].tolist() for i in range(2)]
    assert rendered == tokenize_rows(rows, tokenizer, ChatTemplate(TEMPLATE, {"enable_thinking": False}))
    base_text = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert rendered == [text_ids(tokenizer, base_text + "<think></think>"), text_ids(tokenizer, base_text)]
    assert store.attrs.tokenizer["chat_template_kwargs"] == {"enable_thinking": False}
    assert "chat_template_override_sha256" in store.attrs.tokenizer

    def resume(template: Path, thinking: bool) -> None:
        prepare(RunConfig(**settings, chat_template=str(template), chat_template_kwargs={"enable_thinking": thinking}))

    settings = {"prompts": str(prompts), "store": str(out), "model": str(tiny_model), "engine": "simulated"}
    settings |= {"max_new_tokens": 4, "max_prompt_tokens": 64, "partition_size": 2}
    resume(template_file, False)  # the same settings resume
    with pytest.raises(StoreMismatchError) as refused:
        resume(template_file, True)
    assert "chat_template_kwargs: store has {'enable_thinking': False}, this run has {'enable_thinking': True}" in str(
        refused.value
    )
    edited = tmp_path / "edited.jinja"
    edited.write_text(TEMPLATE + " ")
    with pytest.raises(StoreMismatchError, match="chat_template_override_sha256: store has"):
        resume(edited, False)
