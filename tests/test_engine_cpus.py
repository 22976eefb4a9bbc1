"""Which cores a worker's engine may bind its threads to: the worker's place on its node, one CPU per core."""

from __future__ import annotations

from pathlib import Path

from daskgen.engines.cpus import node_position, one_cpu_per_core


def test_node_position_reads_the_rank_and_the_workers_per_node() -> None:
    assert node_position({"DASKGEN_RESOLVED_LOCAL_RANK": "1", "DASKGEN_WORKERS_PER_NODE": "2"}) == (1, 2)
    assert node_position({"DASKGEN_RESOLVED_LOCAL_RANK": "", "DASKGEN_WORKERS_PER_NODE": "x"}) == (None, None)
    assert node_position({}) == (None, None)


def _topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        folder = root / f"cpu{cpu}" / "topology"
        folder.mkdir(parents=True)
        (folder / "thread_siblings_list").write_text(text + "\n")
    return root


def test_one_cpu_per_core_drops_hardware_thread_siblings(tmp_path: Path) -> None:
    topology = _topology(tmp_path, {0: "0,4", 1: "1,5", 2: "2-3", 3: "2-3", 4: "0,4", 5: "1,5"})
    assert one_cpu_per_core([0, 1, 2, 3, 4, 5], topology) == [0, 1, 2]
    assert one_cpu_per_core([4, 5], topology) == [4, 5]  # a sibling outside the affinity does not count
    assert one_cpu_per_core([7, 8], topology) == [7, 8]  # unreadable topology: every CPU kept
