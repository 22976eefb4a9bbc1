#!/usr/bin/env bash
# Build (or reuse) the main lane's virtualenv: torch's CPU wheel, daskgen (editable) with its dev extra, and verl.
#
#   .ci/main-env.sh VENV
#
# Idempotent: a stamp in VENV records a hash of this script, .ci/install.sh and pyproject.toml.  When it matches,
# only daskgen itself is re-linked; otherwise VENV is made anew from nothing, so no package of an older
# pyproject.toml lingers.  A reused VENV keeps the bytecode its earlier runs wrote: the tests' first imports of
# torch, transformers, Dask and the rest read it instead of compiling them again.  Measured on a 2-core machine:
# installing took 14-19 s of each run, and importing torch, transformers, Dask, Zarr, xarray and pandas took
# 16.6 s from source against 6.2 s from bytecode.
set -euo pipefail

VENV="${1:?usage: $0 VENV}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(dirname "$HERE")"
. "$HERE/install.sh"

stamp="$VENV/.daskgen-main-env"
want="$(cat "${BASH_SOURCE[0]}" "$HERE/install.sh" "$REPO/pyproject.toml" | sha256sum | cut -d' ' -f1)"

venv_create "$VENV" "$(ci_python)"  # .ci/install.sh: a venv of another interpreter is made anew
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c 'import torch, dask, zarr' 2>/dev/null; then
  venv_install "$VENV" --no-deps -e "$REPO"
  echo "main env: $VENV is up to date"
  exit 0
fi

if [ -e "$stamp" ] || [ -x "$VENV/bin/uv" ]; then  # installed for another pyproject.toml, or left half-built: start over
  rm -rf "$VENV"
  venv_create "$VENV" "$(ci_python)"
fi
venv_install "$VENV" torch==2.13.0           # the CPU wheel on local disk
venv_install "$VENV" -e "$REPO[dev]"
# verl, for DataProto in tests/test_follow*.py: without its dependencies (it pins tensordict<=0.10 and
# transformers<5.11; DataProto needs only ray and omegaconf, from the dev extra).  Its wheel also ships a
# top-level `tests` package that would shadow this repository's tests/: removed.
venv_install "$VENV" --no-deps verl==0.9.1
rm -rf "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"
echo "$want" > "$stamp"
echo "main env: built $VENV"
