"""LoRA adapters: the run's ``adapters`` (name -> folder), its ``adapter`` and each row's ``adapter`` column.

``adapters: {name: path}`` declares the adapters a run may use; each path is a PEFT LoRA adapter folder (an
``adapter_config.json`` beside its weights, as ``PeftModel.save_pretrained`` writes).  The run's ``adapter``
(a name) applies to every row; a row's own ``adapter`` column replaces it (``null``: the run's; no adapter at all:
the base model).  Every name is checked against ``adapters`` while the input is scanned, before any engine
starts: an unknown one is an error naming the row, the name and the names known.

Identity: each row's adapter name is stored per prompt (the ``adapter`` array, ``""`` for the base model); the
run's ``adapter`` and the content hash of every declared adapter (:func:`adapter_identity`: SHA-256 over the
folder's file names and bytes) are part of the store's identity, so a rerun with changed adapter files, or
another run-level adapter, is refused like any other changed setting.  A row's ``adapter`` column is part of
the input fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from daskgen.errors import ConfigError

#: The row column (and run setting) naming the adapter a row uses.
ROW_KEY = "adapter"
#: The file that marks a folder as a PEFT adapter.
CONFIG_FILE = "adapter_config.json"


def check_adapters(adapters: Any, adapter: Any) -> dict[str, str]:
    """The ``adapters`` setting as ``{name: absolute folder}``, each checked; the run's ``adapter`` must be one.

    Raises :class:`ConfigError` naming the adapter, what was found and the fix.
    """
    if adapters is None:
        adapters = {}
    if not isinstance(adapters, Mapping):
        raise ConfigError(
            f"setting 'adapters' must map adapter names to folders, found {type(adapters).__name__}; "
            "e.g. adapters: {math: /ckpt/lora-math}."
        )
    checked = {str(name): _adapter_folder(str(name), path) for name, path in adapters.items()}
    if adapter is not None and adapter not in checked:
        raise ConfigError(f"setting 'adapter': {adapter!r} is not an adapter of this run; {_known(checked)}.")
    return checked


def _adapter_folder(name: str, path: Any) -> str:
    """The absolute folder of adapter ``name``, checked to be a PEFT LoRA adapter folder."""
    if not name or not isinstance(path, (str, Path)) or not str(path):
        raise ConfigError(f"setting 'adapters': adapter {name!r} needs a non-empty name and a folder, found {path!r}.")
    folder = Path(path).expanduser().resolve()
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        found = "does not exist" if not folder.exists() else f"has no {CONFIG_FILE}"
        raise ConfigError(
            f"setting 'adapters': adapter {name!r} at {str(folder)!r} {found}; give the folder a PEFT LoRA "
            "adapter was saved to (PeftModel.save_pretrained writes adapter_config.json and the weights)."
        )
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(
            f"setting 'adapters': adapter {name!r}: {config_file} is not readable JSON ({exc})."
        ) from None
    kind = config.get("peft_type") if isinstance(config, dict) else None
    if kind != "LORA":
        raise ConfigError(
            f"setting 'adapters': adapter {name!r} at {str(folder)!r} has peft_type {kind!r}; only LoRA "
            "adapters (peft_type 'LORA') are served."
        )
    return str(folder)


def adapter_config(path: str) -> dict[str, Any]:
    """The ``adapter_config.json`` of a checked adapter folder."""
    return dict(json.loads((Path(path) / CONFIG_FILE).read_text()))


def max_rank(adapters: Mapping[str, str]) -> int:
    """The largest LoRA rank ``r`` among ``adapters`` (0 without adapters)."""
    return max((int(adapter_config(path).get("r", 8)) for path in adapters.values()), default=0)


def adapter_digest(path: str) -> str:
    """``sha256:<hex>`` over the relative names and bytes of every file under the adapter folder ``path``."""
    digest = hashlib.sha256()
    root = Path(path)
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(file.relative_to(root).as_posix().encode() + b"\0")
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        digest.update(b"\0")
    return f"sha256:{digest.hexdigest()}"


def adapter_identity(adapters: Mapping[str, str]) -> dict[str, str]:
    """``{name: content hash}`` of the run's adapters: what a resumed run must match."""
    return {name: adapter_digest(path) for name, path in sorted(adapters.items())}


def _known(adapters: Mapping[str, str]) -> str:
    names = sorted(adapters)
    return f"the adapters known are {names}" if names else "the run declares no adapters (setting 'adapters')"


class AdapterCheck:
    """Checks each row's ``adapter`` column during the input scan against the run's adapter names."""

    def __init__(self, adapters: Mapping[str, str]) -> None:
        self.adapters = adapters

    def __call__(self, row: Any) -> list[str]:
        """Problems of the row's ``adapter`` column (each names the column, the value and the fix)."""
        name = row.get(ROW_KEY) if isinstance(row, dict) else None
        if name is None:
            return []
        if not isinstance(name, str) or name not in self.adapters:
            return [
                f"column {ROW_KEY!r}: {name!r} is not an adapter of this run; {_known(self.adapters)} "
                "(declare it under 'adapters', or fix the name)"
            ]
        return []


def for_row(row: Mapping[str, Any], run: str | None) -> str | None:
    """The adapter of a (valid) row: its own ``adapter`` column, else the run's (``None``: the base model)."""
    own = row.get(ROW_KEY)
    return own if own is not None else run
