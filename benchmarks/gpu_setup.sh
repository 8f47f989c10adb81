# Source on the GPU machine (no network): install the wheels in ./.whl and this package into
# /tmp/site, then put it on PYTHONPATH. Fetch the wheels here first: bash ../shared/gpu/wheels.sh
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
    2>&1 | grep -v -i warning || true
export PYTHONPATH=/tmp/site
python3 -c "import megatron_ext.kernels, megatron.core; print('megatron-ext ready')"
