"""Startup hook of the vllm CPU lane: lets PyPI's torchvision import beside torch 2.13.0+cpu, for image runs.

vLLM imports torchvision for vision-language models (its Qwen2-VL processing, through transformers' video
processor).  PyPI's torchvision 0.28.0 is the release built for torch 2.13.0, but a CUDA build: its compiled
operators (``torchvision._C``: ``nms``, ``roi_align``, ...) need torch's CUDA libraries and do not load beside the
CPU torch, and ``import torchvision`` then fails in ``torchvision._meta_registrations`` (and
``_autograd_registrations``), which register kernels for those missing operators ("operator torchvision::nms does
not exist").  This hook gives those two modules empty when, and only when, torchvision reports that its operators
did not load (``torchvision.extension._has_ops()``); everything else is the real torchvision (the transforms
transformers' image and video processors use are plain torch).  A call of a missing operator still fails loudly
(``torch.ops.torchvision`` has none of them).  Importing this hook imports nothing heavy.

Only daskgen's vllm CI lane puts this folder on ``PYTHONPATH`` (``.ci/vllm-lane``); it is never installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types

#: torchvision's modules that only register kernels for its compiled operators.
REGISTRATIONS = frozenset({"torchvision._meta_registrations", "torchvision._autograd_registrations"})
#: Marks the hook (the lane's smoke test checks it is installed).
IS_DASKGEN_TORCHVISION_HOOK = True


class _SkipRegistrations(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Gives :data:`REGISTRATIONS` as empty modules when torchvision's operators did not load."""

    def find_spec(self, name: str, path: object, target: object = None) -> importlib.machinery.ModuleSpec | None:
        extension = sys.modules.get("torchvision.extension")
        if name in REGISTRATIONS and extension is not None and not extension._has_ops():
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__doc__ = "left empty by daskgen's vllm lane: torchvision's compiled operators did not load"


sys.meta_path.insert(0, _SkipRegistrations())
