"""Shared helpers of the daskgen benchmarks: machine info, result tables, record files, engine probes.

Every benchmark script imports this module (it sits next to them in ``benchmarks/``).  Functions
that run on Dask workers (engine statistics, the utilisation sampler, the synchronous-batch shard)
live here and are pickled by value, so workers need not import ``benchmarks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import cloudpickle
from distributed.diagnostics.plugin import WorkerPlugin

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: Where ``daskgen`` is imported from: ``$DASKGEN_SRC`` (e.g. a ``git archive`` snapshot of a commit, so
#: that edits in the working tree cannot change a running benchmark), else this repository.
DASKGEN_SRC = Path(os.environ.get("DASKGEN_SRC") or REPO).resolve()
if str(DASKGEN_SRC) not in sys.path:  # scripts run as ``python benchmarks/x.py`` from anywhere
    sys.path.insert(0, str(DASKGEN_SRC))

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: Folder of the records: one Markdown file per benchmark run (and its plots).
RESULTS = HERE / "results"
#: Folders of the repository whose uncommitted changes make a record not a record of a commit.
CODE_FOLDERS = ("daskgen", "benchmarks")
#: Output of the benchmarks inside ``CODE_FOLDERS``, not code: ignored by the clean-tree check.
OUTPUT_FOLDERS = ("benchmarks/results",)
#: Name under which the utilisation sampler plugin is registered on workers.
SAMPLER_NAME = "daskgen-bench-sampler"
ENGINE_PLUGIN = "daskgen-engine"

VERSION_PACKAGES = (
    "daskgen",
    "dask",
    "distributed",
    "zarr",
    "numcodecs",
    "xarray",
    "numpy",
    "pyarrow",
    "torch",
    "transformers",
    "matplotlib",
)


# --------------------------------------------------------------------------- machine and versions


def cpu_model() -> str:
    """The CPU model name from ``/proc/cpuinfo`` (or ``platform.processor()``)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def memory_gib() -> float:
    """Total memory in GiB (Linux), else NaN."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def load_average() -> str:
    """The 1/5/15-minute load averages as text."""
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def machine_info() -> str:
    """One line describing the machine."""
    return (
        f"{os.cpu_count()} CPU(s) {cpu_model()}, {memory_gib():.0f} GiB RAM, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}"
    )


def package_versions() -> str:
    """Installed versions of the packages that shape the results."""
    found = []
    for name in VERSION_PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            found.append(f"{name} {version(name)}")
    return ", ".join(found)


def git_head(folder: Path) -> str:
    """The short commit of the git checkout holding ``folder``, or ``"?"``."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return "?"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "?"


def uncommitted_changes(repo: Path, folders: Sequence[str]) -> list[str]:
    """Files under ``folders`` of the git checkout ``repo`` that differ from its commit (untracked included).

    ``OUTPUT_FOLDERS`` (the records themselves) are left out.  A folder that is no git checkout
    counts as changed (``["<not a git checkout>"]``): nothing ties its code to a commit.
    """
    import subprocess

    excluded = [f":(exclude){o}" for o in OUTPUT_FOLDERS]
    cmd = ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=all", "--", *folders, *excluded]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ["<not a git checkout>"]
    if out.returncode != 0:
        return ["<not a git checkout>"]
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


@dataclass(frozen=True)
class Provenance:
    """Which code produced a record: the benchmark scripts' commit and daskgen's, and what was uncommitted."""

    scripts: str
    daskgen: str
    changed: tuple[str, ...]

    @property
    def clean(self) -> bool:
        """True when neither ``daskgen/`` nor ``benchmarks/`` had uncommitted changes."""
        return not self.changed

    def lines(self) -> list[str]:
        """The record's ``Commit:`` line, and a warning line when the tree was not clean."""
        out = [f"Commit: benchmarks/ at {self.scripts}; daskgen code: {self.daskgen}"]
        if not self.clean:
            shown = ", ".join(self.changed[:10]) + (", ..." if len(self.changed) > 10 else "")
            out.append(
                f"**Not a record of a commit:** uncommitted changes in {shown}. "
                "Figures from this record are not quoted."
            )
        return out


