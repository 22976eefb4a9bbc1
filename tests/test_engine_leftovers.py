"""An engine start and stop leaves the machine's shared folders as it found them (the sglang and vLLM lanes).

sglang (in process, and the managed server of the ``openai`` engine) makes a load-report file in the
shared-memory folder (``/dev/shm/sglang_loads_*.shm``); vLLM's processes make a ``torch.distributed``
rendezvous file (``vllm_dist_*``) and ZeroMQ sockets in the temporary folder.  Each test checks that the
engine made its files while it ran (so the check can fail) and that after its shutdown the folder holds
none that were not there before (:mod:`daskgen.engines.leftovers`).  Each lane runs its tests one at a time, so
no other engine adds files meanwhile.
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from daskgen.engines.leftovers import SGLANG_LOADS, SHARED_MEMORY

pytestmark = pytest.mark.timeout(900)

#: What vLLM's processes make in the temporary folder: the rendezvous file, ZeroMQ sockets named by a uuid, and
#: the folder daskgen gives them.
VLLM_NAMES = re.compile(
    r"vllm_dist_[0-9a-f]{32}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|daskgen-vllm-tmp-.*"
)


def sglang_loads() -> set[str]:
    return {name for name in os.listdir(SHARED_MEMORY) if name.startswith(SGLANG_LOADS)}


def vllm_files() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if VLLM_NAMES.fullmatch(name)}


def start_and_stop(engine: Any, while_running) -> Any:
    """Start ``engine``, call ``while_running()`` (what it made), shut the engine down; what it made."""

    async def cycle() -> Any:
        try:
            await engine.start()
            return while_running()
        finally:
            await engine.shutdown()

    return asyncio.run(cycle())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from daskgen.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("leftovers") / "tiny", seed=0, head_dim=32))


def _sglang_engine(name: str, model: str) -> Any:
    if name == "sglang":
        from daskgen.engines.sglang import SGLangEngine

        return SGLangEngine(model)
    from daskgen.engines.http import OpenAIEngine

    return OpenAIEngine(model, managed=True, server_start_timeout_s=600)


@pytest.mark.sglang
@pytest.mark.skipif(find_spec("sglang") is None, reason="needs sglang (its lane)")
@pytest.mark.parametrize("name", ["sglang", "sglang-server"])
def test_sglang_leaves_no_load_report_file_in_shared_memory(name: str, tiny: str) -> None:
    before = sglang_loads()
    made = start_and_stop(_sglang_engine(name, tiny), lambda: sglang_loads() - before)
    assert made, "the engine made no load-report file while it ran (nothing this test could see left over)"
    assert sglang_loads() - before == set(), f"left in {SHARED_MEMORY}: {sorted(sglang_loads() - before)}"


@pytest.mark.vllm
@pytest.mark.skipif(find_spec("vllm") is None, reason="needs vllm (its lane)")
def test_vllm_leaves_nothing_in_the_temporary_folder(tiny: str) -> None:
    from daskgen.engines.vllm import VLLMEngine

    before = vllm_files()

    def made_while_running() -> set[str]:
        (folder,) = [Path(tempfile.gettempdir(), n) for n in vllm_files() - before if n.startswith("daskgen-vllm-tmp-")]
        return set(os.listdir(folder))

    engine = VLLMEngine(tiny, dtype="float32", max_model_len=1024)
    made = start_and_stop(engine, made_while_running)
    assert any(VLLM_NAMES.fullmatch(name) for name in made), f"vLLM made none of its files in its folder: {made}"
    assert vllm_files() - before == set(), f"left in {tempfile.gettempdir()}: {sorted(vllm_files() - before)}"
