"""The front page (README.md): its commands run as a new user types them, and what it says about itself holds.

The README's shell commands run in order, in one shell, in a copy of examples/: the demo of its first command
(the part after the installs, which are CI's own install step), then every later block but the test command
(``.ci/run``, which is CI itself).  The install facts it states match pyproject.toml and, in the engine lanes,
the pinned engines' own metadata.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import tomllib

from tests.conftest import REPO
from tests.test_guides import shell_env

README = REPO / "README.md"
TEXT = README.read_text()
FLAT = " ".join(TEXT.split())  # the text with its line breaks as spaces
BLOCKS = re.findall(r"```bash\n(.*?)```", TEXT, re.S)


def user_commands() -> str:
    """The README's commands after its first one's installs, in order, as one shell script."""
    first, *later = BLOCKS
    demo = first[first.index("daskgen run ") :].strip()
    assert first.rstrip().endswith(demo) and "pip install" in first[: first.index(demo)], first
    rest = [block.strip() for block in later if block.strip() != ".ci/run"]
    assert len(rest) == len(later) - 1, "the README names its test command, .ci/run, once"
    return "\n".join([demo, *rest])


def test_the_front_page_is_short_and_says_its_status_first():
    lines = TEXT.splitlines()
    assert len(lines) <= 160, len(lines)
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## When to choose it", "## Status and limits"], headings
    status = TEXT.split("## Status and limits\n", 1)[1]
    assert status.lstrip().startswith("- **No GPU run yet.**")
    first = (REPO / "benchmarks" / "README.md").read_text().split("\n## ", 1)[0]
    assert "**No GPU run yet.**" in first, "the benchmarks page says the same"


def test_the_test_command_is_what_ci_runs():
    assert ".ci/run" in [block.strip() for block in BLOCKS]
    ci = (REPO / ".ci" / "run").read_text()
    main_lane = re.search(
        r'python -m pytest (-m "not gpu and not sglang and not vllm" -n 3 --dist loadscope --no-loadscope-reorder)', ci
    )
    assert main_lane, "the main lane's command in .ci/run"
    testing = (REPO / "docs" / "testing.md").read_text()
    assert f"`python -m pytest {main_lane[1]}`" in testing, "docs/testing.md names the main lane's command"


def test_every_lane_writes_bytecode_and_the_engine_lanes_run_on_one_process_each():
    """What docs/testing.md says of the lanes' processes and of bytecode is what the CI scripts do."""
    testing = " ".join((REPO / "docs" / "testing.md").read_text().split())
    assert "lanes run side by side, each on one process" in testing
    assert "`PYTHONDONTWRITEBYTECODE=1`" in testing and "installed without compiling" in testing
    ci = (REPO / ".ci" / "run").read_text()
    assert "\nunset PYTHONDONTWRITEBYTECODE\n" in ci and '\n.ci/main-env.sh "$MAIN_VENV"\n' in ci, ci
    assert (REPO / ".ci" / "main-env.sh").read_text().count('venv_install "$VENV" ') == 4
    installer = (REPO / ".ci" / "install.sh").read_text()
    assert '"$venv/bin/uv" pip install' in installer and "--compile-bytecode" not in installer
    assert "pip's own configuration" in testing and "-m pip config list" in installer and '"${sources[@]}"' in installer
    for lane in ("sglang", "vllm"):
        script = (REPO / ".ci" / f"{lane}-lane").read_text()
        assert "\nunset PYTHONDONTWRITEBYTECODE\n" in script, lane
        runs = re.findall(r"-m pytest (?:.*\\\n)*.*", script)  # each command with its continued lines
        assert runs and not any(re.search(r" (-n|--numprocesses)[ =]", run) for run in runs), (lane, runs)
        assert '  venv_install "$VENV"' in (REPO / ".ci" / f"{lane}-env.sh").read_text(), lane


def test_every_virtualenv_of_ci_is_made_from_the_interpreter_ci_chooses():
    """docs/testing.md: the main lane's and the engine lanes' virtualenvs are made from Debian's python3.11 where the
    machine has it, another when DASKGEN_CI_PYTHON names it, and a cached one of another interpreter is made anew."""
    testing = " ".join((REPO / "docs" / "testing.md").read_text().split())
    assert "made from Debian's `python3.11` where the machine has it (`DASKGEN_CI_PYTHON` names another" in testing
    installer = (REPO / ".ci" / "install.sh").read_text()
    assert "/usr/bin/python3.11 -c 'import ensurepip, venv'" in installer and '"$DASKGEN_CI_PYTHON"' in installer
    assert 'rm -rf "$venv"' in installer  # a venv of another interpreter
    line = 'venv_create "$VENV" "$(ci_python)"'
    for script in ("main-env.sh", "sglang-env.sh", "vllm-env.sh"):
        text = (REPO / ".ci" / script).read_text()
        assert line in text and " -m venv " not in text, script


