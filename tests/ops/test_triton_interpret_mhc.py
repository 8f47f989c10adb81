"""Our fused Triton kernels of mHC's stream ops (kernels/residual/triton_mhc.py) on Triton's CPU
interpreter, forward and backward, and efficient.mhc_pre / efficient.stream_update with them in
place; plus the fallbacks: sizes the kernels do not take, and kernels that fail their first-use
check. Skipped where Triton is not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/ops/test_triton_mhc.py and runs its ``check_launchers`` on ``interpret_cases``
(n = 2, 3, 4 and 8, 37 tokens, not a multiple of the 16 of a program, h not a multiple of the
chunk of columns, h over two slabs of 128 columns with the last one partial (the pre op's
kernels at n = 2, h = 144 and n = 4, h = 208, update_backward at the latter; the pre forward's
and update_backward's per-slab sums then summed over the slabs, the pre backward's loops over h
taking two chunks), tokens as [3, 13], a strided view, no tokens, fp16 at h = 208 (the
pre op's GEMM result rounded once, after the sum over the slabs); that module's tolerances, 1e-5
of the largest magnitude in fp32), every load and store checked to stay inside the tensors of
its launch (the bounds checker of triton_interpreter.py), and then its ``check_ops``:
efficient.mhc_pre and stream_update with the kernels running CPU tensors against the same ops
with them off, with and without recompute_input (the op bodies stay eager here). bf16 is not
run: the interpreter's tl.dot multiplies bf16 inputs as raw 16-bit integers (see
test_triton_interpret_decay.py); fp16 runs the same reduced-precision code path. ~15 s on two
cores.
"""
import types

import pytest
import torch

import triton_interpreter
from triton_interpreter import needs_triton


def interpret_cases(Case) -> list:
    """The cases run on the interpreter (Case from the GPU module): small enough for a CPU."""
    return [
        # 37 tokens: a partial block of 64 (pre forward), 32 (pre backward) and 16 (the rest)
        Case(n=2, shape=(37,), h=144),  # chunks and slabs of 128: one full, one of 16
        Case(n=3, shape=(37,), h=80),  # n padded to 4; one partial chunk of 128
        Case(n=4, shape=(37,), h=80),
        Case(n=4, shape=(37,), h=208),  # a slab (chunk) of 128 columns and one of 80
        Case(n=4, shape=(3, 13), h=48, strided=True),
        Case(n=8, shape=(20,), h=48),  # 80 mixes padded to 128; LAUNCH_WIDE: chunks of 16
        Case(n=4, shape=(0,), h=16),
        Case(n=4, shape=(37,), h=208, dtype=torch.float16),  # x @ W^T rounded after the slab sum
    ]


def main() -> None:
    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_triton_mhc")
    cases = interpret_cases(checks.Case)
    triton_interpreter.run_cases(cases, checks.check_launchers)
    triton_interpreter.run_ops(checks, "efficient.mhc_pre and stream_update")
    triton_interpreter.report_passed(len(cases))


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


@needs_triton
def test_unsupported_sizes_are_named_and_run_in_pytorch(monkeypatch):
    from megatron_ext.kernels.residual import efficient, triton_mhc

    for shape, dtype, reason in [
            ((3, 4, 24), torch.float32, r"h that is a multiple of 16, got h = 24"),
            ((3, 9, 16), torch.float32, r"2 <= n <= 8 streams, got n = 9"),
            ((3, 1, 16), torch.float32, r"2 <= n <= 8 streams, got n = 1"),
            ((3, 4, 16), torch.float64, r"fp32, bf16 or fp16 streams"),
            ((16,), torch.float32, r"needs streams \[\.\.\., n, h\]")]:
        streams = torch.zeros(shape, dtype=dtype)
        with pytest.raises(ValueError, match=reason):
            triton_mhc.update_forward(streams, streams, streams, streams)  # streams checked first
    # efficient runs such streams in the PyTorch bodies without asking the kernels.
    triton_interpreter.triton_on_cpu(monkeypatch, *efficient.OPS)
    monkeypatch.setattr(efficient, "_triton_kernels", lambda: None)  # the Sinkhorn: PyTorch too
    monkeypatch.setattr(efficient, "_triton_mhc_checked",
                        lambda *key: pytest.fail(f"the kernels were checked at {key}"))
    n, h = 4, 24
    streams = torch.randn(5, n, h, requires_grad=True)
    weight, bias, gate = torch.randn(24, n * h) * 0.1, torch.randn(24), torch.randn(3)
    u, post, res = efficient.mhc_pre(streams, weight, bias, gate)
    out = efficient.stream_update(streams, u, post, res)
    out.sum().backward()
    expected = efficient._stream_update_forward_body(streams.detach(), u.detach(), post.detach(),
                                                     res.detach())
    torch.testing.assert_close(out.detach(), expected)


def test_mhc_kernels_that_fail_their_check_are_not_used(monkeypatch, caplog):
    """Kernels that import but compute the wrong thing on this device (a miscompile) are caught
    by the first-use check and the PyTorch bodies run instead: simulated on the CPU with a
    stand-in module whose update_forward is off by 1%."""
    from megatron_ext.kernels.residual import efficient

    def off(*args):
        return 1.01 * efficient._stream_update_forward_body(*args)

    wrong = types.SimpleNamespace(
        pre_forward=efficient._mhc_pre_forward_body, pre_backward=efficient._mhc_pre_vjp,
        update_forward=off, update_backward=efficient._stream_update_vjp)
    monkeypatch.setattr(efficient, "_triton_mhc_kernels", lambda: wrong)
    monkeypatch.setattr(efficient, "_triton_kernels", lambda: None)
    triton_interpreter.triton_on_cpu(monkeypatch, *efficient.OPS)
    efficient._triton_checked.cache_clear()
    streams, y = torch.randn(7, 4, 16), torch.randn(7, 16)
    post, res = torch.randn(7, 4), torch.randn(7, 4, 4)
    try:
        with caplog.at_level("WARNING"):
            out = efficient.stream_update(streams, y, post, res)
            out_again = efficient.stream_update(streams, y, post, res)
    finally:
        efficient._triton_checked.cache_clear()
    expected = efficient._stream_update_forward_body(streams, y, post, res)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out_again, expected, rtol=0, atol=0)
    assert caplog.text.count("the Triton mHC kernels failed their check") == 1, caplog.text


if __name__ == "__main__":
    main()


def test_fused_mhc_kernels_are_on_unless_turned_off(monkeypatch):
    """Where Triton runs, mhc_pre and stream_update take the fused mHC kernels (once checked)
    with the default backend, and not with ``triton_mhc=False``, which leaves the other
    residual kernels on."""
    from megatron_ext.kernels.residual import efficient

    triton_interpreter.triton_on_cpu(monkeypatch, *efficient.OPS)
    monkeypatch.setattr(efficient, "_triton_mhc_checked", lambda *key: True)
    monkeypatch.setattr(efficient, "_triton_sinkhorn_checked", lambda *key: True)
    streams = torch.zeros(5, 4, 16)
    default = efficient.Backend()
    assert default.triton and default.triton_mhc and not default.compiled
    assert efficient._triton_mhc_for(default, streams) is efficient._triton_mhc_kernels()
    bodies = efficient.Backend(triton_mhc=False)
    assert efficient._triton_sinkhorn_for(bodies, torch.zeros(5, 4, 4)) is not None
    assert efficient._triton_mhc_for(bodies, streams) is None
    assert efficient._triton_mhc_for(efficient.Backend(triton=False), streams) is None
