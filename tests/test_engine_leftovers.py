"""The temporary folder an engine's processes take as theirs (daskgen/engines/leftovers.py) keeps lasting caches out.

vLLM's processes start inside :func:`temp_folder_for_children`, which is removed at shutdown; torch's compiler cache
defaults to a folder under the temporary folder, so without care each engine start would compile again what the
last one compiled (on CPU: the precompiled header of vLLM's worker, about 7 CPU-s a start).
"""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from daskgen.engines.leftovers import temp_folder_for_children

CHILD = (
    "import tempfile\n"
    "from torch._inductor.runtime.cache_dir_utils import cache_dir\n"
    "print(cache_dir(), tempfile.gettempdir())"
)


def started_inside() -> tuple[str, str]:
    """torch's compiler cache folder and the temporary folder, as a process started now sees them."""
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=True)
    cache, tmp = out.stdout.split()
    return cache, tmp


def test_children_get_the_folder_as_their_temporary_folder_and_torchs_cache_where_it_always_is(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    usual = str(tmp_path / f"torchinductor_{getpass.getuser()}")
    with temp_folder_for_children("daskgen-test-tmp-") as folder:
        assert folder.parent == tmp_path and tempfile.gettempdir() == str(folder)
        assert started_inside() == (usual, str(folder))
    assert os.environ["TMPDIR"] == str(tmp_path) and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert started_inside() == (usual, str(tmp_path))  # the same cache as a process started outside the block


def test_a_cache_folder_the_user_named_is_kept(monkeypatch, tmp_path):
    mine = tmp_path / "my-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    with temp_folder_for_children("daskgen-test-tmp-") as folder:
        cache, tmp = started_inside()
        assert Path(cache) == mine and tmp == str(folder)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)
