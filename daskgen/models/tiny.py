"""A tiny seeded Llama with the real SmolLM2 tokenizer and chat template, for fast tests.

Two layers, seeded random weights, tuned so that sampling ends with EOS about half the time within
32 new tokens: tests see both ``stop`` and ``length`` finishes.  Heavy imports happen inside the functions.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from daskgen.errors import DaskgenError
from daskgen.models.smollm2 import save_folder, smollm2_instruct

if TYPE_CHECKING:
    import torch
    from transformers import LlamaForCausalLM, PreTrainedTokenizerBase

#: Probability that a tiny-model sample (temperature 1, no top-k/top-p) hits EOS within 32 tokens.
TINY_EOS_TARGET = 0.45
_TINY_HORIZON = 32
#: Share of the vocabulary that are the tiny model's "closing" tokens, after which EOS is likely.
_TINY_CLOSING_SHARE = 0.04
#: Standard deviation of the tiny model's logits (about 100 tokens carry most of the mass).
_TINY_LOGIT_STD = 2.5


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
        head_dim=head_dim,  # None: hidden_size // num_attention_heads
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
            _init_parameter(name, param, generator)
        flag = model.model.embed_tokens.weight[:, 0]
        flag.zero_()
        flag[closing] = model.config.hidden_size**0.5


#: Matrices that write into the residual stream: their output channel 0 is zeroed.
_WRITES_RESIDUAL = ("o_proj.weight", "down_proj.weight")
#: Matrices that read the residual stream: their input channel 0 is zeroed (``lm_head``'s EOS row is set later).
_READS_RESIDUAL = (
    "q_proj.weight",
    "k_proj.weight",
    "v_proj.weight",
    "gate_proj.weight",
    "up_proj.weight",
    "lm_head.weight",
)


def _init_parameter(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """Seed one parameter as :func:`_fill_weights` describes, keeping residual channel 0 out of reach.

    Must run under ``torch.no_grad()``.
    """
    import torch

    if name.endswith("norm.weight"):
        param.fill_(1.0)
        return
    scale = 1.0 if "embed_tokens" in name else param.shape[1] ** -0.5
    param.copy_(torch.randn(param.shape, generator=generator) * scale)
    if name.endswith(_WRITES_RESIDUAL):
        param[0].zero_()
    elif name.endswith(_READS_RESIDUAL):
        param[:, 0].zero_()


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

    anywhere, after_closing = _calibration_states(model, tokenizer, closing, generator)
    eos, weight = model.config.eos_token_id, model.lm_head.weight
    target = _eos_target_after_closing(len(tokenizer), closing.numel())
    with torch.no_grad():
        weight[eos] = 0.0
        weight.mul_(_TINY_LOGIT_STD / (anywhere @ weight.T).std())
        weight[eos, 0] = _bisect_eos_weight(after_closing[:, 0], _log_rest(after_closing, weight, eos), target)


def _log_rest(states: torch.Tensor, weight: torch.Tensor, eos: Any) -> torch.Tensor:
    """Per state, the log-sum-exp of every logit but EOS's, so that P(eos) = sigmoid(eos_logit - log_rest)."""
    import torch

    others = states @ weight.T
    others[:, eos] = -torch.inf
    return torch.logsumexp(others, dim=-1)


def _eos_target_after_closing(vocab: int, n_closing: int) -> float:
    """P(EOS right after a closing token) giving ``TINY_EOS_TARGET`` within the horizon (see :func:`_tune_lm_head`)."""
    step_p = 1.0 - (1.0 - TINY_EOS_TARGET) ** (1.0 / _TINY_HORIZON)
    return step_p * vocab / n_closing


def _calibration_states(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerBase, closing: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states after a chat prompt: over random tokens, and right after closing tokens."""
    import torch

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True, tokenize=False
    )
    prefix = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    shape = (16, _TINY_HORIZON)
    anywhere = _final_hidden(model, prefix, torch.randint(len(tokenizer), shape, generator=generator))
    picks = torch.randint(closing.numel(), shape, generator=generator)
    return anywhere, _final_hidden(model, prefix, closing[picks])


def _bisect_eos_weight(flag: torch.Tensor, log_rest: torch.Tensor, target: float) -> float:
    """The EOS weight on channel 0 whose mean EOS probability over the states is ``target`` (60 bisection steps).

    ``flag`` is channel 0 of each state and ``log_rest`` the log-sum-exp of the other logits.
    """
    import torch

    low, high = 0.0, 100.0
    for _ in range(60):
        mid = (low + high) / 2
        p = torch.sigmoid(mid * flag - log_rest).mean().item()
        low, high = (mid, high) if p < target else (low, mid)
    return (low + high) / 2


def _load_tokenizer(source: Path) -> PreTrainedTokenizerBase:
    """The tokenizer in ``source``, checked to have EOS and a chat template; padding with EOS if it has no pad."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    if tokenizer.eos_token_id is None or not tokenizer.chat_template:
        raise DaskgenError(
            f"the tokenizer in {source} lacks an eos token or a chat template; "
            "the tiny model needs both (use a SmolLM2 folder)"
        )
    if tokenizer.pad_token_id is None:  # documented choice: pad with eos, as SmolLM2 does
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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
    from transformers import GenerationConfig, LlamaForCausalLM

    tokenizer = _load_tokenizer(Path(tokenizer_from) if tokenizer_from is not None else smollm2_instruct())
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
    save_folder(model, tokenizer, out)
    return out
