"""Prefix-aware dispatch: shared-prefix keys at input scan, a partition's requests sent in prompt order, partitions
routed to the worker that ran their key (with fallback), the simulated engine's prefix cache, and real runs on a
two-worker cluster."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from distributed import Client, LocalCluster

import daskgen
from daskgen.client.prefix_dispatch import TaskPool, partition_key, resolve_prefix
from daskgen.engines.base import SamplingParams
from daskgen.engines.simulated.engine import SimulatedEngine
from daskgen.engines.simulated.prefix_cache import PrefixCache
from daskgen.input.prefix import NO_KEY, PrefixScan, choose_prefix_length
from daskgen.input.rows import InputScan, tokenize_rows
from daskgen.input.tokenizer import ByteTokenizer
from daskgen.store.generation_store import GenerationStore
from daskgen.store.layout import DONE
from daskgen.worker.prefix_order import AlternatingOrder, gather_in_prompt_order, prompt_order
from daskgen.worker.task import PartitionTask

SYSTEMS = [f"System {k}: " + "you answer briefly and exactly. " * 6 for k in range(2)]


def chat_rows(systems: list[str], questions: int, seed: int = 0) -> list[dict]:
    """Every system prompt with every question, shuffled."""
    rows = [
        {"messages": [{"role": "system", "content": s}, {"role": "user", "content": f"Question {q}: {q} + {q}?"}]}
        for s in systems
        for q in range(questions)
    ]
    random.Random(seed).shuffle(rows)
    return rows


def keys_of(rows: list[dict]):
    scan = PrefixScan()
    for tokens in tokenize_rows(rows, ByteTokenizer()):
        scan.add(tokens)
    return scan.result()


def test_the_prefix_length_is_where_the_shared_system_prompt_ends():
    rows = chat_rows(SYSTEMS, 12)
    tokens = tokenize_rows(rows, ByteTokenizer())
    system_end = len(ByteTokenizer().apply_chat_template(rows[0]["messages"][:1], add_generation_prompt=False))
    n = choose_prefix_length(tokens, 32)
    assert system_end <= n < system_end + len("user: Question ") + 1, "not cut inside the system prompt or a question"
    keys = keys_of(rows)
    assert keys.n_keys == 2 and keys.share() == 1.0 and keys.worth_it()
    by_system = {r["messages"][0]["content"]: set() for r in rows}
    for row, key in zip(rows, keys.keys, strict=True):
        by_system[row["messages"][0]["content"]].add(int(key))
    assert sorted(len(k) for k in by_system.values()) == [1, 1] and len(set.union(*by_system.values())) == 2


def test_prompts_without_a_shared_prefix_keep_input_order():
    rng = random.Random(1)
    rows = [{"prompt": " ".join(rng.choice("abcdefgh") * 3 for _ in range(30))} for _ in range(40)]
    keys = keys_of(rows)
    assert keys.n_keys == 0 and not keys.worth_it()
    scan = InputScan(rows, len(rows), [], "fp", prefix=keys)
    assert resolve_prefix("auto", scan, None, ByteTokenizer(), None) is None
    assert resolve_prefix("prefix", scan, None, ByteTokenizer(), None) is None


def test_auto_goes_by_prefix_for_shuffled_and_grouped_inputs():
    shuffled = InputScan([], 24, [], "fp", prefix=keys_of(chat_rows(SYSTEMS, 12)))
    assert resolve_prefix("order", shuffled, None, ByteTokenizer(), None) is None
    assert resolve_prefix("auto", shuffled, None, ByteTokenizer(), None) is shuffled.prefix
    assert resolve_prefix("prefix", shuffled, None, ByteTokenizer(), None) is shuffled.prefix


def test_a_partition_has_the_key_of_most_of_its_rows_else_none():
    keys = np.array([0, 1, 0, 0, 1, NO_KEY, NO_KEY, 1], dtype=np.int32)
    assert partition_key(keys, [0, 1, 2, 3]) == 0
    assert partition_key(keys, [0, 1]) == NO_KEY, "no key holds more than half the rows"
    assert partition_key(keys, [4, 5, 6, 7]) == NO_KEY and partition_key(keys, [5, 6]) == NO_KEY
    assert partition_key(keys, [4, 5, 7]) == 1


def task(start: int, rows: list[int], key: int = NO_KEY) -> PartitionTask:
    inputs = [{"prompt": f"row {r}"} for r in rows]
    return PartitionTask(None, start, start + 4, rows, None, 1, SamplingParams(), 0, inputs=inputs, prefix_key=key)  # type: ignore[arg-type]


def test_a_free_worker_gets_its_own_key_else_any_task():
    tasks = [task(0, [0], 0), task(4, [4], 1), task(8, [8], 0), task(12, [12], 1), task(16, [16], 0)]
    pool = TaskPool(iter(tasks), lookahead_rows=100)
    first, second = pool.take("a"), pool.take("b")
    assert (first.prefix_key, second.prefix_key) == (0, 1), "a key no worker holds goes to a worker without one"
    assert pool.take("a").prefix_key == 0 and pool.take("b").prefix_key == 1, "each worker keeps its key"
    assert pool.take("b").prefix_key == 0, "b's key is used up: b is not left idle, it takes another key"
    assert pool.take("a") is None
    assert [k for _, k, _ in pool.placed] == [0, 1, 0, 1, 0]
    in_order = TaskPool(iter([task(0, [0], 1), task(4, [4], 0)]))  # no look-ahead: input order
    assert [in_order.take("a").start, in_order.take("a").start] == [0, 4]


def test_the_simulated_prefix_cache_counts_what_it_held():
    cache = PrefixCache(capacity=64, block=4)
    system = list(range(10, 30))  # 20 tokens: 5 blocks
    assert cache.admit(system + [1, 2]) == 0
    assert cache.admit(system + [3, 4, 5]) == 20, "the shared blocks are cached, the partial last one is not"
    assert cache.admit([9] + system) == 0, "a block matches only under the same prefix"
    for i in range(20):  # other prompts push the system prompt out (16 blocks at most)
        cache.admit([100 + i] * 8)
    assert cache.admit(system) == 0
    assert PrefixCache(capacity=0).admit(system) == 0


def test_calls_start_in_prompt_order_and_results_come_back_in_row_order():
    prompts = [[5, 1], [1, 2, 3], [5, 0], [1, 2]]
    assert prompt_order(prompts, range(4)) == [3, 1, 2, 0]
    assert prompt_order(prompts, [0, 2]) == [1, 0]
    started: list[tuple[int, int]] = []

    async def call(row: int, sample: int) -> tuple[int, int]:
        started.append((row, sample))
        await asyncio.sleep(0)
        return row, sample

    calls = [call(r, s) for r in range(4) for s in range(2)]
    results = asyncio.run(gather_in_prompt_order(calls, prompt_order(prompts, range(4)), per_row=2))
    assert results == [(r, s) for r in range(4) for s in range(2)]
    assert [r for r, _ in started] == [3, 3, 1, 1, 2, 2, 0, 0]


def test_an_engines_partitions_alternate_their_prompt_order_so_each_starts_with_the_last_prefixes():
    prompts = [[7, 1], [3, 1], [7, 2], [5, 0], [3, 2], [3, 1]]
    order = AlternatingOrder()
    first, second, third = (order.order(prompts, range(6)) for _ in range(3))
    assert first == [1, 5, 4, 3, 0, 2]  # ascending; equal prompts keep row order
    assert second == [2, 0, 3, 4, 1, 5]  # descending: the prefixes sent last come first; ties still in row order
    assert third == first
    groups = [prompts[k][0] for k in second]
    assert groups == sorted(groups, reverse=True)  # a shared prefix's rows stay together either way


def test_a_small_prefix_cache_keeps_more_prefixes_when_partitions_alternate():
    """Partitions of 8 keys each, on an engine whose cache holds 6 prefixes (least recently used evicted):
    sorting every partition the same way finds every prefix evicted; alternating finds the last ones held."""
    system = {key: [key] * 64 for key in range(8)}
    partitions = [[system[key] + [q] for key in range(8)] for q in range(20)]

    def computed(order_of) -> int:
        cache, total = PrefixCache(capacity=6 * 64, block=16), 0
        for prompts in partitions:
            for k in order_of(prompts):
                total += len(prompts[k]) - cache.admit(prompts[k])
        return total

    alternating_order = AlternatingOrder()
    same = computed(lambda prompts: prompt_order(prompts, range(len(prompts))))
    alternating = computed(lambda prompts: alternating_order.order(prompts, range(len(prompts))))
    assert same == 20 * 8 * 65  # every prefix computed again every time
    assert alternating < 0.8 * same


@pytest.fixture(scope="module")
def two_workers():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster:
        yield cluster.scheduler_address


def prefill_tokens(dask_worker) -> int:
    """``client.run`` target: the prompt tokens this worker's simulated engine computed in the last run."""
    return dask_worker.plugins["daskgen-engine"].engine.stats()["prefill_tokens"]


