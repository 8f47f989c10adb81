# Source on the GPU machine (no network): install the wheels in ./.whl into /tmp/site and lay
# this package out in /tmp/pkg the way setup.py maps it (kernels/, launch/ and slurm/ under
# megatron_ext), then put both on PYTHONPATH. Fetch the wheels here first:
#     bash ../shared/gpu/wheels.sh pyyaml tqdm psutil matplotlib contourpy cycler fonttools \
#         kiwisolver pillow pyparsing python-dateutil six packaging
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
rm -rf /tmp/pkg && mkdir -p /tmp/pkg
cp -r megatron_ext /tmp/pkg/ && cp -r kernels launch slurm /tmp/pkg/megatron_ext/
export PYTHONPATH=/tmp/site:/tmp/pkg
# From the repository root, python puts ./megatron_ext (which lacks kernels/) ahead of /tmp/pkg,
# so tests and scripts kept at the root run from copies: the tests in /tmp/tests_run, as in
#     (cd /tmp/tests_run && python3 -m pytest -q tests/ops/test_triton_mhc.py)
rm -rf /tmp/tests_run && mkdir -p /tmp/tests_run && cp -r tests pytest.ini /tmp/tests_run/
(cd /tmp && python3 -c "import megatron_ext.kernels, megatron.core; print('megatron-ext ready')")
