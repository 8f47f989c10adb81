"""Our Triton decay kernels (kernels/decay/triton.py) on Triton's CPU interpreter, and the
backend's argument checks. Skipped where Triton is not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/ops/test_triton_decay.py and runs its ``check_case`` on ``interpret_cases``, small
fp32 cases (and two fp16 ones) of every decay form, packed sequences and grouped heads, with
that module's tolerances, every load and store checked to stay inside the tensors passed to its
kernel (triton_interpreter.py's bounds checker). bf16 is not among them: the interpreter's tl.dot
multiplies bf16 inputs as raw 16-bit integers and it truncates fp32 to bf16 where the GPU rounds
to nearest (Triton 3.6), so bf16 is checked on the GPU only. ~25 s on two cores.
"""
import os

import pytest
import torch

import triton_interpreter
from triton_interpreter import needs_triton


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


def main() -> None:
    """Run INTERPRET_CASES with the GPU module's check_case on the CPU (TRITON_INTERPRET=1), every
    memory access checked to stay inside the tensors of its launch."""
    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_triton_decay")
    cases = interpret_cases(checks.Case)
    triton_interpreter.run_cases(cases, checks.check_case)
    triton_interpreter.report_passed(len(cases))


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


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
    from megatron_ext.kernels import decay_linear_attention, registry

    q = k = torch.zeros(1, 3, 1, 16)
    with pytest.raises(RuntimeError, match=r"decay_linear_attention: backend 'triton' cannot run tensors on cpu"):
        decay_linear_attention(q, k, torch.zeros(1, 3, 1, 16), backend="triton")
    with pytest.raises(RuntimeError, match=r"backend 'triton' cannot run inputs in torch.float64"):
        registry.choose("decay_linear_attention", "triton", device="cuda", dtype=torch.float64)


if __name__ == "__main__":
    main()
