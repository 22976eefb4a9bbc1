#!/usr/bin/env bash
# Build (or reuse) the sglang CPU lane's virtualenv: the real, pinned sglang 0.5.23 on a machine
# with no GPU, plus daskgen (editable) and its test dependencies.
#
#   .ci/sglang-env.sh VENV [CACHE_DIR]
#
# VENV       the virtualenv to create or update (e.g. .venv-sglang)
# CACHE_DIR  the download caches (pip's, uv's) (default: $DASKGEN_CI_CACHE or ~/.cache/daskgen-ci); reused
#            across runs so that a rebuild downloads nothing
#
# Idempotent: a stamp in VENV records a hash of this script and the constraints file; when it
# matches and sglang imports, only daskgen itself is re-linked.  Everything comes from PyPI (and
# this machine kind's local wheel index for torch/torchvision); nothing is downloaded otherwise.
#
# Why it looks like this (measured, see shared research notes on sglang on CPU):
# * torch 2.14.1 + torchvision 0.29.1 are the pair on local disk for Python 3.11; sglang 0.5.23
#   pins torch==2.14.1, and this pair imports together without patching any installed file.
# * sglang is installed with --no-deps: its requirement list pulls CUDA-only kernels (sglang-kernel,
#   flashinfer, flash-attn-4, deep-gemm, ...).  The dependencies installed below are the ones the CPU
#   path (SGLANG_USE_CPU_ENGINE=1) imports.  sglang still imports its kernel package `sgl_kernel`;
#   the lane puts the import-only shim tests/sglang_shim on PYTHONPATH (see .ci/sglang-lane).
set -euo pipefail

VENV="${1:?usage: $0 VENV [CACHE_DIR]}"
CACHE="${2:-${DASKGEN_CI_CACHE:-$HOME/.cache/daskgen-ci}}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
CONSTRAINTS="$HERE/sglang-constraints.txt"
SGLANG_VERSION="0.5.23"

export PIP_CACHE_DIR="$CACHE/pip" UV_CACHE_DIR="$CACHE/uv" PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off
mkdir -p "$PIP_CACHE_DIR"
. "$HERE/install.sh"

stamp="$VENV/.daskgen-sglang-env"
want="$(cat "${BASH_SOURCE[0]}" "$CONSTRAINTS" | sha256sum | cut -d' ' -f1)"

pip_install() {  # with uv (.ci/install.sh), sglang's pins kept through the constraints file
  venv_install "$VENV" -c "$CONSTRAINTS" "$@"
}

smoke_test() {
  # Import what the lane needs, with the CPU engine switch and the shim, as the lane runs it.
  SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$REPO/tests/sglang_shim" "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch, torchvision, sglang, transformers, dask, zarr, xarray  # noqa: F401
from sglang.srt.server_args import ServerArgs  # noqa: F401
import sgl_kernel
assert getattr(sgl_kernel, "IS_DASKGEN_SHIM", False), sgl_kernel.__file__
print(f"sglang {sglang.__version__}, torch {torch.__version__}, torchvision {torchvision.__version__}, "
      f"transformers {transformers.__version__}, daskgen {md.version('daskgen')}")
EOF
}

venv_create "$VENV" "$(ci_python)"  # .ci/install.sh: a venv of another interpreter is made anew
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && smoke_test >/dev/null 2>&1; then
  pip_install --no-deps -e "$REPO"
  echo "sglang env: $VENV is up to date"
  exit 0
fi

start=$(date +%s)
rm -f "$stamp"

# 1. torch + torchvision: the CUDA builds on local disk (they run on the CPU).
pip_install torch==2.14.1 torchvision==0.29.1
# 2. sglang itself, without its CUDA-only requirement list.
pip_install --no-deps "sglang==$SGLANG_VERSION"
# 3. What sglang's CPU path imports, in-process and as an HTTP server (soundfile), with sglang's pins
#    kept via the constraints file.
pip_install \
  aiohttp anthropic apache-tvm-ffi blobfile compressed-tensors dill distro easydict einops fastapi gguf \
  interegular IPython llguidance mistral_common msgspec nvidia-ml-py openai openai-harmony orjson packaging \
  partial_json_parser pillow prometheus-client psutil pybase64 pydantic python-dateutil python-multipart \
  pyzmq regex requests scipy sentencepiece setproctitle soundfile tiktoken tokenizers torch_memory_saver \
  tqdm transformers uvicorn uvloop watchfiles xgrammar xxhash zstandard
# 4. daskgen's dependencies and test tools, then daskgen itself (editable, no dependency resolution).
# (tenacity: the openai engine's retries, tested against sglang's HTTP server in the same lane; peft: the LoRA
# adapters the tests make.)
pip_install 'dask[distributed]' zarr numcodecs xarray numpy pyarrow pyyaml tqdm typer accelerate httpx \
  tenacity peft pytest pytest-timeout
pip_install --no-deps -e "$REPO"

smoke_test
echo "$want" > "$stamp"
echo "sglang env: built $VENV in $(( $(date +%s) - start )) s ($(du -sh "$VENV" | cut -f1))"
