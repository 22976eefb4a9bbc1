"""Every benchmark script runs once at a tiny size, so the benchmarks cannot rot.

These check that each script finishes, prints its table and appends a complete record (command,
machine, versions) to the README it is given.  They never assert timings: the numbers at this size
mean nothing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, cli_env

BENCH = REPO / "benchmarks"


def run_script(name: str, tmp_path: Path, *args: str, timeout: float = 240) -> tuple[str, str]:
    """Run ``benchmarks/<name>`` with a scratch README, plot folder and workdir; return (stdout, README)."""
    readme = tmp_path / "README.md"
    cmd = [
        sys.executable,
        str(BENCH / name),
        "--readme",
        str(readme),
        "--plot-dir",
        str(tmp_path),
        "--workdir",
        str(tmp_path / "work"),
        *args,
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=cli_env(), cwd=REPO)
    assert res.returncode == 0, f"{name} failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    text = readme.read_text()
    assert f"benchmarks/{name}" in text and "Machine:" in text and "Versions:" in text, text
    return res.stdout, text


@pytest.mark.timeout(240)
def test_longtail(tmp_path):
    out, readme = run_script(
        "longtail.py",
        tmp_path,
        "--prompts",
        "64",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--length-mean",
        "16",
        "--max-new-tokens",
        "64",
        "--time-scale",
        "0.002",
        "--sweep",
        "1,2",
        "--partition-size",
        "8",
        "--sample-period",
        "0.01",
    )
    assert "| sync |" in out and "streaming (window" in out
    assert "| yes |" in out  # both sides generated the same tokens
    (png,) = tmp_path.glob("longtail-*.png")
    assert png.stat().st_size > 0 and png.name in readme


@pytest.mark.timeout(300)
def test_longtail_real(tmp_path, tiny_model):
    out, _ = run_script(
        "longtail_real.py",
        tmp_path,
        "--model",
        str(tiny_model),
        "--prompts",
        "6",
        "--max-new-tokens",
        "8",
        "--batch-size",
        "4",
        "--partition-size",
        "2",
        "--sides",
        "static,sync,daskgen",
    )
    assert "static model.generate batches" in out and "daskgen (transformers engine)" in out
    assert "sync batches, same transformers engine" in out
    (png,) = tmp_path.glob("longtail_real-*.png")
    assert png.stat().st_size > 0


@pytest.mark.timeout(300)
def test_overhead(tmp_path, tiny_model):
    out, _ = run_script(
        "overhead.py",
        tmp_path,
        "--repeats",
        "1",
        "--engine-drivers",
        "direct,worker,daskgen",
        "--prompts",
        "128",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "32",
        "--length-mean",
        "8",
        "--partition-size",
        "16",
        "--model",
        str(tiny_model),
        "--engine-prompts",
        "4",
        "--engine-samples",
        "1",
        "--engine-max-new-tokens",
        "8",
        "--max-requests",
        "4",
        "--engine-partition-size",
        "2",
    )
    assert "daskgen / direct write rate" in out and "daskgen / direct tokens/s" in out
    assert "same engine on a Dask worker" in out


@pytest.mark.timeout(240)
def test_storage(tmp_path):
    out, _ = run_script(
        "storage.py",
        tmp_path,
        "--prompts",
        "48",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "32",
        "--length-mean",
        "8",
        "--repeats",
        "1",
        "--workers",
        "1",
    )
    for name in ("daskgen store", "JSONL", "JSONL.gz", "pickled batches"):
        assert name in out
    assert "Store bytes / JSONL bytes" in out


@pytest.mark.timeout(300)
def test_resume(tmp_path):
    out, _ = run_script(
        "resume.py",
        tmp_path,
        "--prompts",
        "5000",
        "--repeats",
        "2",
        "--crash-prompts",
        "96",
        "--crash-partition-size",
        "8",
        "--crash-time-scale",
        "0.3",
    )
    assert "store level" in out
    assert "| **prompts regenerated although already done** | 0 |" in out


@pytest.mark.timeout(300)
def test_scaleout(tmp_path):
    out, _ = run_script(
        "scaleout.py",
        tmp_path,
        "--workers",
        "1,2",
        "--prompts-per-worker",
        "16",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--length-mean",
        "16",
        "--max-new-tokens",
        "64",
        "--time-scale",
        "0.002",
        "--partition-size",
        "8",
        "--client-prompts",
        "128",
        "--commit-rows",
        "10000",
        "--commit-samples",
        "5",
        "--full-speed-prompts",
        "256",
    )
    assert "scaling efficiency" in out and "Client saturation estimate" in out
    # the client part ran with the scheduler in the client process, in daskgen's scheduler process and in
    # processes started by hand, each with Dask's own floor (trivial tasks) measured on the same cluster
    assert "Scheduler in-process" in out and "Scheduler process" in out and "Scheduler separate" in out
    assert out.count("Dask floor: client CPU ms per trivial task") == 3
    assert out.count("scheduler process CPU ms per partition") == 2 and "| nanny process CPU ms per partition" in out
    assert out.count("Dask floor at full speed: client CPU ms per task") == 3
    # and each layout again with instant stand-in partitions: the client near saturation
    assert out.count("full speed: client CPU ms per partition") == 3 and out.count("(at full speed,") == 3


@pytest.mark.timeout(240)
def test_tail(tmp_path):
    out, _ = run_script(
        "tail.py",
        tmp_path,
        "--prompts",
        "64",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--partition-size",
        "8",
        "--max-new-tokens",
        "512",
        "--time-scale",
        "0.002",
    )
    assert "best emulated / measured" in out and out.count("| long tail") == 2 and "| light tail" in out
    assert "default + --length-hints, measured" in out


@pytest.mark.timeout(240)
def test_tail_emulated_only(tmp_path):
    out, _ = run_script(
        "tail.py",
        tmp_path,
        "--prompts",
        "64",
        "--n-samples",
        "2",
        "--max-batch",
        "16",
        "--partition-size",
        "8",
        "--max-new-tokens",
        "512",
        "--emulate-only",
    )
    assert "speed-up from hints" in out and "measured" not in out.split("| distribution")[1].split("\n")[0]


@pytest.mark.timeout(240)
def test_preemption(tmp_path):
    out, _ = run_script(
        "preemption.py",
        tmp_path,
        "--prompts",
        "48",
        "--n-samples",
        "1",
        "--max-new-tokens",
        "256",
        "--partition-size",
        "4",
        "--time-scale",
        "0.05",
        "--length-mean",
        "100",
    )
    assert "tokens regenerated" in out and "| SIGTERM at 50 % + resume |" in out


@pytest.mark.timeout(300)
def test_pack(tmp_path):
    out, _ = run_script("pack.py", tmp_path, "--prompts", "2000", "--repeats", "1", "--workers", "1")
    assert "| files |" in out and "values of the first 4,096 rows identical after packing: yes" in out


@pytest.mark.timeout(300)
def test_object_store(tmp_path):
    out, _ = run_script(
        "object_store.py",
        tmp_path,
        "--prompts",
        "256",
        "--run-prompts",
        "64",
        "--n-samples",
        "2",
        "--max-new-tokens",
        "16",
        "--partition-size",
        "32",
        "--workers",
        "1",
    )
    assert "s3:// (moto_server, loopback)" in out and "commit (per partition)" in out and "run wall s" in out
