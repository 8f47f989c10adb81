"""Our fused Triton kernels of depth attention (kernels/residual/triton_depth.py) on Triton's CPU
interpreter, forward and backward, and efficient.depth_attention with them in place; plus the
fallbacks: calls the kernels do not take, and kernels that fail their first-use check. Skipped
where Triton is not installed.

As test_triton_interpret_mhc.py: this file run as a script under TRITON_INTERPRET=1 loads
tests/ops/test_triton_depth.py and runs its ``check_launchers`` on ``interpret_cases`` (K = 1,
2, 4, 6 and 41 sources in 1 to 4 groups of different sizes, strided views into packed tensors;
the first group's last source plus a tensor and an incoming gradient for it, or neither; 37
tokens (not a multiple of the 16 of a program), tokens as [3, 13], no tokens; h not a multiple
of the 128-column chunk; fp32 at 1e-5 of the largest magnitude and fp16 at 2^-6), every load and
store checked to stay inside the tensors of its launch, then its ``check_ops``:
efficient.depth_attention with the kernels running CPU tensors against it with them off, values
and autograd gradients (K = 1, 2, 6, 41); and ``check_add_into_last_slot`` (block AttnRes's exit:
bitwise, 37 tokens, 3 slots of 144 columns). bf16 is not run (the interpreter's bf16 is emulated;
fp16 runs the same reduced-precision code path). ~10 s on two cores.
"""
import types

import pytest
import torch

import triton_interpreter
from triton_interpreter import needs_triton


def interpret_cases(Case) -> list:
    """The cases run on the interpreter (Case from the GPU module): small enough for a CPU."""
    return [
        Case(sizes=(1,), shape=(37,), h=80),  # K = 1, its only source plus a tensor
        Case(sizes=(1, 1), shape=(37,), h=144),  # K = 2; a full and a partial chunk of columns
        Case(sizes=(3, 1), shape=(37,), h=48, plus=False, first_grad=False),
        Case(sizes=(2, 3, 1), shape=(3, 13), h=48, separate=False),  # K = 6, strided views
        Case(sizes=(2, 1, 2, 1), shape=(37,), h=16),  # four groups
        Case(sizes=(40, 1), shape=(37,), h=48),  # K = 41 padded to 64: full AttnRes, 20 layers
        Case(sizes=(1, 2), shape=(0,), h=16),  # no tokens
        Case(sizes=(3, 2, 1), shape=(37,), h=80, dtype=torch.float16),
    ]


def main() -> None:
    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_triton_depth")
    cases = interpret_cases(checks.Case)
    triton_interpreter.run_cases(cases, checks.check_launchers)
    triton_interpreter.run_ops(checks, "efficient.depth_attention")
    if triton_interpreter.takes_next():
        for dtype in (torch.float32, torch.float16):  # 37 tokens; 3 slots of 144: partial tiles
            checks.check_add_into_last_slot("cpu", dtype, shape=(37,), h=144, slots=3)
        print("add_into_last_slot: ok", flush=True)
    triton_interpreter.report_passed(len(cases))


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


