"""Our Triton Sinkhorn kernels of mHC (kernels/residual/triton_sinkhorn.py) on Triton's CPU
interpreter, forward and backward, and the mHC ops with them in place. Skipped where Triton is
not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/gpu/test_triton_sinkhorn.py and runs its ``check_case`` on every case of ``CASES``
(n = 2, 3, 4, 5, 8; 20 iterations and fewer; token counts off the block size; peaked, strided
and bf16 logits; that module's tolerances, fp32 rounding), every load and store checked to
stay inside the tensors of its launch, and then its ``check_ops``: efficient.sinkhorn and
efficient.mhc_pre against the reference with the kernels running CPU tensors (on a real CPU
run the PyTorch iterations run instead; the op bodies stay eager here). ~15 s on two cores.
"""
import importlib.util
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

GPU_MODULE = pathlib.Path(__file__).resolve().parents[1] / "gpu" / "test_triton_sinkhorn.py"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def _check_bounds_on_the_interpreter() -> None:
    """Fail any load or store of a kernel that leaves the memory of the tensors passed to its
    launch, as test_triton_interpret_decay.py does, with a strided view's extent from its first
    to its last element (there a tensor is numel() elements from its data pointer)."""
    from triton.runtime import interpreter

    launch = {"kernel": None, "extents": []}
    run_grid = interpreter.GridExecutor.__call__
    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def extent(tensor):
        last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
        end = tensor.data_ptr() + (last + 1) * tensor.element_size() if tensor.numel() else tensor.data_ptr()
        return tensor.data_ptr(), end

    def run_grid_recording_extents(self, *args, **kwargs):
        tensors = [arg for arg in (*args, *kwargs.values()) if isinstance(arg, torch.Tensor)]
        launch.update(kernel=self.fn.__name__, extents=[extent(tensor) for tensor in tensors])
        run_grid(self, *args, **kwargs)

    def check(ptrs, mask, access):
        addresses = ptrs.data[np.broadcast_to(mask.data.astype(bool), ptrs.data.shape)]
        size = ptrs.get_element_ty().primitive_bitwidth // 8
        inside = np.zeros(addresses.shape, dtype=bool)
        for start, end in launch["extents"]:
            inside |= (addresses >= start) & (addresses + size <= end)
        if not inside.all():
            raise IndexError(f"{launch['kernel']}: {access} of {(~inside).sum()} elements outside the tensors of "
                             "the launch")

    def checked_load(self, ptrs, mask, *rest):
        check(ptrs, mask, "load")
        return load(self, ptrs, mask, *rest)

    def checked_store(self, ptrs, value, mask, *rest):
        check(ptrs, mask, "store")
        return store(self, ptrs, value, mask, *rest)

    interpreter.GridExecutor.__call__ = run_grid_recording_extents
    interpreter.InterpreterBuilder.create_masked_load = checked_load
    interpreter.InterpreterBuilder.create_masked_store = checked_store


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    from test_triton_interpret_decay import _fix_interpreter_for_numpy_2_4

    _fix_interpreter_for_numpy_2_4()
    _check_bounds_on_the_interpreter()
    spec = importlib.util.spec_from_file_location("triton_sinkhorn_checks", GPU_MODULE)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    for case in checks.CASES:
        start = time.perf_counter()
        errors = checks.check_case(case, "cpu")
        print(f"{case}: ok, largest differences forward {errors['forward']:.1e}, backward "
              f"{errors['backward']:.1e} ({time.perf_counter() - start:.1f} s)", flush=True)
    from megatron_ext.kernels.residual import efficient

    start = time.perf_counter()
    efficient._TRITON_DEVICE_TYPES.add("cpu")  # the interpreter runs CPU tensors
    launches = checks.check_ops("cpu")
    print(f"efficient.sinkhorn and mhc_pre: ok, {launches} kernel launches "
          f"({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"all {len(checks.CASES)} interpreter cases passed")


@needs_triton
def test_kernels_on_the_interpreter():
    environment = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "interpreter cases passed" in done.stdout, (done.stdout + done.stderr)[-6000:]


@needs_triton
def test_unsupported_sizes_are_named():
    from megatron_ext.kernels.residual import triton_sinkhorn

    for shape in [(3, 9, 9), (3, 1, 1), (3, 4, 5), (4,)]:
        with pytest.raises(ValueError, match=r"needs logits \[\.\.\., n, n\] with 2 <= n <= 8"):
            triton_sinkhorn.sinkhorn_forward(torch.zeros(shape))


if __name__ == "__main__":
    main()
