#!/usr/bin/env bash
# The test suite (CPU, multi-process gloo included; GPU tests skip without CUDA).
# Tests marked slow are left out unless asked for: `bash scripts/test.sh -m slow`.
source "$(dirname "$0")/env.sh"
if [[ " $* " == *" -m "* ]]; then
    exec python -m pytest "$@"
fi
exec python -m pytest -m "not slow" "$@"
