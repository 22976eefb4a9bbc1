"""Benchmark: images in prompts — preprocessing-bound throughput, bytes stored per image, memory per worker.

Three parts, one record (``--part throughput,storage,memory``):

* **throughput**: a preprocessing-bound workload, ``--prompts`` prompts each naming one distinct 2000x1500 JPEG
  and asking for a short answer (``--max-new-tokens``, fixed length), 1 sample each, on the ``simulated`` engine
  in real time (``--time-scale``; its prefill and vision-encoder costs per token are in the record) with the
  tiny Qwen2-VL's real image processor (``--max-pixels``: its pixel limit, ``0`` as built).  One engine worker;
  one run per side (``--sides``): where the images are preprocessed (the engine worker, or 1, 2, ... CPU workers
  with the ``daskgen-preprocess`` resource, ``cluster.preprocess_workers``) and
  ``daskgen.images.preprocess-threads``; ``--repeats`` times, the order alternating.  Each worker loads the image
  processor before the clock starts.  Per run, from engines ready to the last commit: prompts/s, and from the
  workers' counters the images each preprocessed, the seconds per image (decode, resize, normalize: the wall
  time of each in its thread) and how long partitions waited for their images.  Beside them the engine alone:
  the same requests (prompt and image-token counts read from a run's store) sent straight to a simulated engine
  of the same settings, without preprocessing.  The model: prompts/s <= min(engine alone, preprocessing
  threads / seconds per image); the record also gives it on paper for a node of 8 GPUs and 100 cores.
* **storage**: ``--distinct`` sample images named by ``--prompts-shared`` prompts (each image by several prompts),
  ``--n-samples`` samples each, one run with the instant engine: the bytes under the store's ``images/``
  folder against what one copy per sample would take, as the files' bytes and as decoded RGB pixels.
* **memory**: the same rows prepared in this process by the worker's :class:`ImagePreparer` (read, store,
  preprocess, place), each prompt's ``--n-samples`` samples given the row's images as the worker gives them;
  the memory they hold (``tracemalloc``: Python and numpy allocations, after the preparation) and the bytes of
  the distinct pixel arrays their samples reference, against one copy per sample: each sample's image
  preprocessed on its own, and each sample's decoded RGB pixels (how a row-per-sample pipeline holds them).

    python benchmarks/images.py                       # ~2-4 minutes on 2 cores
    python benchmarks/images.py --prompts 16 --no-record
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import os
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

from common import cli, image_workload, records, runs

TITLE = "Images: preprocessing-bound throughput, bytes stored per image, memory per worker"
ROLES = ("engine", "cpu")  # the engine worker; the CPU preprocessing workers
VOCAB = 49156  # the tiny Qwen2-VL's vocabulary: the simulated engine's ids stay in it


def engine_args(a: argparse.Namespace, time_scale: float) -> dict[str, Any]:
    """The simulated engine's settings (fixed-length answers of ``--max-new-tokens``)."""
    return {
        "time_scale": time_scale,
        "vocab_size": VOCAB,
        "length_dist": "fixed",
        "length_mean": a.max_new_tokens,
        "max_batch": a.max_batch,
        "prefill_time_per_token_s": a.prefill_per_token,
        "image_token_time_s": a.image_token_time,
    }


def run_config(a: argparse.Namespace, model: Path, prompts: Path, store: Path, n: int, time_scale: float) -> Any:
    from daskgen.config import RunConfig

    return RunConfig(
        prompts=str(prompts),
        model=str(model),
        engine="simulated",
        store=str(store),
        n_samples=n,
        engine_args=engine_args(a, time_scale),
        max_new_tokens=a.max_new_tokens,
        max_prompt_tokens=a.max_prompt_tokens,
        partition_size=a.partition_size,
        n_workers=1,
        temperature=0.0,
        progress=False,
    )


# --------------------------------------------------------------------------- throughput


def sides(text: str) -> list[tuple[int, int]]:
    """``--sides``: comma-separated ``CPU_WORKERS:THREADS`` pairs."""
    try:
        out = [(int(w), int(t)) for w, t in (item.split(":") for item in text.split(",") if item.strip())]
    except ValueError as exc:
        msg = f"--sides {text!r}: expected comma-separated CPU_WORKERS:THREADS pairs, e.g. 0:1,0:2,1:1"
        raise SystemExit(msg) from exc
    if not out or any(w < 0 or t < 1 for w, t in out):
        raise SystemExit(f"--sides {text!r}: CPU workers >= 0 and threads >= 1 in each pair")
    return out


