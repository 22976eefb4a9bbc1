"""The training side of distill.sbatch: the finished samples of its store as a PyTorch dataset for distillation.

    python loader.py /scratch/$USER/distill.zarr          # prints the first sample and counts the rest

Each item is one finished sample: ``input_ids`` (the prompt's tokens, then the response's), ``labels`` (the
response's tokens, -100 over the prompt), ``teacher_ids`` and ``teacher_logprobs`` (the teacher's top-k tokens
and their log-probabilities at each response position, most likely first) and the row's kept input columns.
The store is read one partition (a chunk of ``partition_size`` prompts) at a time, so memory stays that of one
partition however large the store is; each DataLoader worker reads its own share of the partitions, and
``shuffle_seed`` shuffles the partitions and the samples within each.  Samples cut at ``max_new_tokens``
(finish reason ``length``) are left out unless ``keep_truncated``; rows not done (pending, failed) always are.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import daskgen

STOP, LENGTH = 0, 1  # finish_reason values (the store's flag_values)
ARRAYS = ("status", "prompt_ids", "prompt_length", "response_ids", "response_length", "finish_reason")
TEACHER = ("top_logprob_ids", "top_logprobs")


class DistillSamples(IterableDataset):
    """The finished samples of a daskgen store, read one partition at a time."""

    def __init__(self, store: str, shuffle_seed: int | None = None, keep_truncated: bool = False) -> None:
        self.store, self.shuffle_seed, self.keep_truncated = store, shuffle_seed, keep_truncated
        ds = daskgen.open_store(store)
        self.columns = [name for name in ds.data_vars if name.startswith("column_")]
        self.teacher = all(name in ds for name in TEACHER)
        sizes = ds["response_ids"].chunks[0]  # one dask chunk per partition (or per shard of a packed store)
        starts = np.cumsum((0, *sizes[:-1]))
        self.partitions = [(int(start), int(start + size)) for start, size in zip(starts, sizes, strict=True)]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        mine = self.partitions[worker.id :: worker.num_workers] if worker else list(self.partitions)
        rng = random.Random(self.shuffle_seed)
        if self.shuffle_seed is not None:
            rng.shuffle(mine)
        ds = daskgen.open_store(self.store)
        names = [*ARRAYS, *(TEACHER if self.teacher else ()), *self.columns]
        for start, stop in mine:
            part = ds[names].isel(prompt=slice(start, stop)).load()
            items = list(self._samples(part))
            if self.shuffle_seed is not None:
                rng.shuffle(items)
            yield from items

    def _samples(self, part: Any) -> Iterator[dict[str, Any]]:
        finish = part["finish_reason"].values
        keep = (STOP, LENGTH) if self.keep_truncated else (STOP,)
        for p in np.flatnonzero(part["status"].values == 1):  # done rows only
            prompt = part["prompt_ids"].values[p, : int(part["prompt_length"].values[p])]
            for s in np.flatnonzero(np.isin(finish[p], keep)):
                n = int(part["response_length"].values[p, s])
                response = part["response_ids"].values[p, s, :n]
                item: dict[str, Any] = {
                    "input_ids": torch.from_numpy(np.concatenate([prompt, response]).astype(np.int64)),
                    "labels": torch.from_numpy(np.concatenate([np.full(len(prompt), -100), response]).astype(np.int64)),
                }
                if self.teacher:
                    item["teacher_ids"] = torch.from_numpy(part["top_logprob_ids"].values[p, s, :n].astype(np.int64))
                    item["teacher_logprobs"] = torch.from_numpy(part["top_logprobs"].values[p, s, :n])
                for name in self.columns:
                    item[name.removeprefix("column_")] = str(part[name].values[p])
                yield item


def pad(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A DataLoader's ``collate_fn``: right-pad the tensors of a batch (ids with 0, labels with -100)."""
    out: dict[str, Any] = {}
    for key in items[0]:
        values = [item[key] for item in items]
        if not isinstance(values[0], torch.Tensor):
            out[key] = values
            continue
        fill = -100 if key == "labels" else float("-inf") if key == "teacher_logprobs" else 0
        out[key] = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=fill)
    return out


def main(argv: list[str] | None = None) -> int:
    """Iterate the store's finished samples in batches; return how many there were."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("store", help="the run's --store")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    args = parser.parse_args(argv)
    samples = DistillSamples(args.store, shuffle_seed=0)
    loader = DataLoader(samples, batch_size=args.batch_size, num_workers=args.workers, collate_fn=pad)
    seen = 0
    for batch in loader:
        if seen == 0:
            shapes = {k: tuple(v.shape) if isinstance(v, torch.Tensor) else v[:2] for k, v in batch.items()}
            print("first batch:", shapes)
        seen += len(batch["input_ids"])
    print(f"{seen} finished samples in {len(samples.partitions)} partitions")
    return seen


if __name__ == "__main__":
    main()
