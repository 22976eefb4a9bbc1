"""What every benchmark script's command line shares: its parser, the common flags, ``main``, scratch folders.

A script builds its parser with :func:`parser`, adds the workload flags it uses with :func:`add_flags`
(one spelling, type and help per flag across the scripts), and runs its comparison with :func:`run_parts`
(into one record, printed and written to the results folder unless ``--no-record``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .records import RESULTS, Record

#: Workload flags shared by several scripts: name -> (type, help).  Each script picks its defaults.
FLAGS: dict[str, tuple[type, str]] = {
    "workers": (int, "Dask worker processes, one engine each"),
    "prompts": (int, "prompts in the job"),
    "n_samples": (int, "samples per prompt"),
    "max_new_tokens": (int, "response length cap"),
    "length_mean": (float, "simulated engine: mean response length (lognormal)"),
    "length_sigma": (float, "simulated engine: lognormal sigma (log space)"),
    "max_batch": (int, "simulated engine: requests running at once"),
    "step_base": (float, "simulated engine: model seconds per step, fixed part"),
    "step_per_seq": (float, "simulated engine: model seconds per step per request"),
    "time_scale": (float, "simulated engine: wall seconds per model second"),
    "partition_size": (int, "prompts per daskgen partition"),
    "max_prompt_tokens": (int, "prompt length cap"),
    "done_fraction": (float, "share of the store's partitions that are done"),
    "repeats": (int, "side-by-side repeats of the comparison"),
    "sample_period": (float, "wall seconds between utilisation samples"),
    "seed": (int, "run seed"),
}


def parser(doc: str) -> argparse.ArgumentParser:
    """A script's parser, described by the first paragraph of its docstring ``doc``."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)


def add_flags(p: argparse.ArgumentParser, **defaults: Any) -> None:
    """Add the :data:`FLAGS` named by the keywords (``n_samples=4`` adds ``--n-samples``, default 4)."""
    for name, default in defaults.items():
        kind, text = FLAGS[name]
        p.add_argument("--" + name.replace("_", "-"), type=kind, default=default, help=text)


def counts(text: str) -> list[int]:
    """Whole numbers from comma-separated ``text`` (``"1,2,4"``)."""
    return [int(x) for x in text.split(",") if x.strip()]


def add_common_args(parser: Any) -> None:
    """``--results``, ``--no-record``, ``--plot-dir`` and ``--workdir`` for every script."""
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="folder the record file (and its plots) is written to"
    )
    parser.add_argument("--no-record", action="store_true", help="print only; write no record file")
    parser.add_argument(
        "--plot-dir", type=Path, default=None, help="where PNG plots are written (default: the --results folder)"
    )
    parser.add_argument(
        "--workdir", type=Path, default=None, help="scratch directory for stores (default: a fresh temporary directory)"
    )


def parse(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """Add the common flags to ``p`` and parse ``argv`` (the command line when ``None``)."""
    add_common_args(p)
    return p.parse_args(argv)


def parse_parts(doc: str, argv: list[str] | None, *adders: Callable[[Any], None], part: str = "") -> Any:
    """Parse the command line of one comparison or of several into one record: each ``adder`` adds one
    comparison's flags (a flag two comparisons share is declared alike in both: the last one stands), and
    ``part`` (when given) is ``--part``'s default, the comparisons to run."""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter, conflict_handler="resolve"
    )
    if part:
        p.add_argument("--part", default=part, help=f"comma-separated: {', '.join(part.split(','))}")
    for add in adders:
        add(p)
    return parse(p, argv)


def record_folder(a: Any) -> Path | None:
    """Where the parsed arguments of :func:`add_common_args` say to write the record (``None``: print only)."""
    return None if a.no_record else Path(a.results)


def plot_folder(a: Any) -> Path:
    """``--plot-dir``, else the ``--results`` folder (the temporary folder with ``--no-record``); created."""
    import tempfile

    folder = Path(a.plot_dir or (tempfile.gettempdir() if a.no_record else a.results))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextlib.contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    """``path`` (created; refused when it holds anything: :func:`fresh_folder`) or a temporary directory removed
    afterwards."""
    import tempfile

    if path is not None:
        yield fresh_folder(path)
        return
    with tempfile.TemporaryDirectory(prefix="daskgen-bench-") as tmp:
        yield Path(tmp)


def fresh_folder(path: Path) -> Path:
    """``path`` as an empty folder (created when missing) for a benchmark's stores; ``SystemExit`` naming what it
    holds and the fix when it is not empty.

    A benchmark times runs from fresh stores: a store an earlier run left under the same name would be resumed
    (a finished one generates nothing) or refused, instead of timed.
    """
    if path.exists() and not path.is_dir():
        raise SystemExit(f"--workdir {path} is a file; give a new or empty folder for the benchmark's stores.")
    held = sorted(entry.name for entry in path.iterdir()) if path.is_dir() else []
    if held:
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise SystemExit(
            f"--workdir {path} is not empty: it holds {shown}. A benchmark writes fresh stores there (a store an "
            "earlier run left would be resumed instead of timed); give a new or empty folder, or empty this one "
            f"first (rm -r {path}/*)."
        )
    path.mkdir(parents=True, exist_ok=True)
    return path


def quiet_logs() -> None:
    """Keep Dask's and daskgen's INFO chatter out of benchmark output."""
    import logging
    import warnings

    for name in ("distributed", "daskgen", "transformers", "asyncio"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


#: One part of a record: ``part(parsed args, scratch folder, record)``.
Part = Callable[[Any, Path, Record], Any]


def run_parts(a: Any, title: str, parts: dict[str, Part], chosen: str | None = None) -> int:
    """A script's ``main``: run the ``chosen`` parts (comma-separated; default ``a.part``, else every part)
    in order into one record, print it and write it to the results folder (unless ``--no-record``)."""
    quiet_logs()
    names = chosen if chosen is not None else getattr(a, "part", ",".join(parts))
    picked = {p.strip() for p in names.split(",") if p.strip()}
    if picked - set(parts):
        raise SystemExit(f"unknown part(s) {sorted(picked - set(parts))}; choose from {', '.join(parts)}")
    rec = Record(title)
    with workdir(a.workdir) as work:
        rec.workdir = work
        for name, run_part in parts.items():
            if name in picked:
                run_part(a, work, rec)
    rec.finish(record_folder(a))
    return 0
