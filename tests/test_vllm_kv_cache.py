"""The ``vllm`` engine's KV cache size on a CPU (:mod:`daskgen.engines.vllm.memory`): chosen to fit the memory the
engine may use unless the user set it, and named with its settings when a start fails.  No vLLM needed."""

from __future__ import annotations

import os
import time
from importlib.util import find_spec

import pytest

from daskgen.engines.cpus import ENV_MEMORY_LIMIT, worker_memory_limit
from daskgen.engines.vllm.memory import (
    GIB,
    KV_ARG,
    KV_ENV,
    MIN_KV_CACHE_BYTES,
    cpu_kv_cache,
    kv_cache_bytes,
    start_hint,
)

pytestmark = pytest.mark.timeout(120)


def test_the_size_is_a_share_of_the_memory_the_engine_may_use_less_the_weights() -> None:
    # 24 GiB machine, 22 GiB available, one worker without a limit: 0.4 x 22 GiB less 1 GiB of weights
    assert kv_cache_bytes(22 * GIB, None, None, GIB, 0.4) == int(0.4 * 22 * GIB) - GIB
    # two workers on the node share what is available
    assert kv_cache_bytes(22 * GIB, 2, None, 0, 0.4) == int(0.4 * 11 * GIB)
    # the worker's memory limit caps it
    assert kv_cache_bytes(22 * GIB, 1, 4 * GIB, 0, 0.5) == 2 * GIB
    # never below the floor, even when the weights take the share
    assert kv_cache_bytes(GIB, 1, None, 2 * GIB, 0.4) == MIN_KV_CACHE_BYTES
    # far below what vLLM itself would take on such a machine (0.92 of 24 GiB, less its own use)
    assert kv_cache_bytes(22 * GIB, None, None, 0, 0.4) < 0.92 * 24 * GIB / 2


def test_a_size_the_user_set_is_left_to_vllm(tmp_path) -> None:
    assert cpu_kv_cache(str(tmp_path), {KV_ARG: 123}, {}) == {}
    assert cpu_kv_cache(str(tmp_path), {"gpu_memory_utilization": 0.3}, {}) == {}
    assert cpu_kv_cache(str(tmp_path), {}, {KV_ENV: "2"}) == {}
    chosen = cpu_kv_cache(str(tmp_path), {}, {KV_ENV: ""})  # empty: vLLM ignores it too
    assert set(chosen) == {KV_ARG} and chosen[KV_ARG] >= MIN_KV_CACHE_BYTES


def test_the_weights_of_the_model_folder_are_left_out(tmp_path) -> None:
    import psutil

    (tmp_path / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    with_weights = cpu_kv_cache(str(tmp_path), {}, {})[KV_ARG]
    available = psutil.virtual_memory().available
    assert with_weights <= 0.4 * available - (1 << 20) + 64 * (1 << 20)  # (available moves a little meanwhile)


def test_inside_a_dask_worker_its_memory_limit_caps_the_size(tmp_path, monkeypatch) -> None:
    """A real worker with a 1 GiB limit and the engine plugin (which exports the limit for the engine): 0.4 GiB,
    whatever the machine has available.  The worker process inherits this process's environment, where an earlier
    in-process worker may have left its own limit: the test waits for this worker's."""
    from distributed import Client, LocalCluster

    monkeypatch.delenv(ENV_MEMORY_LIMIT, raising=False)

    from daskgen.worker.plugin import EnginePlugin

    with (
        LocalCluster(n_workers=1, threads_per_worker=1, processes=True, memory_limit="1GiB", dashboard_address=":0")
        as cluster,
        Client(cluster) as client,
    ):  # fmt: skip
        client.register_plugin(EnginePlugin("simulated", "sim", {}, window=1))
        deadline = time.monotonic() + 60  # the plugin starts its engine in the background
        while not all(v == str(GIB) for v in client.run(lambda: os.environ.get(ENV_MEMORY_LIMIT)).values()):
            assert time.monotonic() < deadline, "the plugin exported no memory limit"
            time.sleep(0.05)
        (size,) = client.run(lambda: cpu_kv_cache(str(tmp_path), {}, {**os.environ, KV_ENV: ""})[KV_ARG]).values()
    assert size == int(0.4 * GIB), size
    assert worker_memory_limit({ENV_MEMORY_LIMIT: "0"}) is None and worker_memory_limit({}) is None


def test_a_failed_start_names_the_size_and_both_settings() -> None:
    hint = start_hint({KV_ARG: 3 * GIB}, {})
    assert "3.00 GiB (engine arg kv_cache_memory_bytes)" in hint and KV_ENV in hint and "exit -9" in hint
    assert "5 GiB (VLLM_CPU_KVCACHE_SPACE)" in start_hint({KV_ARG: GIB}, {KV_ENV: "5"})
    assert "gpu_memory_utilization=0.92" in start_hint({}, {}) and f"--engine-arg {KV_ARG}=" in start_hint({}, {})


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.skipif(find_spec("vllm") is None, reason="needs vllm (its lane)")
def test_a_vllm_start_that_cannot_have_its_kv_cache_names_the_size_and_the_settings(tmp_path, monkeypatch) -> None:
    """The real engine asked for more KV cache than the machine has: daskgen's error says the size and how to set
    it, besides vLLM's own message."""
    import asyncio

    import psutil

    from daskgen.engines.vllm import VLLMEngine
    from daskgen.errors import EngineError
    from daskgen.models import build_tiny_model

    monkeypatch.delenv(KV_ENV, raising=False)  # the lane sets it; the engine arg must decide here
    too_much = psutil.virtual_memory().total + 64 * GIB
    model = build_tiny_model(tmp_path / "tiny", seed=0, head_dim=32)
    engine = VLLMEngine(str(model), dtype="float32", **{KV_ARG: too_much})
    with pytest.raises(EngineError) as info:
        asyncio.run(engine.start())
    message = str(info.value)
    assert f"{too_much / GIB:.2f} GiB (engine arg {KV_ARG})" in message and KV_ENV in message, message
