"""Import-only stand-in for ``sgl_kernel`` (sglang's CUDA kernel package), for the sglang CPU lane.

PyPI has no CPU build of ``sgl_kernel``, yet sglang 0.5.23 imports it at module level on the
CPU path (``SGLANG_USE_CPU_ENGINE=1``).  This package provides exactly the names those imports
ask for and nothing else.  None of them may ever run: on this path sglang's layers fall back to
plain torch because ``torch.ops.sgl_kernel`` lacks the real package's compiled ops, so a
call would mean the lane no longer tests what it claims to.  Every function therefore raises
:class:`ShimCalledError` and records the call:

* in :data:`CALLS` (this process), and
* as a JSON line in the file named by ``$DASKGEN_SGL_KERNEL_SHIM_LOG`` (every process, so a
  test can check sglang's scheduler and detokenizer subprocesses too).

Looking up a name the shim does not provide raises ``AttributeError`` (so ``from sgl_kernel
import x`` fails with ``ImportError``, as it would for a real package without ``x``) and is
logged with ``"kind": "missing"``: informative, not a failure.

Some sglang modules also look up ``torch.ops.sgl_kernel.<name>`` at import time (on the CPU path
``sglang.srt.models.qwen3_5``, which sglang's Qwen-VL image processor imports): without those names
the import fails, sglang logs "Ignore import error" and registers no image processor for the Qwen-VL
family.  The shim therefore puts the names of :data:`TORCH_OPS` on ``torch.ops.sgl_kernel``, each a
placeholder raising :class:`ShimCalledError` (and recording the call) like the functions above.
Only those names are added: sglang's checks for optional kernels (``hasattr(torch.ops.sgl_kernel,
...)``) ask for others and still find none.

Only daskgen's sglang CI lane puts this folder on ``PYTHONPATH``; it is never installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, NoReturn

#: Environment variable naming the file that receives one JSON line per recorded event.
LOG_ENV = "DASKGEN_SGL_KERNEL_SHIM_LOG"
#: Marks this module as the shim (tests check it is what ``import sgl_kernel`` found).
IS_DASKGEN_SHIM = True
#: Names of the shim functions called in this process, in call order.
CALLS: list[str] = []

#: The names sglang 0.5.23 imports from ``sgl_kernel`` on the CPU path (found by running it).
PROVIDED = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_req_to_token_pool_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


#: The ``torch.ops.sgl_kernel`` operators sglang 0.5.23 looks up at import on the CPU path (in
#: ``sglang.srt.models.qwen3_5``, imported by its Qwen-VL image processor).
TORCH_OPS = (
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
    "fused_sigmoid_mul_cpu",
)


class ShimCalledError(RuntimeError):
    """A function of the import-only ``sgl_kernel`` stand-in was called."""


def _record(kind: str, name: str) -> None:
    """Append one event to the shared log file, if one is configured."""
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps({"kind": kind, "name": name, "pid": os.getpid()})
    with open(path, "a", encoding="utf-8") as stream:
        stream.write(line + "\n")


def _placeholder(name: str) -> Callable[..., NoReturn]:
    """A function named ``name`` that records its call and raises."""

    def placeholder(*args: Any, **kwargs: Any) -> NoReturn:
        CALLS.append(name)
        _record("call", name)
        raise ShimCalledError(
            f"sgl_kernel.{name} was called, but this sgl_kernel is daskgen's import-only test shim "
            "(tests/sglang_shim): it has no kernels.  sglang took a code path that needs the real "
            "CUDA/CPU kernel package; the CPU lane must stay on the plain-torch fallbacks."
        )

    placeholder.__name__ = placeholder.__qualname__ = name
    return placeholder


for _name in PROVIDED:
    globals()[_name] = _placeholder(_name)
del _name


def _provide_torch_ops() -> None:
    """Put a placeholder for each name of :data:`TORCH_OPS` on ``torch.ops.sgl_kernel`` (a plain attribute of that
    namespace, so a call with any arguments reaches the placeholder), unless a real operator has the name."""
    import torch

    namespace = torch.ops.sgl_kernel
    for name in TORCH_OPS:
        if not hasattr(namespace, name):
            setattr(namespace, name, _placeholder(name))


_provide_torch_ops()


def __getattr__(name: str) -> Any:
    """Refuse names the shim does not provide (logged as ``missing``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    _record("missing", name)
    raise AttributeError(f"daskgen's import-only sgl_kernel shim has no {name!r}; it provides only {list(PROVIDED)}")
