"""The temporary folder an engine's processes get (:func:`daskgen.engines.leftovers.temp_folder_for_children`): a
process started inside the block takes it as its temporary folder and finds the machine's shared caches in it;
removing the folder leaves those caches alone.  vLLM's use of it is checked in the vLLM lane
(tests/test_refresh_engines.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from daskgen.engines.leftovers import remove_folder, temp_folder_for_children


def test_a_child_takes_the_folder_as_its_temporary_folder_and_finds_the_shared_caches_in_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    shared = tmp_path / "compiler-cache"
    (shared / "headers").mkdir(parents=True)
    (shared / "headers" / "kept.h").write_text("kept")
    with temp_folder_for_children("owner-tmp-", keep=(shared, tmp_path / "made-when-missing")) as folder:
        seen = subprocess.run(
            [sys.executable, "-c", "import tempfile; print(tempfile.gettempdir())"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        assert tempfile.gettempdir() == str(folder)
    assert seen == str(folder) and folder.parent == tmp_path
    assert os.environ["TMPDIR"] == str(tmp_path) and tempfile.gettempdir() == str(tmp_path)  # restored
    assert (folder / "compiler-cache" / "headers" / "kept.h").read_text() == "kept"
    assert (folder / "made-when-missing").resolve() == tmp_path / "made-when-missing"
    (folder / "compiler-cache" / "headers" / "new.h").write_text("new")  # what a child adds lands in the cache
    (folder / "own-file").write_text("left by a process")
    remove_folder(folder, "a test")
    assert not folder.exists()
    assert sorted(p.name for p in (shared / "headers").iterdir()) == ["kept.h", "new.h"]
    assert (tmp_path / "made-when-missing").is_dir()
