"""The policy record: ``daskgen.publish_policy`` / ``daskgen policy publish`` add versions in order, refuse a
version that does not increase (naming the newest and the asked one), and ``daskgen status`` lists them."""

from __future__ import annotations

import numpy as np
import pytest

import daskgen
from daskgen import store
from daskgen.errors import PolicyError, PolicyVersionError
from daskgen.store.policy import read_versions
from tests.conftest import run_cli


@pytest.fixture
def made_store(tmp_path):
    """A small store written through the store API."""
    layout = store.Layout(4, 1, 4, 4, 2, 0)
    out = tmp_path / "out.zarr"
    store.GenerationStore.create(out, store.StoreAttrs(layout), [f"q{i}" for i in range(4)])
    return out


def _checkpoint(tmp_path, name):
    folder = tmp_path / name
    folder.mkdir()
    return folder


def test_versions_are_recorded_in_order_and_only_increase(made_store, tmp_path):
    first = daskgen.publish_policy(made_store, str(_checkpoint(tmp_path, "step1")), 1)
    daskgen.publish_policy(made_store, str(_checkpoint(tmp_path, "step5")), 5)
    versions = read_versions(store.locate(made_store))
    assert [(v.version, v.path) for v in versions] == [(1, str(tmp_path / "step1")), (5, str(tmp_path / "step5"))]
    assert versions[0] == first and versions[0].time < versions[1].time
    for asked in (5, 3):
        with pytest.raises(PolicyVersionError, match=f"policy version {asked} is not above the newest version 5"):
            daskgen.publish_policy(made_store, str(tmp_path / "step1"), asked)
    try:
        daskgen.publish_policy(made_store, str(tmp_path / "step1"), 4)
    except PolicyVersionError as exc:
        assert (exc.current, exc.asked) == (5, 4)
    assert len(read_versions(store.locate(made_store))) == 2


def test_bad_publications_are_refused(made_store, tmp_path):
    with pytest.raises(PolicyError, match="is not a folder"):
        daskgen.publish_policy(made_store, str(tmp_path / "missing"), 1)
    with pytest.raises(PolicyError, match="integer >= 1"):
        daskgen.publish_policy(made_store, str(tmp_path), 0)
    with pytest.raises(PolicyError, match="not a daskgen store"):
        daskgen.publish_policy(tmp_path / "nothing.zarr", str(tmp_path), 1)
    assert not (tmp_path / "nothing.zarr").exists()


def test_cli_publishes_and_status_lists_versions(made_store, tmp_path):
    folder = _checkpoint(tmp_path, "step2")
    res = run_cli("policy", "publish", made_store, folder, "--version", "2")
    assert res.returncode == 0 and "published policy version 2" in res.stdout, res.stdout + res.stderr
    res = run_cli("policy", "publish", made_store, folder, "--version", "2")
    assert res.returncode == 2 and "not above the newest version 2" in res.stderr, res.stderr
    store.GenerationStore.open(made_store).commit(0, np.full(4, store.DONE, dtype="int8"), [""] * 4)
    res = run_cli("status", made_store)
    assert res.returncode == 0 and f"policy versions:\n  2: {folder}" in res.stdout, res.stdout + res.stderr