def test_every_pytest_run_of_ci_keeps_each_tests_time_in_a_file_of_its_own():
    """docs/testing.md: each lane writes every test's time to a JUnit XML file in the cache's logs folder, and
    ``.ci/run`` prints the CPU-seconds and the host's steal of each part."""
    testing = " ".join((REPO / "docs" / "testing.md").read_text().split())
    assert "writes every test's time to a JUnit XML file in `$DASKGEN_CI_CACHE/logs/`" in testing
    files = []
    scripts = {"run": "$DASKGEN_CI_CACHE/logs/", "sglang-lane": "$CACHE/logs/", "vllm-lane": "$CACHE/logs/"}
    for script, logs in scripts.items():
        text = (REPO / ".ci" / script).read_text()
        runs = re.findall(r"-m pytest (?:.*\\\n)*.*", text)  # each command with its continued lines
        assert runs, script
        for run in runs:
            found = re.search(r'--junitxml "([^"]+\.xml)"', run)
            assert found and found[1].startswith(logs), (script, run)
            files.append(found[1].rsplit("/", 1)[1])
    assert len(files) == len(set(files)) == 5, files
    ci = (REPO / ".ci" / "run").read_text()
    assert "CPU-s)," in ci and "$5, $6, $9}' /proc/stat" in ci  # /proc/stat's fields: idle, iowait, steal
    assert "waiting on the disk" in ci and "taken by the host" in ci
    assert "$(cut -d' ' -f1-3 /proc/loadavg)" in ci and "prints the machine's load averages" in testing
    assert "the CPU-seconds they were busy (the whole machine's, from `/proc/stat`" in testing  # not only the run's
    assert 'exec > >(tee "$DASKGEN_CI_CACHE/logs/run.log") 2>&1' in ci and "logs/run.log`" in testing
    assert "or were taken by the host (steal)" in testing and "waited on the disk (iowait)" in testing


def test_the_tests_run_one_torch_thread_per_process_and_their_local_clusters_too():
    """docs/testing.md: the session sets OMP_NUM_THREADS and daskgen.local-cpu-threads to 1 unless they are set."""
    from daskgen import tunables
    from daskgen.deploy.local import cpu_threads_per_worker

    testing = " ".join((REPO / "docs" / "testing.md").read_text().split())
    assert "sets `OMP_NUM_THREADS=1` and the [`local-cpu-threads`](architecture.md) tunable to 1" in testing
    assert os.environ["OMP_NUM_THREADS"] and os.environ["DASK_DASKGEN__LOCAL_CPU_THREADS"]
    assert "sets `OMP_WAIT_POLICY=PASSIVE` unless set" in testing and os.environ["OMP_WAIT_POLICY"]
    assert tunables.get("local-cpu-threads") == int(os.environ["DASK_DASKGEN__LOCAL_CPU_THREADS"])
    assert cpu_threads_per_worker(1) == tunables.get("local-cpu-threads")
    import torch  # imported after the variable was set: its thread pool has that size

    assert torch.get_num_threads() == int(os.environ["OMP_NUM_THREADS"])


def test_the_engine_versions_the_front_page_names_are_the_pinned_ones():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == ["vllm==0.32.0"] and "`pip install -e '.[vllm]'` (vLLM 0.32.0)" in FLAT
    assert extras["sglang"] == ["sglang==0.5.23"] and "`pip install -e '.[sglang]'` (SGLang 0.5.23, which" in FLAT


@pytest.mark.sglang
def test_the_pinned_sglang_pins_the_torch_and_cuda_build_the_front_page_names():
    from importlib.metadata import requires, version

    assert version("sglang") == "0.5.23"
    pins = requires("sglang") or []
    assert "torch==2.14.1" in pins and "pins torch 2.14.1" in FLAT, pins
    assert any(p.startswith("flashinfer_python[cu13]") for p in pins) and "FlashInfer for CUDA 13" in FLAT, pins


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_the_readme_commands_run_in_order_as_written(tmp_path):
    shutil.copytree(REPO / "examples", tmp_path / "examples", ignore=shutil.ignore_patterns("*.zarr", "tiny-model"))
    script = user_commands() + "\nwait $!  # the distillation run started in the background\n"
    done = subprocess.run(
        ["bash", "-ec", script], cwd=tmp_path, env=shell_env(), capture_output=True, text=True, timeout=1100
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    prompts = len((REPO / "examples" / "prompts.jsonl").read_text().splitlines())
    assert f"{prompts} done, 0 failed, 0 pending of {prompts} prompts" in done.stdout, output[-8000:]
    rows = len((REPO / "examples" / "distill.jsonl").read_text().splitlines())
    assert f"{rows} done, 0 failed, 0 pending of {rows} prompts" in done.stdout, output[-8000:]
    assert f"{rows * 2} samples taken" in done.stdout, output[-8000:]  # every sample of distill.yaml's n_samples 2
