# Sourced by run.sh and test.sh: create .venv and install the package with its extras when needed.
# Re-installs only when pyproject.toml changed since the last install (a stamp file records it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NUMBA_DECONV_VENV:-$ROOT/.venv}"
PYTHON_BIN="${PYTHON:-python3}"
STAMP="$VENV/.numba_deconv-installed"
if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating virtual environment in $VENV"
    "$PYTHON_BIN" -m venv "$VENV"
fi
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[setup] installing numba_deconv[test,notebooks] (first run takes a minute or two)"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet -e "$ROOT[test,notebooks]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
