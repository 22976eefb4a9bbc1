"""Pages of the documentation site (run by mkdocs-gen-files during ``mkdocs build``).

The repository's Markdown goes to the same paths on the site (README.md as the front page ``index.md``), so that
the relative links between README.md, docs/, benchmarks/ and CHANGELOG.md work in both places.  The reference
pages are generated here from the code: the command line from its Typer app, the tunables from the shipped
``daskgen.yaml``, the exit statuses from :mod:`daskgen.exit_codes`, the store layout from
:mod:`daskgen.store.layout` and the extras from pyproject.toml.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from pathlib import Path

import mkdocs_gen_files
import tomllib

ROOT = Path(__file__).resolve().parent.parent
#: Repository files shown on the site as they are (besides README.md, which becomes the front page).
COPIED = (
    "CHANGELOG.md",
    "benchmarks/README.md",
    "docs/*.md",
    "docs/guides/*.md",
    "benchmarks/results/*.md",
    "benchmarks/results/*.png",
    "examples/*/*.sbatch",  # the task guides' files, which the guides link to
    "examples/*/*.yaml",
    "examples/*/*.py",
)


def write(path: str, text: str | bytes, source: str | None = None) -> None:
    with mkdocs_gen_files.open(path, "wb" if isinstance(text, bytes) else "w") as fh:
        fh.write(text)
    if source:
        mkdocs_gen_files.set_edit_path(path, source)


def copy_pages() -> None:
    write("index.md", (ROOT / "README.md").read_text(), "README.md")
    for pattern in COPIED:
        for path in sorted(ROOT.glob(pattern)):
            name = path.relative_to(ROOT).as_posix()
            if path.suffix == ".md":
                write(name, path.read_text(), name)
            else:
                write(name, path.read_bytes())
    write("LICENSE.md", "# License\n\n```text\n" + (ROOT / "LICENSE").read_text() + "```\n", "LICENSE")


def cli_page() -> str:
    import typer
    from typer.cli import get_docs_for_click

    from daskgen.cli import app

    command = typer.main.get_command(app)
    text = get_docs_for_click(obj=command, ctx=typer.Context(command), name="daskgen", title="Command line")
    note = "Generated from the command line's own help (`daskgen --help`, `daskgen COMMAND --help`).\n\n"
    return text.replace("\n", "\n\n" + note, 1) if text.startswith("# ") else note + text


def yaml_entries(text: str) -> list[tuple[str, str]]:
    """Each setting of the ``daskgen:`` YAML section with its comment (the comment lines just above a key, then
    its trailing comment), as ``(dotted key, comment)``; a section's own comment leads its keys' comments."""
    entries, above, stack = [], [], []  # stack: (indent, key, comment) of the open sections
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            above = []
            continue
        if stripped.startswith("#"):
            above.append(stripped.lstrip("# ").strip())
            continue
        match = re.match(r"^(\s*)([\w-]+):\s*([^#]*?)\s*(?:#\s*(.*))?$", line)
        if not match:
            continue
        indent, key, value, trailing = len(match.group(1)), match.group(2), match.group(3), match.group(4)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        comment = " ".join([*above, trailing or ""]).strip()
        above = []
        if value:
            path = ".".join([*(k for _, k, _ in stack), key])
            sections = " ".join(c for _, _, c in stack[1:] if c)
            entries.append((path, f"{sections} {comment}".strip() if sections and not comment else comment))
        else:
            stack.append((indent, key, comment))
    return entries


def tunables_page() -> str:
    from daskgen.tunables import DEFAULTS

    text = (ROOT / "daskgen" / "daskgen.yaml").read_text()
    rows = ["| key | default | what it sets |", "|---|---|---|"]
    for path, comment in yaml_entries(text):
        value = DEFAULTS
        for part in path.split("."):
            value = value[part]
        shown = "`null`" if value is None else f"`{value}`"
        rows.append(f"| `{path}` | {shown} | {comment.replace('|', '&#124;')} |")
    header = text.split("\ndaskgen:", 1)[0]
    intro = " ".join(line.lstrip("# ") for line in header.splitlines() if line.startswith("#"))
    return "# Tunables\n\nGenerated from the shipped `daskgen/daskgen.yaml`. " + intro + "\n\n" + "\n".join(rows) + "\n"


def exit_codes_page() -> str:
    from daskgen.exit_codes import MEANINGS

    rows = ["| status | name | meaning |", "|---|---|---|"]
    rows += [f"| {int(code)} | `{code.name}` | {meaning} |" for code, meaning in MEANINGS.items()]
    intro = "Every `daskgen` command exits with one of these statuses (generated from `daskgen/exit_codes.py`).\n\n"
    return "# Exit statuses\n\n" + intro + "\n".join(rows) + "\n"


def store_layout_page() -> str:
    from daskgen.store.layout import Layout, every_array_layout, variable_attrs

    base = Layout(1, 1, 1, 1, 1, 0)
    plain = base.array_specs()
    added: dict[str, str] = {}
    for option in fields(Layout):
        if option.name == "columns" or not isinstance(option.default, (bool, int)):
            continue
        turned_on = Layout(1, 1, 1, 1, 1, 0, **{option.name: _on(option.default)})
        for name in turned_on.array_specs():
            added.setdefault(name, f"with `{option.name}`")
    added["column_{name}"] = "with `keep_columns`"
    every = every_array_layout(("{name}",))
    specs = {
        **replace(every, n_trajectories=1).array_specs(),
        "num_trajectories": every.array_specs()["num_trajectories"],
    }
    rows = ["| array | dims | dtype | written by | present | meaning |", "|---|---|---|---|---|---|"]
    for name, spec in specs.items():
        present = "always" if name in plain else added.get(name, "with `n_trajectories` > 1")
        meaning = variable_attrs(name).get("long_name", "").replace("|", "&#124;")
        writer = "worker" if spec.worker_written else "client"
        rows.append(f"| `{name}` | {', '.join(spec.dims)} | {spec.dtype} | {writer} | {present} | {meaning} |")
    intro = (
        "Every array a daskgen store can hold (generated from `daskgen/store/layout.py`; dims as in "
        "`daskgen.open_store`). 'present' names the run setting that adds an optional array; with "
        "`n_trajectories` > 1 every response array gains a `trajectory` axis after `sample`.\n\n"
    )
    return "# Store layout\n\n" + intro + "\n".join(rows) + "\n"


def _on(default: object) -> object:
    return True if isinstance(default, bool) else int(default) + 1  # type: ignore[arg-type]


def extras_page() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    rows = ["| extra | installs |", "|---|---|"]
    rows += [
        f"| `{name}` | {', '.join(f'`{d}`' for d in deps)} |" for name, deps in project["optional-dependencies"].items()
    ]
    core = ", ".join(f"`{d}`" for d in project["dependencies"])
    intro = (
        f"`pip install daskgen` installs the core: {core}. Each extra adds what one use needs "
        "(`pip install 'daskgen[transformers,models]'`); generated from pyproject.toml.\n\n"
    )
    return "# Extras\n\n" + intro + "\n".join(rows) + "\n"


copy_pages()
write("reference/cli.md", cli_page(), "daskgen/cli.py")
write("reference/tunables.md", tunables_page(), "daskgen/daskgen.yaml")
write("reference/exit-codes.md", exit_codes_page(), "daskgen/exit_codes.py")
write("reference/store-layout.md", store_layout_page(), "daskgen/store/layout.py")
write("reference/extras.md", extras_page(), "pyproject.toml")
