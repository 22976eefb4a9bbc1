"""LoRA adapters on the ``transformers`` engine: peft loads them onto the one base model, daskgen routes tokens.

peft (``PeftModel.from_pretrained`` and ``load_adapter``) injects every adapter's ``lora_A``/``lora_B`` into the
base model's target layers.  peft's own mixed-adapter forward (``adapter_names``) selects an adapter per *batch
row*, but transformers' continuous-batching manager packs the tokens of every running request into one row, so
the engine routes per *token*: before each forward pass :meth:`LoraRouting.route` maps each adapter to the
positions of the packed batch whose request uses it, peft's layers are switched off (``enable_adapters(False)``:
the base output), and a forward hook on each LoRA layer adds ``lora_B(lora_A(x)) * scaling`` of its adapter to
those positions only — the computation of peft's forward, token by token.  Requests without an adapter get the
base model.  Plain LoRA on linear layers is served (``bias: none``, no DoRA or other variant, no embedding
targets); other adapters are refused at start.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from daskgen.errors import EngineError

__all__ = ["LoraRouting", "attach_adapters"]


class LoraRouting:
    """Which positions of the next forward pass belong to which adapter (set by the manager's thread)."""

    def __init__(self, adapter_of: Callable[[str], str | None]) -> None:
        self.adapter_of = adapter_of  # backend request id -> adapter name (None: the base model)
        self.groups: dict[str, Any] = {}  # adapter name -> index tensor of its positions (None: all of them)

    def route(self, requests_in_batch: list[Any], device: Any) -> None:
        """Group the positions of the packed batch (requests in order, ``query_length`` tokens each) by adapter."""
        import torch

        positions: dict[str, list[int]] = {}
        offset = 0
        for future_state in requests_in_batch:
            name = self.adapter_of(future_state.state.request_id)
            if future_state.query_length is None:  # the pass is this request's alone (a vision model's backend)
                self.groups = {} if name is None else {name: None}
                return
            length = int(future_state.query_length)
            if name is not None:
                positions.setdefault(name, []).extend(range(offset, offset + length))
            offset += length
        self.groups = {name: torch.tensor(p, dtype=torch.long, device=device) for name, p in positions.items()}

    def hook(self, module: Any, args: tuple[Any, ...], output: Any) -> Any:
        """Forward hook of a LoRA linear layer: add each routed adapter's update at its positions."""
        if not self.groups:
            return output
        x = args[0]
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), output.view(-1, output.shape[-1])
        for name, index in self.groups.items():
            if name not in module.lora_A:
                continue  # this adapter leaves the layer unchanged
            lora_a, lora_b = module.lora_A[name], module.lora_B[name]
            if index is None:  # every position
                flat_out.add_(
                    (lora_b(lora_a(flat_x.to(lora_a.weight.dtype))) * module.scaling[name]).to(flat_out.dtype)
                )
                continue
            delta = lora_b(lora_a(flat_x.index_select(0, index).to(lora_a.weight.dtype))) * module.scaling[name]
            flat_out.index_add_(0, index, delta.to(flat_out.dtype))
        return output


def attach_adapters(model: Any, adapters: Mapping[str, str], routing: LoraRouting) -> Any:
    """Load ``adapters`` (name -> folder) onto ``model`` with peft and hook their layers to ``routing``.

    Returns the base model (its layers now hold every adapter) for the continuous-batching manager.
    """
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import Linear

    names = list(adapters)
    try:
        peft_model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0])
        for name in names[1:]:
            peft_model.load_adapter(adapters[name], adapter_name=name)
    except Exception as exc:  # peft raises ValueError/KeyError/OSError for adapters of another model
        raise EngineError(f"transformers engine could not load the LoRA adapters {dict(adapters)}: {exc}") from exc
    for name, config in peft_model.peft_config.items():
        if getattr(config, "bias", "none") != "none" or getattr(config, "use_dora", False):
            raise EngineError(f"LoRA adapter {name!r}: bias or DoRA adapters are not served by the transformers engine")
    for module in peft_model.modules():
        if not isinstance(module, LoraLayer):
            continue
        if not isinstance(module, Linear) or set(module.lora_variant) & set(names):
            raise EngineError(
                f"LoRA adapters {names}: a layer of type {type(module).__name__} is not served by the transformers "
                "engine (plain LoRA on linear layers only)"
            )
        module.enable_adapters(False)  # the layer gives the base output; the hook adds the routed updates
        module.register_forward_hook(routing.hook)
    return peft_model.base_model.model
