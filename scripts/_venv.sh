# Sourced by scripts/*: make sure .venv exists and holds this checkout with its extras.
# Reinstalls only when setup.cfg or pyproject.toml changed since the last install.
# VENV (default .venv) and PYTHON (default python3, 3.11 or newer) may be set by the caller.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
ensure_venv() {
  local extras=${1:-}
  local stamp="$VENV/.installed${extras:+-$extras}"
  if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
  fi
  if [ ! -f "$stamp" ] || [ setup.cfg -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "installing vllm-gateway${extras:+[$extras]} into $VENV ..." >&2
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
    touch "$stamp"
  fi
}

# vllm-router from PyPI into bench-out/router-venv, where the benchmarks look for it
# (benchmarks/router.py), for the side-by-side comparisons.
install_router() {
  "$PYTHON" -m venv bench-out/router-venv
  bench-out/router-venv/bin/pip install -q --disable-pip-version-check vllm-router
}