def label(side: tuple[int, int]) -> str:
    workers, threads = side
    where = "the engine worker" if workers == 0 else f"{workers} CPU worker{'s' * (workers > 1)}"
    return f"{where}, {threads} thread{'s' * (threads > 1)}"


def one_run(a: argparse.Namespace, model: Path, prompts: Path, store: Path, side: tuple[int, int]) -> dict[str, Any]:
    """One run of the side (CPU preprocessing workers, ``preprocess-threads``); its rate and the image counters of
    the engine worker and of the CPU workers."""
    import dask

    from daskgen.worker.images import PREPROCESS_RESOURCE, image_metrics, preparer

    workers, threads = side

    def warm() -> None:  # each worker loads the image processor before the clock starts (a one-time cost)
        _ = preparer(str(model), False).processing

    def on_ready(client: Any) -> None:
        client.wait_for_workers(1 + workers, timeout=120)
        seen = set(client.run(lambda: dask.config.get("daskgen.images.preprocess-threads")).values())
        if seen != {threads}:
            raise SystemExit(f"the workers read preprocess-threads {seen}, not {threads}")
        client.run(warm)

    def on_done(client: Any) -> dict[str, dict[str, float]]:
        info = client.scheduler_info(n_workers=-1)["workers"]
        cpu = {w for w, d in info.items() if (d.get("resources") or {}).get(PREPROCESS_RESOURCE)}
        got = client.run(image_metrics)
        return {role: _summed([m for w, m in got.items() if (w in cpu) == (role == "cpu")]) for role in ROLES}

    with dask.config.set({"daskgen.images.preprocess-threads": threads}):
        config = run_config(a, model, prompts, store, 1, a.time_scale)
        if workers:
            config = dataclasses.replace(config, cluster={"kind": "local", "preprocess_workers": workers})
        summary, marks = runs.timed_run(config, None, on_ready, on_done)
    roles = marks["on_done"]
    images = roles["engine"]["images"] + roles["cpu"]["images"]
    seconds = roles["engine"]["image_seconds"] + roles["cpu"]["image_seconds"]
    return {
        "prompts": summary.generated_prompts,
        "wall": marks["generate_s"],
        "rate": summary.generated_prompts / marks["generate_s"],
        "engine images": int(roles["engine"]["images"]),
        "cpu images": int(roles["cpu"]["images"]),
        "pre_s": seconds / images if images else float("nan"),
        "wait": roles["engine"]["image_wait_s"],
    }


def _summed(metrics: list[dict[str, float]]) -> dict[str, float]:
    keys = ("images", "image_seconds", "image_wait_s")
    return {k: float(sum(m.get(k, 0.0) for m in metrics)) for k in keys}


def engine_alone(a: argparse.Namespace, store: Path) -> float:
    """Prompts/s of a simulated engine of the run's settings given the store's requests (its prompt lengths and
    image-token counts) at once, with nothing to preprocess."""
    from daskgen.engines.base import GenerationRequest, SamplingParams
    from daskgen.engines.media import ImageInput
    from daskgen.engines.simulated import SimulatedEngine
    from daskgen.store.generation_store import GenerationStore

    region = GenerationStore.open(store).read_region(0, a.prompts, ("prompt_length", "image_length"))
    requests = []
    for i, (length, spans) in enumerate(zip(region["prompt_length"], region["image_length"], strict=True)):
        images = tuple(ImageInput(f"h{i}-{k}", b"", None, (1, 1, 1), (0, int(n))) for k, n in enumerate(spans) if n)
        params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=0.0, images=images)
        requests.append(GenerationRequest(f"r{i}", [5] * int(length), params))

    async def drive() -> float:
        engine = SimulatedEngine("sim", **engine_args(a, a.time_scale))
        await engine.start()
        t0 = time.perf_counter()
        await asyncio.gather(*(engine.generate(r) for r in requests))
        seconds = time.perf_counter() - t0
        await engine.shutdown()
        return seconds

    return len(requests) / asyncio.run(drive())


