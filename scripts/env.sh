# Source this: creates or reuses the project's Python 3.12 virtual environment in .venv and
# installs megatron-ext (editable) with its test extras when setup.py or pyproject.toml changed since last time.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"

find_python() {
    # Python 3.12 (the version megatron-ext is tested with) if there is one, else a newer
    # python3 (setup.py asks for >= 3.12). pyenv's shims answer to `python3.12` even when 3.12
    # is not the active version, so each candidate must actually run as that version.
    local candidates=()
    if command -v pyenv >/dev/null 2>&1; then
        local v
        for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.12(\.|$)' | sort -rV); do
            candidates+=("$(pyenv root)/versions/$v/bin/python3.12")
        done
    fi
    candidates+=(python3.12 python3)
    local c want
    for want in '== (3, 12)' '>= (3, 12)'; do
        for c in "${candidates[@]}"; do
            if "$c" -c "import sys; sys.exit(not sys.version_info[:2] $want)" >/dev/null 2>&1; then
                command -v "$c"
                return
            fi
        done
    done
    echo "megatron-ext needs Python >= 3.12 (tested with 3.12: python3.12 on PATH, or installed with pyenv)" >&2
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[env] creating $VENV"
    "$(find_python)" -m venv "$VENV"
fi
STAMP="$VENV/.megatron-ext-installed"
WANT="$(cat "$ROOT/setup.py" "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
    echo "[env] installing megatron-ext and its dependencies (the first time downloads PyPI's torch, 4-5 GB)"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install --progress-bar on -e "$ROOT[dev]"
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
# `python -m` puts the working directory first on sys.path; from the repository root the
# top-level kernels/ folder (installed as megatron_ext.kernels) would then shadow PyPI's
# `kernels` package, which transformers imports.
export PYTHONSAFEPATH=1
cd "$ROOT"
