#!/usr/bin/env bash
# The main job: train the default tiny hybrid on this machine's Python standard library.
# Extra arguments go to `megatron-ext train` (e.g. --resume, --preset, --steps).
source "$(dirname "$0")/env.sh"
exec megatron-ext train "$@"
