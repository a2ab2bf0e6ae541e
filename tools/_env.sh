# Sourced by tools/demo and tools/test: make .venv (if missing) and install ranklog
# with the extras named in $RANKLOG_EXTRAS (and the pins in $RANKLOG_PINS, resolved in the
# same pip call), re-installing only when pyproject.toml, the extras or the pins changed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RANKLOG_VENV:-$ROOT/.venv}"
EXTRAS="${RANKLOG_EXTRAS:-tensorboard,mlflow,wandb}"

find_python() {
    for py in "${PYTHON:-}" python3 python3.13 python3.12 python3.11 python; do
        [ -n "$py" ] || continue
        if command -v "$py" >/dev/null 2>&1 &&
            "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            echo "$py"
            return 0
        fi
    done
    echo "ranklog needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    PY="$(find_python)"
    echo "creating $VENV with $("$PY" --version)" >&2
    "$PY" -m venv "$VENV"
fi
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1
# A local wheelhouse (this workplace keeps torch's CPU build there) is used when present.
if [ -d /opt/wheels ]; then export PIP_FIND_LINKS="${PIP_FIND_LINKS:-/opt/wheels}"; fi

PINS="${RANKLOG_PINS:-}"
stamp_key="$( (cat "$ROOT/pyproject.toml"; echo "$EXTRAS $PINS") | sha256sum | cut -c1-16)"
stamp="$VENV/.ranklog-installed-$stamp_key"
if [ ! -f "$stamp" ]; then
    echo "installing ranklog[$EXTRAS] into $VENV" >&2
    "$PY" -m pip install -q --upgrade pip >&2
    # shellcheck disable=SC2086  # the pins are separate arguments
    "$PY" -m pip install -q -e "$ROOT[$EXTRAS]" $PINS >&2
    rm -f "$VENV"/.ranklog-installed-*
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