def run_on(
    address: str, rows: list[dict], path, dispatch: str, partition_size: int = 4, engine: str = "simulated"
) -> tuple[GenerationStore, int]:
    engine_args = {"time_scale": 0, "length_dist": "fixed", "length_mean": 4, "prefix_cache_tokens": 256}
    daskgen.generate(
        rows,
        model="sim",
        engine=engine,
        engine_args=engine_args,
        store=str(path),
        max_new_tokens=8,
        max_prompt_tokens=512,
        partition_size=partition_size,
        scheduler_address=address,
        dispatch=dispatch,
        progress=False,
    )
    with Client(address) as client:
        computed = sum(client.run(prefill_tokens).values())
    return GenerationStore.open(path), computed


def computed_in_store(store: GenerationStore) -> int:
    """Prompt tokens computed, from the store: every sample's prompt less what the engine's cache held."""
    data = store.read_region(0, store.layout.n_prompts, ("prompt_length", "cached_prompt_tokens"))
    assert (data["cached_prompt_tokens"] >= 0).all(), "the simulated engine with a cache reports every sample's"
    return int(data["prompt_length"].sum() * store.layout.n_samples - data["cached_prompt_tokens"].sum())


def test_prompt_order_computes_fewer_prefix_tokens_and_keeps_every_row(two_workers, tmp_path):
    rows = chat_rows(SYSTEMS, 8)
    store, by_prefix = run_on(two_workers, rows, tmp_path / "p.zarr", "prefix", partition_size=16)
    record = store.attrs.dispatch
    assert record["mode"] == "prefix" and record["prefix"]["n_keys"] == 2 and record["n_tasks"] == 1
    assert record["tasks"][0][1] == NO_KEY, "a partition mixing both keys has none"
    data = store.read_region(0, len(rows), ("prompt_ids", "prompt_length", "response_length"))
    assert (store.read_status() == DONE).all(), "every row is committed"
    for r, ids in enumerate(tokenize_rows(rows, ByteTokenizer())):  # results back in row order
        assert data["prompt_length"][r] == len(ids) and list(data["prompt_ids"][r][: len(ids)]) == ids
    assert (data["response_length"] == 4).all()
    ordered, by_order = run_on(two_workers, rows, tmp_path / "o.zarr", "order", partition_size=16)
    assert by_prefix < by_order, (by_prefix, by_order)
    for engines, written in ((by_prefix, store), (by_order, ordered)):  # the counters add 1-token health checks
        assert 0 <= engines - computed_in_store(written) <= 4, (engines, computed_in_store(written))


