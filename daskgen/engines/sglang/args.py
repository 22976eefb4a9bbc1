"""The ``sglang.Engine`` / ``launch_server`` arguments: daskgen's defaults and their validation.

Shared by the in-process engine (:mod:`daskgen.engines.sglang.engine`) and the managed HTTP server
(:mod:`daskgen.engines.openai.server`): :func:`launch_kwargs` fills in the model, the device and,
on CPU, :data:`CPU_DEFAULTS`; :func:`check_engine_args` refuses names sglang's ``ServerArgs``
does not know, suggesting close matches.  Importing this module does not import sglang.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from daskgen.engines.args import check_known_args
from daskgen.errors import ConfigError
from daskgen.ranges import number

__all__ = [
    "CPU_DEFAULTS",
    "PREFIX_ARGS",
    "prefix_admission",
    "check_engine_args",
    "is_cpu_device",
    "launch_kwargs",
    "LORA_ON_CPU",
    "lora_refusal",
    "refuse_model_path",
    "server_arg_names",
]

#: Options filled in, when unset, for a run dispatched by prefix.  ``schedule_policy: lpm`` (longest prefix match;
#: sglang's own default is ``fcfs``): sglang admits first the waiting requests its radix cache serves most of and
#: holds back a waiting request that shares its prefix with another one waiting, so a prefix shared by requests
#: that wait together is computed once, not once each.  sglang falls back to ``fcfs`` while over 128 requests wait.
PREFIX_ARGS: dict[str, Any] = {"schedule_policy": "lpm"}

#: sglang's schedule policies that admit waiting requests by what they share with the radix cache and each other.
PREFIX_POLICIES = frozenset({"lpm", "dfs-weight"})

#: ``sglang.Engine`` options filled in on CPU when ``engine_args`` does not set them.  float32
#: matches the ``transformers`` engine's CPU default (sglang's ``auto`` would pick float16).  ``sleep_on_idle``: an
#: idle sglang scheduler otherwise polls for requests without pause, holding a whole core the machine's other work
#: (the worker, preprocessing, other engines) needs.
CPU_DEFAULTS: dict[str, Any] = {
    "attention_backend": "torch_native",
    "dtype": "float32",
    "max_total_tokens": 16384,
    "sleep_on_idle": True,
}

_MODEL_PATH_ERROR = "sglang engine: give the model as daskgen's `model`, not as engine_args['model_path']"


def refuse_model_path(engine_args: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` when ``engine_args`` names the model (daskgen's ``model`` does)."""
    if "model_path" in engine_args:
        raise ConfigError(_MODEL_PATH_ERROR)


def server_arg_names() -> list[str]:
    """Names of the keyword arguments ``sglang.Engine`` accepts (its ``ServerArgs`` fields).

    Imports sglang (a few seconds); set ``SGLANG_USE_CPU_ENGINE`` before calling on a CPU.
    """
    import msgspec
    from sglang.srt.server_args import ServerArgs

    return sorted(f.name for f in msgspec.structs.fields(ServerArgs) if not f.name.startswith("_"))


def check_engine_args(engine_args: Mapping[str, Any], valid: list[str] | None = None) -> None:
    """Raise :class:`ConfigError` for keys of ``engine_args`` that sglang does not know.

    ``valid`` defaults to :func:`server_arg_names` (which imports sglang).  The message suggests
    close matches and lists every valid name.
    """
    refuse_model_path(engine_args)
    names = server_arg_names() if valid is None else valid
    check_known_args("sglang", engine_args, names, "sglang ServerArgs fields (they are passed to sglang.Engine)")


def launch_kwargs(
    model: str, engine_args: Mapping[str, Any], cuda_available: bool, adapters: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The keyword arguments for ``sglang.Engine``: ``engine_args`` plus daskgen's defaults.

    The device is ``engine_args['device']`` or, when absent, ``cuda`` if available else
    ``cpu``; on CPU the :data:`CPU_DEFAULTS` fill options ``engine_args`` leaves unset.
    LoRA ``adapters`` (name -> folder) fill ``enable_lora``, ``lora_paths`` (``NAME=PATH``) and
    ``max_loras_per_batch`` (every adapter and the base model in one batch), and on CPU ``lora_backend``
    ``torch_native`` (sglang's default backend runs Triton kernels).
    """
    kwargs = dict(engine_args)
    kwargs["model_path"] = model
    device = kwargs.get("device") or ("cuda" if cuda_available else "cpu")
    kwargs["device"] = device
    if is_cpu_device(device):
        for key, value in CPU_DEFAULTS.items():
            kwargs.setdefault(key, value)
    if adapters:
        lora = {"enable_lora": True, "lora_paths": [f"{name}={path}" for name, path in adapters.items()]}
        lora["max_loras_per_batch"] = len(adapters) + 1
        if is_cpu_device(device):
            lora["lora_backend"] = "torch_native"
        for key, value in lora.items():
            kwargs.setdefault(key, value)
    return kwargs


#: Why sglang serves no LoRA adapter on a CPU (the plan refuses such a run before any engine starts).
LORA_ON_CPU = (
    "sglang's LoRA layers allocate pinned host memory (torch.tensor(..., pin_memory=True) in "
    "sglang/srt/lora/layers.py), which needs CUDA: on a CPU the engine fails to start ('Found no NVIDIA driver on "
    "your system'). Run on a CUDA GPU (--engine-arg device=cuda when the workers have a GPU this machine lacks), "
    "or use the transformers or vllm engine, which serve LoRA adapters on a CPU"
)


#: The sampling values sglang 0.5.23 refuses per request that daskgen's table allows
#: (``sglang/srt/sampling/sampling_params.py``, ``SamplingParams.verify``).
SAMPLING_RANGES = {"repetition_penalty": number(0, 2, low_open=True, note="1 = off; sglang's maximum is 2")}


def lora_refusal(engine_args: Mapping[str, Any], cuda_available: Callable[[], bool]) -> dict[str, str]:
    """``{feature: reason}`` for the LoRA features when the engine's device is the CPU: ``engine_args['device']`` or,
    when absent, the CPU unless ``cuda_available()`` (as :func:`launch_kwargs` picks it)."""
    device = engine_args.get("device") or ("cuda" if cuda_available() else "cpu")
    return dict.fromkeys(("lora", "refresh_with_lora"), LORA_ON_CPU) if is_cpu_device(device) else {}


def is_cpu_device(device: str) -> bool:
    """Whether an sglang ``device`` string (``"cpu"``, ``"cuda:1"``...) names the CPU."""
    return str(device).split(":", 1)[0] == "cpu"


def prefix_admission(engine_args: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """``engine_args`` with :data:`PREFIX_ARGS` filled in, and whether sglang then admits its waiting requests by
    shared prefix itself (its ``schedule_policy`` one of :data:`PREFIX_POLICIES`)."""
    args = {**PREFIX_ARGS, **engine_args}
    return args, args["schedule_policy"] in PREFIX_POLICIES