def provenance(repo: Path = REPO, daskgen_src: Path = DASKGEN_SRC) -> Provenance:
    """The :class:`Provenance` of a run of the scripts in ``repo`` importing daskgen from ``daskgen_src``.

    daskgen from a snapshot (a folder with a ``.git-commit`` file, see the README) is the commit named
    there; otherwise ``daskgen/`` of ``daskgen_src`` must match its checkout's commit.  The scripts in
    ``benchmarks/`` of ``repo`` must match ``repo``'s commit (records under ``benchmarks/results/`` aside).
    """
    repo, daskgen_src = Path(repo).resolve(), Path(daskgen_src).resolve()
    marker = daskgen_src / ".git-commit"
    if marker.is_file():
        daskgen = f"snapshot {daskgen_src} of commit {marker.read_text().strip()}"
        changed = uncommitted_changes(repo, ("benchmarks",))
    elif daskgen_src == repo:
        daskgen = f"working tree {repo} at commit {git_head(repo)}"
        changed = uncommitted_changes(repo, CODE_FOLDERS)
    else:
        daskgen = f"working tree {daskgen_src} at commit {git_head(daskgen_src)}"
        changed = uncommitted_changes(daskgen_src, ("daskgen",)) + uncommitted_changes(repo, ("benchmarks",))
    return Provenance(scripts=git_head(repo), daskgen=daskgen, changed=tuple(changed))


def command_line() -> str:
    """The command that started this process, relative to the repository root when possible."""
    argv = list(sys.argv)
    with contextlib.suppress(ValueError):
        argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
    env = f"DASKGEN_SRC={shlex.quote(os.environ['DASKGEN_SRC'])} " if os.environ.get("DASKGEN_SRC") else ""
    return env + "python " + " ".join(shlex.quote(a) for a in argv)


# --------------------------------------------------------------------------- tables and records


def fmt(value: Any, digits: int = 3) -> str:
    """Compact text for a table cell."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub-flavoured Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(fmt(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass
class Record:
    """One benchmark result: tables and notes, printed and written to a file of its own in ``results/``."""

    title: str
    started: float = field(default_factory=time.time)
    load_before: str = field(default_factory=load_average)
    sections: list[str] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]], caption: str = "") -> str:
        """Add a table (with an optional caption line above it); returns its Markdown."""
        text = markdown_table(header, rows)
        self.sections.append((f"{caption}\n\n" if caption else "") + text)
        return text

    def note(self, text: str) -> None:
        """Add a paragraph."""
        self.sections.append(text)

    def plot(self, path: Path) -> None:
        """Reference a PNG (linked relative to the record file)."""
        self.plots.append(Path(path))

    def plot_path(self, folder: Path, stem: str) -> Path:
        """``folder/<stem>-<start time>.png``: every record keeps its own picture."""
        stamp = _dt.datetime.fromtimestamp(self.started).strftime("%Y%m%d-%H%M%S")
        return Path(folder) / f"{stem}-{stamp}.png"

    def render(self, record_dir: Path, source: Provenance) -> str:
        """The Markdown of the record file (in ``record_dir``, which plot links are relative to)."""
        when = _dt.datetime.fromtimestamp(self.started).strftime("%Y-%m-%d %H:%M")
        took = time.time() - self.started
        head = [f"# {self.title} — {when}", "", f"Command: `{command_line()}`", ""]
        for line in source.lines():
            head += [line, ""]
        head += [
            f"Machine: {machine_info()}; load average (1/5/15 min) {self.load_before} at start, "
            f"{load_average()} at end (the machine is shared with other jobs: absolute times are context, "
            f"ratios measured side by side count). Benchmark wall time {took:.0f} s.",
            "",
            f"Versions: {package_versions()}",
            "",
        ]
        body = "\n" + "\n\n".join(self.sections)
        pics = ""
        for p in self.plots:
            try:
                rel = p.resolve().relative_to(record_dir.resolve())
            except ValueError:
                rel = p
            pics += f"\n\n![{p.stem}]({rel})"
        return "\n".join(head) + body + pics + "\n"

    def file_name(self, script: str, source: Provenance) -> str:
        """``<start, minute>-<script>[-uncommitted].md``: sorted by time, the script in the name."""
        stamp = _dt.datetime.fromtimestamp(self.started).strftime("%Y-%m-%dT%H%M")
        return f"{stamp}-{script}{'' if source.clean else '-uncommitted'}.md"

    def finish(self, folder: Path | None) -> Path | None:
        """Print the result and write it as a new record file in ``folder`` (unless ``None``); return its path.

        The record names the commit of the scripts and of daskgen (:func:`provenance`); a run from a
        tree with uncommitted changes in ``daskgen/`` or ``benchmarks/`` is written too, but marked in
        its text and its file name as not a record of a commit.
        """
        print("\n".join(self.sections))
        if folder is None:
            return None
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        source = provenance()
        path = folder / self.file_name(Path(sys.argv[0]).stem, source)
        if path.exists():  # a second record of the same script in the same minute
            path = path.with_name(path.stem + _dt.datetime.fromtimestamp(self.started).strftime("-%S") + ".md")
        path.write_text(self.render(folder, source))
        print(f"\nrecord written to {path}")
        if not source.clean:
            print(f"not a record of a commit: uncommitted changes in {', '.join(source.changed)}")
        return path


def record_folder(a: Any) -> Path | None:
    """Where the parsed arguments of :func:`add_common_args` say to write the record (``None``: print only)."""
    return None if a.no_record else Path(a.results)


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


def plot_folder(a: Any) -> Path:
    """``--plot-dir``, else the ``--results`` folder (the temporary folder with ``--no-record``); created."""
    import tempfile

    folder = Path(a.plot_dir or (tempfile.gettempdir() if a.no_record else a.results))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def run_parts(a: Any, title: str, parts: dict[str, Callable[[Any, Path, Record], Any]]) -> int:
    """The ``main`` of a script with ``--part``: run the chosen parts in order into one record, print
    it and write it to the results folder (unless ``--no-record``)."""
    quiet_logs()
    chosen = {p.strip() for p in a.part.split(",") if p.strip()}
    if chosen - set(parts):
        raise SystemExit(f"unknown part(s) {sorted(chosen - set(parts))}; choose from {', '.join(parts)}")
    rec = Record(title)
    with workdir(a.workdir) as work:
        for name, run_part in parts.items():
            if name in chosen:
                run_part(a, work, rec)
    rec.finish(record_folder(a))
    return 0


@contextlib.contextmanager
def workdir(path: Path | None) -> Iterator[Path]:
    """``path`` (created) or a temporary directory removed afterwards."""
    import tempfile

    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="daskgen-bench-") as tmp:
        yield Path(tmp)


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


# --------------------------------------------------------------------------- worker-side probes


def engine_stats(dask_worker: Any) -> dict[str, Any] | None:
    """``client.run`` target: the worker's engine statistics (``SimulatedEngine.stats``), if any."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    engine = getattr(plugin, "engine", None)
    stats = getattr(engine, "stats", None)
    return stats() if callable(stats) else None