@needs_triton
def test_unsupported_calls_are_named_and_run_in_pytorch(monkeypatch):
    from megatron_ext.kernels.residual import efficient, triton_depth

    query = torch.zeros(16)
    for groups, reason in [
            ([torch.zeros(3, 2, 24)], r"h that is a multiple of 16, got h = 24"),
            ([torch.zeros(3, 1, 16)] * 5, r"1 to 4 source groups, got 5"),
            ([torch.zeros(3, 65, 16)], r"1 to 64 sources in all, got 65"),
            ([torch.zeros(3, 2, 16, dtype=torch.float64)], r"fp32, bf16 or fp16 sources"),
            ([torch.zeros(3, 2, 16), torch.zeros(3, 2, 16, dtype=torch.float16)],
             r"groups in one dtype"),
            ([torch.zeros(3, 2, 16), torch.zeros(1, 2, 16)], r"no broadcasting")]:
        with pytest.raises(ValueError, match=reason):
            triton_depth.forward(query, groups, 1e-6)
    with pytest.raises(ValueError, match=r"last_plus must be torch.float32 \(3, 16\)"):
        triton_depth.forward(query, [torch.zeros(3, 2, 16)], 1e-6, torch.zeros(3, 1, 16))
    # efficient runs such calls in the PyTorch path without checking the kernels.
    triton_interpreter.triton_on_cpu(monkeypatch, *efficient.OPS)
    monkeypatch.setattr(efficient, "_triton_depth_checked",
                        lambda *key: pytest.fail(f"the kernels were checked at {key}"))
    query = torch.randn(24, requires_grad=True)
    packed = torch.randn(5, 3 * 24, requires_grad=True)
    out, passed = efficient.depth_attention(query, [packed.unflatten(-1, (3, 24))],
                                            last_plus=torch.randn(5, 24), pass_through=True)
    (out.sum() + passed.sum()).backward()
    assert packed.grad is not None


@needs_triton
def test_launches_pass_strides_that_are_multiples_of_16():
    """The kernels are compiled for strides that are multiples of 16 elements and 16-byte
    aligned tensors (their loads are vectorised): views that are so are passed as they are,
    others copied; a dimension of one element passes stride 0."""
    from megatron_ext.kernels.residual import triton_depth

    packed = torch.randn(5, 7, 3 * 32)
    view = triton_depth._tokens_view(packed.unflatten(-1, (3, 32))[:, :, 1:], 2, 32)
    assert view.data_ptr() == packed.data_ptr() + 32 * packed.element_size()  # no copy
    assert (view.stride(0), view.stride(1)) == (96, 32)
    odd = torch.randn(35, 2, 40)[:, :, :32]  # strides 80 and 40
    view = triton_depth._tokens_view(odd, 2, 32)
    assert view.is_contiguous() and torch.equal(view, odd)
    shifted = torch.randn(35 * 32 + 1)[1:].view(35, 1, 32)  # 4 bytes off 16-byte alignment
    view = triton_depth._tokens_view(shifted, 1, 32)
    assert view.data_ptr() % 16 == 0 and torch.equal(view, shifted)
    single = torch.randn(1, 1, 32)
    assert (triton_depth._stride(single, 0), triton_depth._stride(single, 1)) == (0, 0)


def test_depth_kernels_that_fail_their_check_are_not_used(monkeypatch, caplog):
    """Kernels that import but compute the wrong thing on this device are caught by the
    first-use check and the PyTorch path runs instead: simulated on the CPU with a stand-in
    module whose forward is off by 1%."""
    from megatron_ext.kernels.residual import efficient

    def off(query, groups, eps, last_plus=None, first_out=None):
        out, *rest = efficient._depth_forward(
            query, efficient._with_last_plus(groups, last_plus), eps)
        return (1.01 * out, *rest)

    def backward(query, groups, grad, z, r, alpha, eps, last_plus=None, first_grad=None):
        return efficient._depth_backward_pytorch(query, groups, grad, z, r, alpha, last_plus,
                                                 first_grad)

    wrong = types.SimpleNamespace(
        padded_sources=lambda k: 4,
        forward=off, backward=backward)
    monkeypatch.setattr(efficient, "_triton_depth_kernels", lambda: wrong)
    triton_interpreter.triton_on_cpu(monkeypatch, *efficient.OPS)
    efficient._triton_checked.cache_clear()
    query, sources = torch.randn(16), [torch.randn(7, 3, 16), torch.randn(7, 1, 16)]
    try:
        with caplog.at_level("WARNING"):
            out = efficient.depth_attention(query, sources)
            out_again = efficient.depth_attention(query, sources)
    finally:
        efficient._triton_checked.cache_clear()
    expected = efficient._depth_forward(query, sources, 1e-6)[0]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out_again, expected, rtol=0, atol=0)
    assert caplog.text.count("the Triton depth-attention kernels failed their check") == 1, caplog.text


if __name__ == "__main__":
    main()
