"""Runs benchmarks/tail_control.py once at a tiny size so it cannot rot (no timing asserted), writing its record."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_tail_control_benchmark_runs(tmp_path):
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "tail_control.py"),
        "--prompts",
        "16",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "64",
        "--length-mean",
        "20",
        "--time-scale",
        "0",
        "--workers",
        "1",
        "--results",
        str(tmp_path / "results"),
        "--workdir",
        str(tmp_path / "work"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| full |" in res.stdout and "target 14 done" in res.stdout
    (record,) = (tmp_path / "results").glob("*-tail_control*.md")  # one record, a file of its own
    text = record.read_text()
    assert text.startswith("# Tail control: full run vs target / deadline stop (simulated engine) — ")
    shown = "DASK_DASKGEN__LOCAL_CPU_THREADS=1 "  # the test session's setting (tests/conftest.py), named as it ran
    assert f"Command: `{shown}python benchmarks/tail_control.py --prompts 16 " in text, text[:400]
    assert "Commit: benchmarks/ at " in text
    assert "| full |" in text and list((tmp_path / "results").iterdir()) == [record]
