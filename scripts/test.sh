#!/usr/bin/env bash
# The test suite (CPU, multi-process gloo included; GPU tests skip without CUDA).
# Tests marked slow are left out unless asked for: `bash scripts/test.sh -m slow`.
# With two CPUs or more it runs as two pytest-xdist workers, each taking whole files (so that a
# file's module fixtures run once); `-n 0` runs it in one process, as do NCCL runs
# (MEGATRON_EXT_TEST_DIST=nccl), whose worlds take every GPU.
source "$(dirname "$0")/env.sh"
args=("$@")
if [[ " $* " != *" -n "* ]] && [ "$(nproc)" -ge 2 ] && [ "${MEGATRON_EXT_TEST_DIST:-gloo}" != nccl ]; then
    args=(-n 2 --dist loadfile "${args[@]}")
fi
if [[ " $* " == *" -m "* ]]; then
    exec python -m pytest "${args[@]}"
fi
exec python -m pytest -m "not slow" "${args[@]}"