def reset_engine_stats(dask_worker: Any) -> bool:
    """``client.run`` target: start a new statistics window on the worker's engine."""
    plugin = dask_worker.plugins.get(ENGINE_PLUGIN)
    reset = getattr(getattr(plugin, "engine", None), "reset_stats", None)
    if callable(reset):
        reset()
        return True
    return False


class UtilisationSampler(WorkerPlugin):
    """Worker plugin that samples the engine's running/waiting requests and tokens every ``period`` s.

    Registered next to daskgen's ``EnginePlugin``; it only reads the engine's public ``stats()``.
    """

    name = SAMPLER_NAME

    def __init__(self, period: float = 0.05) -> None:
        self.period = period
        self.samples: list[tuple[float, int, int, int]] = []
        self._task: asyncio.Task | None = None

    async def setup(self, worker: Any) -> None:
        """Start sampling on the worker's event loop."""
        self.samples = []
        self._task = asyncio.create_task(self._loop(worker))

    async def _loop(self, worker: Any) -> None:
        while True:
            stats = engine_stats(worker)
            if stats is not None:
                self.samples.append(
                    (time.time(), int(stats["running"]), int(stats["waiting"]), int(stats["tokens_generated"]))
                )
            await asyncio.sleep(self.period)

    async def teardown(self, worker: Any) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()


def sampler_samples(dask_worker: Any) -> list[tuple[float, int, int, int]]:
    """``client.run`` target: the sampler's samples on this worker."""
    plugin = dask_worker.plugins.get(SAMPLER_NAME)
    return list(plugin.samples) if plugin is not None else []


def start_sampler(client: Any, period: float = 0.05) -> None:
    """Register a fresh :class:`UtilisationSampler` on every worker."""
    client.register_plugin(UtilisationSampler(period), name=SAMPLER_NAME)