def test_partitions_of_a_key_go_to_the_worker_that_ran_it(two_workers, tmp_path):
    rows = sorted(chat_rows(SYSTEMS, 16), key=lambda r: r["messages"][0]["content"])  # 4 partitions per key
    store, _ = run_on(two_workers, rows, tmp_path / "g.zarr", "prefix")
    record = store.attrs.dispatch
    assert record["n_tasks"] == 8 and {k for _, k, _ in record["tasks"]} == {0, 1}
    workers_of = {key: {w for _, k, w in record["tasks"] if k == key} for key in (0, 1)}
    assert workers_of[0] | workers_of[1] == {0, 1}, "both workers busy: no worker idles for its key"
    assert all(len(w) == 1 for w in workers_of.values()), record["tasks"]
    assert (store.read_status() == DONE).all()
    store, _ = run_on(two_workers, chat_rows(SYSTEMS, 4), tmp_path / "order.zarr", "order")
    assert store.attrs.dispatch["mode"] == "order"


class PrefixAdmitting(SimulatedEngine):
    """Test double: the simulated engine declaring that, with ``max_batch: 7`` added to its args, it admits its
    waiting requests by shared prefix itself (as sglang does under ``lpm``); it keeps its requests' arrival order."""

    arrived: list[str] = []

    @classmethod
    def prefix_admission(cls, engine_args):
        return {**engine_args, "max_batch": 7}, True

    def generate_batch(self, requests):
        type(self).arrived += [r.request_id for r in requests]
        return super().generate_batch(requests)


def engines_max_batch(dask_worker) -> int:
    return dask_worker.plugins["daskgen-engine"].engine.args.max_batch


def test_an_engine_that_admits_by_prefix_gets_its_args_and_each_partition_in_input_order(two_workers, tmp_path):
    rows = chat_rows(SYSTEMS, 8)
    store, _ = run_on(two_workers, rows, tmp_path / "s.zarr", "prefix", 8)
    assert store.attrs.dispatch["prompt_order"] is True, "the simulated engine gets its partitions sorted"
    double = f"{__name__}:PrefixAdmitting"
    run_on(two_workers, [{"prompt": f"{i} is a number"} for i in range(16)], tmp_path / "plain.zarr", "auto", 8, double)
    with Client(two_workers) as client:
        assert set(client.run(engines_max_batch).values()) != {7}, "no shared prefix: the run's own engine args"
    PrefixAdmitting.arrived = []
    store, _ = run_on(two_workers, rows, tmp_path / "a.zarr", "prefix", 8, double)
    with Client(two_workers) as client:
        assert set(client.run(engines_max_batch).values()) == {7}, "dispatched by prefix: the engine's additions"
    record = store.attrs.dispatch
    assert record["mode"] == "prefix" and record["prompt_order"] is False
    assert (store.read_status() == DONE).all()
    arrived = [int(request_id[1:].split("-")[0]) for request_id in PrefixAdmitting.arrived]
    assert sorted(arrived) == list(range(len(rows)))
    for start in range(0, len(rows), 8):  # each partition's rows arrived in row order (partitions in any order)
        rows_of = [r for r in arrived if start <= r < start + 8]
        assert rows_of == sorted(rows_of), rows_of
    prompts = tokenize_rows(rows, ByteTokenizer())
    unsorted = [s for s in range(0, len(rows), 8) if prompts[s : s + 8] != sorted(prompts[s : s + 8])]
    assert unsorted, "some partition's row order is not its prompt order"
