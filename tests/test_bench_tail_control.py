"""Runs benchmarks/tail_control.py once at a tiny size so it cannot rot (no timing asserted)."""

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
        "--no-record",
        "--workdir",
        str(tmp_path),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| full |" in res.stdout and "target 14 done" in res.stdout
