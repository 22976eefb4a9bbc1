"""The client loads a model folder's tokenizer as ``AutoTokenizer`` would, without torch where the class is certain."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daskgen.input.tokenizer import (
    DIRECT_BACKEND_MODEL_TYPES,
    direct_backend,
    load_hf_tokenizer,
    model_tokenizer,
    tokenizer_identity,
)

TEXTS = ["Hello world", "  spaces\tand\nlines  ", "émigré naïve 東京 🙂", "<|im_start|>user\nhi<|im_end|>", ""]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def _folder_of_type(tiny_model: Path, dest: Path, model_type: str, **tok_config: object) -> Path:
    """The tiny model's tokenizer files beside a ``config.json`` of ``model_type`` (transformers' own defaults)."""
    from transformers import AutoConfig

    dest.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model / name, dest / name)
    AutoConfig.for_model(model_type).save_pretrained(dest)
    if tok_config:
        path = dest / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tok_config}))
    return dest


def _assert_same_tokenizer(folder: Path) -> None:
    from transformers import AutoTokenizer

    auto, ours = AutoTokenizer.from_pretrained(folder), load_hf_tokenizer(folder)
    assert type(ours) is type(auto), (type(ours), type(auto))
    for text in TEXTS:
        assert ours(text)["input_ids"] == auto(text)["input_ids"], text
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True) == auto.apply_chat_template(
        MESSAGES, add_generation_prompt=True
    )
    assert tokenizer_identity(ours) == tokenizer_identity(auto)  # what a resume compares (name, sizes, ids, template)
    assert (len(ours), ours.eos_token_id, ours.pad_token_id, ours.bos_token_id, ours.chat_template) == (
        len(auto),
        auto.eos_token_id,
        auto.pad_token_id,
        auto.bos_token_id,
        auto.chat_template,
    )
    ids = auto("round trip: ünïcode")["input_ids"]
    assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)


def test_every_direct_model_type_is_one_transformers_leaves_to_the_folders_class() -> None:
    """The rule behind the list: no model-specific class registered over the folder's, no Mistral routing."""
    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS,
        TOKENIZER_MAPPING_NAMES,
    )

    for model_type in DIRECT_BACKEND_MODEL_TYPES:
        registered = TOKENIZER_MAPPING_NAMES.get(model_type)
        assert registered != "MistralCommonBackend", model_type
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS or registered in (None, "TokenizersBackend")


@pytest.mark.parametrize("model_type", sorted(DIRECT_BACKEND_MODEL_TYPES))
def test_a_direct_folder_loads_the_class_and_ids_autotokenizer_gives(tiny_model, tmp_path, model_type) -> None:
    folder = _folder_of_type(tiny_model, tmp_path / model_type, model_type)
    assert direct_backend(folder)
    _assert_same_tokenizer(folder)


@pytest.mark.parametrize(
    ("model_type", "tok_config"),
    [
        ("qwen2", {}),  # transformers loads its own Qwen2 class over the folder's TokenizersBackend
        ("llama", {"tokenizer_class": "PreTrainedTokenizerFast"}),
        ("llama", {"auto_map": {"AutoTokenizer": [None, "TokenizersBackend"]}}),
    ],
    ids=["registered-class-wins", "other-class-named", "auto-map"],
)
def test_any_other_folder_goes_through_autotokenizer(tiny_model, tmp_path, model_type, tok_config) -> None:
    folder = _folder_of_type(tiny_model, tmp_path / "m", model_type, **tok_config)
    assert not direct_backend(folder)
    if "auto_map" not in tok_config:  # an auto_map needs remote code: only the refusal of the direct path is checked
        _assert_same_tokenizer(folder)


def test_a_folder_with_unreadable_configs_is_not_direct(tiny_model, tmp_path) -> None:
    folder = _folder_of_type(tiny_model, tmp_path / "m", "llama")
    (folder / "config.json").write_text("{not json")
    assert not direct_backend(folder)
    (folder / "config.json").write_text("[]")
    assert not direct_backend(folder)


def test_the_shipped_models_load_as_autotokenizer_loads_them(tiny_model) -> None:
    from daskgen.models import build_tiny_vl_model, default_cache_dir

    assert direct_backend(tiny_model)  # the tiny Llama takes the direct path
    _assert_same_tokenizer(tiny_model)
    _assert_same_tokenizer(build_tiny_vl_model())  # the cached one the image tests use
    smollm2 = default_cache_dir() / "models" / "SmolLM2-135M-Instruct"
    if smollm2.is_dir():  # built by the README's first command and the smollm2 tests; its tokenizer is SmolLM2's own
        _assert_same_tokenizer(smollm2)


def test_the_client_loads_a_llama_tokenizer_without_importing_torch(tiny_model) -> None:
    code = (
        "import sys\n"
        "from daskgen.input.tokenizer import model_tokenizer, tokenizer_identity\n"
        f"tok = model_tokenizer({str(tiny_model)!r}, 'transformers', simulated=False)\n"
        "print(tokenizer_identity(tok)['vocab_size'], tok.pad_token_id is not None)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(len(model_tokenizer(str(tiny_model), "transformers", simulated=False))), "True"]