@contextlib.contextmanager
def instrument_run(
    on_ready: Callable[[Any], None] | None = None, on_done: Callable[[Any], Any] | None = None
) -> Iterator[dict[str, Any]]:
    """Time a ``daskgen.client.runner.run`` from engines ready to the last commit, with hooks on its client.

    Wraps ``daskgen.client.cluster.start_engines`` (called by ``runner.drive`` before the first submit) and
    ``daskgen.client.runner.drive`` for the duration of the ``with`` block; nothing in daskgen is changed.
    The yielded dict gets ``start_s`` (engine start), ``ready`` / ``done`` (``time.perf_counter``),
    ``ready_wall``, ``generate_s`` (= done - ready) and ``on_done`` (what ``on_done(client)``
    returned, called after the last commit while the cluster still runs).  ``on_ready(client)`` runs
    right before the first partition is submitted.
    """
    import daskgen.client.cluster as cluster
    import daskgen.client.runner as runner

    original_start, original_drive = cluster.start_engines, runner.drive
    marks: dict[str, Any] = {}

    def start_engines(client: Any, config: Any, *args: Any) -> int:
        t0 = time.perf_counter()
        n = original_start(client, config, *args)
        if on_ready is not None:
            on_ready(client)
        marks.update(start_s=time.perf_counter() - t0, ready=time.perf_counter(), ready_wall=time.time())
        return n

    def drive(client: Any, *args: Any, **kwargs: Any) -> Any:
        out = original_drive(client, *args, **kwargs)
        marks["done"] = time.perf_counter()
        marks["generate_s"] = marks["done"] - marks["ready"]
        if on_done is not None:
            marks["on_done"] = on_done(client)
        return out

    cluster.start_engines, runner.drive = start_engines, drive
    try:
        yield marks
    finally:
        cluster.start_engines, runner.drive = original_start, original_drive


def as_client(connection: Any) -> Any:
    """The client from what ``daskgen.client.cluster.connect`` yields (a client, or ``(client, info)``)."""
    return connection[0] if isinstance(connection, tuple) else connection


def run_requests(config: Any, prompts: Any) -> list[Any]:
    """Every engine request a daskgen run of ``config`` would send, in row order, seeds included.

    Mirrors the partition task's single-turn loop: request id ``p{row}-s{sample}``, the task's
    sampling params with the per-sample seed ``sample_seed(seed, row, sample)``.
    """
    import dataclasses

    from daskgen.client.plan import pending_tasks, prepare
    from daskgen.engines.base import GenerationRequest
    from daskgen.input.rows import tokenize_rows
    from daskgen.worker.partition import sample_seed

    plan = prepare(config, prompts)
    out = []
    for task in pending_tasks(plan):
        ids = task.prompts if task.prompts is not None else tokenize_rows(task.inputs, plan.tokenizer)
        for row, prompt in zip(task.rows, ids, strict=True):
            for s in range(task.n_samples):
                params = dataclasses.replace(task.params, seed=sample_seed(task.seed, row, s))
                out.append(GenerationRequest(f"p{row}-s{s}", list(prompt), params))
    return out


def simulated_capacity(max_batch: int, base_s: float, per_seq_s: float) -> float:
    """Peak tokens per model second of one simulated engine (every step at ``max_batch``)."""
    return max_batch / (base_s + per_seq_s * max_batch)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


async def generate_on_worker(requests: list[Any]) -> list[int]:
    """Dask task: run ``requests`` on this worker's daskgen engine at once; return output lengths.

    This is how a synchronous rollout drives an engine: the whole shard is submitted together and
    the call returns when its longest sample is done.  Nothing is stored.
    """
    from distributed import get_worker

    plugin = get_worker().plugins[ENGINE_PLUGIN]
    engine = await plugin.get_engine()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    bad = [r.error for r in results if r.error is not None]
    if bad:
        raise RuntimeError(f"{len(bad)} request(s) failed, first: {bad[0]}")
    return [len(r.output_ids) for r in results]


def contiguous_shards(items: Sequence[Any], n: int) -> list[list[Any]]:
    """Split ``items`` into ``n`` contiguous shards of (nearly) equal size, like a data-parallel dispatch."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append(list(items[start:stop]))
        start = stop
    return out