def part_throughput(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """Runs per side, the order alternating; the engine alone; the model's bound per run."""
    chosen = sides(a.sides)
    model = image_workload.vision_model(work, a.max_pixels)
    images = image_workload.distinct_large_images(work / "large", a.prompts)
    prompts = image_workload.write_prompts(work / "large.jsonl", [[p] for p in images])
    got: dict[tuple[int, int], list[dict[str, Any]]] = {side: [] for side in chosen}
    stores = []
    for repeat in range(a.repeats):
        for side in chosen if repeat % 2 == 0 else chosen[::-1]:
            stores.append(work / f"throughput-{side[0]}-{side[1]}-{repeat}.zarr")
            got[side].append(one_run(a, model, prompts, stores[-1], side))
    engine_rate = engine_alone(a, stores[0])
    cores = os.cpu_count() or 1
    rows = []
    for side in chosen:
        for k, r in enumerate(got[side]):
            bound = min(engine_rate, pool(side) / r["pre_s"])
            rows.append([label(side), k + 1, r["prompts"], r["wall"], r["rate"], r["engine images"], r["cpu images"],
                         r["pre_s"], r["wait"], bound, r["rate"] / bound])  # fmt: skip
    size = f"{a.max_pixels:,} pixels" if a.max_pixels else "448x448 pixels (the tiny Qwen2-VL as built)"
    rec.note(
        "### Preprocessing-bound throughput\n\n"
        f"Workload: {a.prompts} prompts, each naming one distinct 2000x1500 JPEG "
        f"({statistics.mean(p.stat().st_size for p in images):,.0f} bytes on average), 1 sample, answers of "
        f"{a.max_new_tokens} tokens; partitions of {a.partition_size}; 1 engine worker. Image processor: the tiny "
        f"Qwen2-VL's (Qwen2VLImageProcessor), resizing to at most {size}. Engine: `simulated`, time_scale "
        f"{a.time_scale}, prefill {a.prefill_per_token} model s per prompt token, vision encoder "
        f"{a.image_token_time} model s per image token, max_batch {a.max_batch}. {cores} CPU cores. Each worker "
        "loads the image processor before the clock starts. Sides: where the images are preprocessed (the engine "
        "worker, or CPU workers started by `cluster: {kind: local, preprocess_workers: N}`) and "
        "`daskgen.images.preprocess-threads`. "
        f"Engine alone (the same requests, nothing to preprocess): **{engine_rate:.1f} prompts/s**."
    )
    rec.table(
        ["preprocessed on", "run", "prompts", "wall s", "prompts/s", "images, engine worker", "images, CPU workers",
         "preprocess s/image", "image wait s", "model bound prompts/s", "measured / bound"],
        rows,
        "Per run (engines ready to last commit). preprocess s/image: wall seconds of the processor per image in its "
        "thread. image wait s: summed over the engine worker's partitions. Model bound: min(engine alone, "
        "preprocessing threads / preprocess s per image of that run), the threads being those of the CPU workers "
        "when there are any.",
    )  # fmt: skip
    first = chosen[0]
    base = statistics.median(r["rate"] for r in got[first])
    pre_1 = statistics.median(r["pre_s"] for r in got[first])
    summary = []
    for side in chosen:
        rate = statistics.median(r["rate"] for r in got[side])
        pre = statistics.median(r["pre_s"] for r in got[side])
        summary.append([label(side), rate, pre, min(engine_rate, min(pool(side), cores) / pre_1), rate / base])
    rec.table(
        ["preprocessed on", "prompts/s (median)", "preprocess s/image (median)",
         "bound from the first side's s/image: min(engine, min(threads, cores) / s)", "prompts/s / first side's"],
        summary,
    )  # fmt: skip
    paper_model(rec, pre_1)


def pool(side: tuple[int, int]) -> int:
    """The preprocessing threads of a side: the engine worker's, or every CPU worker's."""
    workers, threads = side
    return threads * max(workers, 1)


def paper_model(rec: records.Record, pre_s: float) -> None:
    """The scaling model of preprocessing for a node of 8 GPUs and 100 cores, from the measured seconds per image."""
    rec.note(
        "### A node of 8 GPUs and 100 cores, on paper\n\n"
        "t = CPU seconds to preprocess one image on one core, m = images per prompt, R = one GPU engine's "
        "prompts/s when its images are ready, p = preprocessing threads per engine worker, c = cores given to CPU "
        "preprocessing workers (at most 100 minus the engine workers' own cores), G = 8.\n\n"
        "* preprocessing beside each engine: prompts/s = G * min(R, p / (m * t)) (p at most the cores the engine "
        "worker's process can use beside its engine);\n"
        "* preprocessing on CPU workers: prompts/s = min(G * R, c / (m * t)); the GPUs are fed when "
        "c >= G * R * m * t.\n\n"
        f"With t = {pre_s:.3f} s (the first side above) and m = 1: one core preprocesses {1 / pre_s:.1f} "
        f"images/s; 1 thread beside each of 8 engines caps the node at {8 / pre_s:.1f} prompts/s whatever R is; "
        f"100 cores at {100 / pre_s:.0f} prompts/s, which feeds 8 GPUs of up to R = {100 / pre_s / 8:.1f} "
        "prompts/s each. These are the formula's values for this machine's t, not measurements of such a node."
    )


# --------------------------------------------------------------------------- storage and memory


def shared_rows(a: argparse.Namespace, work: Path) -> tuple[list[Path], list[list[Path]]]:
    """``--distinct`` sample images and ``--prompts-shared`` rows naming them in turn (prompts share images)."""
    names = ("large", "grace_hopper", "checkerboard", "gradient", "noise", "wide", "present", "tiny")
    found = image_workload.sample_images(work / "samples")
    distinct = [found[n] for n in names[: a.distinct]]
    return distinct, [[distinct[i % len(distinct)]] for i in range(a.prompts_shared)]


def part_storage(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """One run of the shared rows; the store's images/ folder against one copy per sample."""
    import numpy as np

    from daskgen.input.image_decoding import decoded_rgb

    model = image_workload.vision_model(work / "storage-model", a.max_pixels)
    distinct, rows = shared_rows(a, work)
    prompts = image_workload.write_prompts(work / "shared.jsonl", rows)
    store = work / "storage.zarr"
    runs.timed_run(run_config(a, model, prompts, store, a.n_samples, 0.0))
    files, stored = image_workload.folder_bytes(store / "images")
    samples = [p for row in rows for p in row for _ in range(a.n_samples)]
    raw_once = sum(p.stat().st_size for p in distinct)
    raw = sum(p.stat().st_size for p in samples)
    pixels = {p: np.asarray(decoded_rgb(p.read_bytes())).nbytes for p in distinct}
    decoded = sum(pixels[p] for p in samples)
    rec.note(
        "### Bytes per image stored\n\n"
        f"{len(distinct)} distinct images named by {len(rows)} prompts, {a.n_samples} samples each "
        f"({len(samples)} samples with an image), instant engine. The store's images/ folder: {files} files."
    )
    rec.table(
        ["what", "objects", "bytes", "bytes per object", "bytes / the store's"],
        [
            ["store's images/ folder", files, stored, stored / files, 1.0],
            ["the distinct input files, once", len(distinct), raw_once, raw_once / len(distinct), raw_once / stored],
            ["one file copy per sample", len(samples), raw, raw / len(samples), raw / stored],
            ["decoded RGB pixels per sample", len(samples), decoded, decoded / len(samples), decoded / stored],
        ],
    )
    rec.note(f"Deduplication ratio (one file copy per sample / the store's images/ bytes): **{raw / stored:.1f}x**.")


def part_memory(a: argparse.Namespace, work: Path, rec: records.Record) -> None:
    """The shared rows prepared by the worker's preparer, samples sharing their row's images, against one
    preprocessed copy per sample and one decoded copy per sample; tracemalloc for each side."""
    import numpy as np

    from daskgen.engines.base import SamplingParams
    from daskgen.input.image_decoding import decoded_rgb
    from daskgen.store.location import locate
    from daskgen.worker.images import ImagePreparer

    model = image_workload.vision_model(work / "memory-model", a.max_pixels)
    _, rows = shared_rows(a, work)
    preparer = ImagePreparer(str(model))
    vision = preparer.vision  # loads the processor before anything is traced
    block = [vision.start, vision.image, vision.end]
    inputs = [{"image_urls": [str(p) for p in row]} for row in rows]
    prompt_ids = [block * len(row) + [5, 6, 7] for row in rows]
    base = SamplingParams(max_new_tokens=a.max_new_tokens)

    def traced(build: Any) -> tuple[int, Any]:
        gc.collect()
        tracemalloc.start()
        kept = build()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return held, kept

    def shared() -> list[Any]:
        _, placed = asyncio.run(preparer.prepare(inputs, prompt_ids, locate(work / "memory-store")))
        return [dataclasses.replace(base, images=row.images) for row in placed for _ in range(a.n_samples)]

    held_shared, samples = traced(shared)
    arrays = [image.pixel_values for sample in samples for image in sample.images]
    distinct_bytes = sum(x.nbytes for x in {id(x): x for x in arrays}.values())
    per_sample_bytes = sum(x.nbytes for x in arrays)
    del samples, arrays
    processing = preparer.processing
    files = [Path(url) for row in inputs for url in row["image_urls"] for _ in range(a.n_samples)]
    held_copies, copies = traced(lambda: [processing.process(p.read_bytes()).pixel_values for p in files])
    copies_bytes = sum(x.nbytes for x in copies)
    del copies
    held_decoded, decoded = traced(lambda: [np.asarray(decoded_rgb(p.read_bytes())) for p in files])
    decoded_bytes = sum(x.nbytes for x in decoded)
    del decoded
    rec.note(
        "### Host memory per worker\n\n"
        f"The storage part's {len(rows)} prompts x {a.n_samples} samples prepared by one worker's ImagePreparer in "
        "this process; held: tracemalloc's traced memory after each side was built (gc run), everything it "
        "keeps alive (pixel arrays, image bytes, the preparer's cache)."
    )
    rec.table(
        ["side", "held (tracemalloc) bytes", "bytes of the pixel arrays referenced", "held / daskgen's"],
        [
            ["daskgen: one preprocessed array per image, shared by its prompts' samples", held_shared,
             distinct_bytes, 1.0],
            ["one preprocessed copy per sample", held_copies, copies_bytes, held_copies / held_shared],
            ["one decoded RGB copy per sample", held_decoded, decoded_bytes, held_decoded / held_shared],
        ],
    )  # fmt: skip
    rec.note(
        f"The samples' image references, counted once per sample, would be {per_sample_bytes:,} bytes of pixel "
        f"arrays; they point to {distinct_bytes:,} bytes of distinct arrays "
        f"({per_sample_bytes / distinct_bytes:.1f}x fewer)."
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = cli.parser(__doc__)
    p.add_argument("--part", default="throughput,storage,memory", help="throughput, storage, memory")
    p.add_argument(
        "--sides",
        default="0:1,0:2,1:1,1:2",
        help="throughput: CPU_WORKERS:THREADS pairs (preprocessing workers, "
        "daskgen.images.preprocess-threads), comma-separated; 0 workers: the engine worker preprocesses",
    )
    p.add_argument("--max-pixels", type=int, default=0, help="the image processor's pixel limit (0: as built)")
    p.add_argument("--max-batch", type=int, default=64, help="simulated engine: requests running at once")
    p.add_argument("--prefill-per-token", type=float, default=0.0002, help="simulated: model s per prompt token")
    p.add_argument("--image-token-time", type=float, default=0.0005, help="simulated: model s per image token")
    p.add_argument("--distinct", type=int, default=4, help="storage, memory: distinct sample images (1-8)")
    p.add_argument("--prompts-shared", type=int, default=8, help="storage, memory: prompts naming them in turn")
    cli.add_flags(
        p, prompts=32, n_samples=8, max_new_tokens=4, time_scale=0.05, partition_size=4, max_prompt_tokens=2048,
        repeats=1,
    )  # fmt: skip
    return cli.parse(p, argv)


PARTS = {"throughput": part_throughput, "storage": part_storage, "memory": part_memory}

if __name__ == "__main__":
    raise SystemExit(cli.run_parts(parse_args(), TITLE, PARTS))
