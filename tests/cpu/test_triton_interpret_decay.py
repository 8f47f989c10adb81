"""Our Triton decay kernels (kernels/decay/triton.py) on Triton's CPU interpreter, and the
backend's argument checks. Skipped where Triton is not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/gpu/test_triton_decay.py and runs its ``check_case`` on ``interpret_cases``, small
fp32 cases (and two fp16 ones) of every decay form, packed sequences and grouped heads, with
that module's tolerances, every load and store checked to stay inside the tensors passed to its
kernel (``_check_bounds_on_the_interpreter``). bf16 is not among them: the interpreter's tl.dot
multiplies bf16 inputs as raw 16-bit integers and it truncates fp32 to bf16 where the GPU rounds
to nearest (Triton 3.6), so bf16 is checked on the GPU only. ~25 s on two cores.
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

GPU_MODULE = pathlib.Path(__file__).resolve().parents[1] / "gpu" / "test_triton_decay.py"
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")


def interpret_cases(Case) -> list:
    """The subset run on the interpreter (Case from the GPU module): K = 16, V = 32 unless said,
    T up to 70, so that it fits a CPU budget. The per-channel cases are the slowest (its kernels
    loop over the 16 tokens of each sub-chunk) and get fewer heads."""
    small = dict(key_dim=16, value_dim=32)
    one_row = dict(batch=1, key_heads=1, value_heads=2, **small)  # still grouped: 1 q/k head, 2 v heads
    return [
        Case("none", seq_len=70, **small),  # B = 2, Hk = 2, Hv = 4, with an initial state
        Case("constant", seq_len=70, strong=True, **small),
        Case("per_head", seq_len=70, strong=True, **small),
        Case("per_head", seq_len=64, key_heads=2, value_heads=2, initial_state=False, key_dim=32,
             value_dim=16, scale=1.0),  # K > V, Hk = Hv, one exact chunk
        Case("per_head", lengths=(5, 64, 0, 1), **small),
        Case("per_channel", seq_len=70, strong=True, **one_row),
        Case("per_channel", lengths=(5, 65, 1), **one_row),
        # Several K blocks (64 wide) and several V blocks (32 wide in the state passes).
        Case("per_channel", seq_len=20, strong=True, **dict(one_row, key_dim=128, value_dim=16)),
        Case("per_head", seq_len=70, strong=True, **dict(one_row, key_dim=16, value_dim=128)),
        Case("per_head", seq_len=65, dtype=torch.float16, **one_row),
        Case("per_channel", seq_len=65, dtype=torch.float16, **one_row),
    ]


def _fix_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with int() of a 1-element
    array, which numpy >= 2.4 refuses, so a loop over a runtime number of chunks fails there
    (triton-lang/triton issue #9171, closed upstream). Take the element explicitly;
    the same value as before, for the interpreter only."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_with_index


def _check_bounds_on_the_interpreter() -> None:
    """Fail any load or store of a kernel that leaves the tensors passed to its launch. The
    interpreter reads and writes host memory directly, so an access past a tensor's end, which
    faults on a GPU (an illegal memory access) or corrupts a neighbouring buffer, would otherwise
    pass unnoticed. Lanes masked off are not checked: they access nothing on a GPU either. A
    tensor's extent runs from its first to its last element, so strided views count too."""
    from triton.runtime import interpreter

    launch = {"kernel": None, "extents": []}  # the running kernel's tensors: (first byte, end)
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
    """Run INTERPRET_CASES with the GPU module's check_case on the CPU (TRITON_INTERPRET=1), every
    memory access checked to stay inside the tensors of its launch."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    torch.set_num_threads(1)
    _fix_interpreter_for_numpy_2_4()
    _check_bounds_on_the_interpreter()
    spec = importlib.util.spec_from_file_location("triton_decay_checks", GPU_MODULE)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    cases = interpret_cases(checks.Case)
    for case in cases:
        start = time.perf_counter()
        errors = checks.check_case(case, "cpu")
        worst = max(errors, key=errors.get)
        print(f"{case}: ok, worst {worst} {errors[worst]:.1e} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"all {len(cases)} interpreter cases passed")


@needs_triton
def test_kernels_on_the_interpreter():
    environment = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, __file__], env=environment, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "interpreter cases passed" in done.stdout, (done.stdout + done.stderr)[-6000:]


@needs_triton
@pytest.mark.parametrize(("key_dim", "value_dim"), [(8, 32), (16, 48), (512, 32)])
def test_unsupported_dims_are_named(key_dim, value_dim):
    from megatron_ext.kernels import decay_linear_attention

    q = k = torch.zeros(1, 3, 1, key_dim)
    v = torch.zeros(1, 3, 1, value_dim)
    with pytest.raises(ValueError, match=rf"backend 'triton' cannot run K = {key_dim}, V = "
                                         rf"{value_dim}: the Triton kernels take head dims 16, 32, "
                                         rf"64, 128, 256"):
        decay_linear_attention(q, k, v, backend="triton")


@needs_triton
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs CPU tensors")
def test_refusals_name_the_reason():
    """What the backend cannot run it refuses with "<op>: backend 'triton' cannot run ...", which
    the self-check (``megatron-ext doctor``) reports as a skip, not a failure."""
    from megatron_ext.kernels import decay_linear_attention

    q = k = torch.zeros(1, 3, 1, 16)
    with pytest.raises(RuntimeError, match=r"decay_linear_attention: backend 'triton' cannot run tensors on cpu"):
        decay_linear_attention(q, k, torch.zeros(1, 3, 1, 16), backend="triton")
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run q in torch.float64"):
        decay_linear_attention(q.double(), k, torch.zeros(1, 3, 1, 16), backend="triton")


if __name__ == "__main__":
    main()
