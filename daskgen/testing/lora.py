"""LoRA test material: a small seeded adapter made with peft, and the merged model's greedy output to compare with.

:func:`make_adapter` saves a LoRA adapter for a (tiny) causal LM whose ``lora_B`` weights are non-zero (peft
initialises them to zero, which would leave outputs unchanged), so it changes greedy outputs;
:func:`merged_greedy` is the reference an engine's greedy output with that adapter must equal: the adapter merged
into the weights (``merge_and_unload``) and decoded greedily by transformers itself.  Heavy imports (torch,
transformers, peft) happen inside functions only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["make_adapter", "merged_greedy"]

#: The projections a test adapter targets (every attention and MLP projection of a Llama-style model).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(model: str | Path, path: str | Path, *, seed: int = 0, rank: int = 8, scale: float = 0.5) -> Path:
    """Save a LoRA adapter of ``rank`` for ``model`` into ``path`` (seeded; ``lora_B`` drawn, not zero).

    ``scale`` is the standard deviation of the ``lora_B`` entries: large enough that the adapter changes a tiny
    model's greedy output within a few tokens.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGETS), lora_dropout=0.0, bias="none")
    peft_model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (scale if "lora_B" in name else 0.3))
    peft_model.save_pretrained(str(path))
    return Path(path)


def merged_greedy(
    model: str | Path,
    adapter: str | Path | None,
    prompt: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int] | None = None,
) -> list[int]:
    """Greedy output ids of ``model`` with ``adapter`` merged into its weights (``None``: the base model), float32,
    ending at ``eos_ids`` (default: the model's own generation config)."""
    import torch
    from transformers import AutoModelForCausalLM

    net: Any = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, str(adapter)).merge_and_unload()
    with torch.no_grad():
        out = net.eval().generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            **({} if eos_ids is None else {"eos_token_id": list(eos_ids)}),
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :]]
