# Sourced by .ci/run and the lanes' environment scripts.  `venv_install VENV ARGS...` installs ARGS (pip-style
# requirements and options) into the virtualenv VENV with uv, pinned below, from PyPI and the local wheel folders
# and indexes this machine's pip is configured with (read from pip's own configuration, so torch comes from local
# disk exactly as pip takes it).  Measured on a 2-core machine with empty caches: the same packages as pip
# installs (`pip freeze` of both venvs equal), the main venv in 34 s instead of 73 s, the sglang lane's in 60-70 s
# instead of 181 s, at about half the CPU time.  uv writes no bytecode (as pip with --no-compile): modules are
# compiled when first imported.  Its cache is $DASKGEN_CI_CACHE/uv, kept between runs on one machine.
UV_VERSION="0.13.9"

# The interpreter the virtualenvs are made from: $DASKGEN_CI_PYTHON when set; else Debian's python3.11 where the
# machine has it, with venv; else python3.  Machines of this kind put a pyenv build first on PATH, configured without
# profile-guided or link-time optimisation and with the interpreter in a shared library; Debian builds its python3.11
# with both and links the interpreter in.  Measured on a 2-core machine of this kind (A/B pairs, median CPU ratios,
# pyenv / Debian): a module of pure-Python tests 1.28x, importing vLLM's engine 1.18x, importing Dask, daskgen's CLI,
# Zarr and xarray 1.05x; four of the main lane's end-to-end modules 1.03x-1.14x; the whole of .ci/run, the same tree
# run twice one after the other, 1,924 s against 1,763 s (main lane 2,056 against 1,786 CPU-s, engine lanes 1,628
# against 1,561).
ci_python() {
  if [ -n "${DASKGEN_CI_PYTHON:-}" ]; then
    echo "$DASKGEN_CI_PYTHON"
  elif /usr/bin/python3.11 -c 'import ensurepip, venv' 2>/dev/null; then
    echo /usr/bin/python3.11
  else
    echo python3
  fi
}

# venv_create VENV PYTHON: make the virtualenv VENV from PYTHON; one made from another interpreter is made anew.
venv_create() {
  local venv="$1" python="$2" want have
  want="$("$python" -c 'import sys; print(sys.base_prefix, sys.version.split()[0])')"
  if [ -x "$venv/bin/python" ]; then
    have="$("$venv/bin/python" -c 'import sys; print(sys.base_prefix, sys.version.split()[0])' 2>/dev/null || true)"
    [ "$have" = "$want" ] && return 0
    echo "$venv: made from ${have:-an interpreter that no longer runs}; made anew from $python ($want)"
    rm -rf "$venv"
  fi
  "$python" -m venv "$venv"
}

# The local sources of pip's configuration as uv options: --find-links and --extra-index-url, each once.
pip_sources() {
  python3 -m pip config list 2>/dev/null | python3 -c '
import shlex, sys
flags = {"find-links": "--find-links", "extra-index-url": "--extra-index-url", "index-url": "--index-url"}
seen = []
for line in sys.stdin:
    key, _, value = line.strip().partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for item in shlex.split(value) if flag else []:
        for part in item.split():
            if (flag, part) not in seen:
                seen.append((flag, part))
for flag, part in seen:
    print(flag, part, sep="\n")
'
}

venv_install() {  # VENV ARGS...
  local venv="$1"
  shift
  [ -x "$venv/bin/uv" ] || "$venv/bin/python" -m pip install -qq --disable-pip-version-check "uv==$UV_VERSION"
  local sources=()
  mapfile -t sources < <(pip_sources)
  # UV_NATIVE_TLS: the system's certificates, which this machine's pip is configured with
  UV_CACHE_DIR="${UV_CACHE_DIR:-${DASKGEN_CI_CACHE:-$HOME/.cache/daskgen-ci}/uv}" UV_NO_PROGRESS=1 UV_NATIVE_TLS=1 \
    "$venv/bin/uv" pip install -q --python "$venv/bin/python" --index-strategy unsafe-best-match \
    "${sources[@]}" "$@"
}
