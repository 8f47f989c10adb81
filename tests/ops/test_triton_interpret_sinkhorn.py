"""Our Triton Sinkhorn kernels of mHC (kernels/residual/triton_sinkhorn.py) on Triton's CPU
interpreter, forward and backward, and the mHC ops with them in place. Skipped where Triton is
not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/ops/test_triton_sinkhorn.py and runs its ``check_case`` on every case of ``CASES``
(n = 2 .. 8; 20, 7, 2 and 1 iterations; token counts off the block size; peaked, strided and
bf16 logits; that module's tolerances, fp32 rounding), every load and store checked to stay
inside the tensors of its launch (the backward's scratch buffer is one of them), then
``check_scratch`` (the backward kernel keeps to its scratch buffer, and a buffer one step short
is caught), and then its ``check_ops``: efficient.sinkhorn and efficient.mhc_pre against the
reference with the kernels running CPU tensors (on a real CPU run the PyTorch iterations run
instead; the op bodies stay eager here). ~15 s on two cores.
"""
import time

import pytest
import torch

import triton_interpreter
from triton_interpreter import needs_triton


def check_scratch() -> None:
    """The backward kernel, launched with its scratch buffer ``[steps, T, n, n]`` as a view into
    a larger NaN-filled buffer, gives the gradient of ``sinkhorn_backward`` and leaves the rest
    of that buffer alone (no access before or after its scratch, in particular none to
    scratch[-1] from the last step's read-ahead); given a scratch one step short, the bounds
    checker stops it, which shows that the checker covers the scratch buffer."""
    from megatron_ext.kernels.residual import triton_sinkhorn
    from megatron_ext.kernels.residual.reference import EPS

    n, tokens, iters = 3, 21, 3  # padded to 4 x 4, 8 tokens a program: 3 programs, the last partial
    steps = 2 * iters - 1
    generator = torch.Generator().manual_seed(3)
    x, g = (torch.randn(tokens, n, n, generator=generator) for _ in range(2))
    expected = triton_sinkhorn.sinkhorn_backward(x, g, iters)
    step, slack = tokens * n * n, 64
    for short in (0, 1):
        buffer = torch.full((2 * slack + steps * step,), float("nan"))
        scratch = buffer[slack:slack + (steps - short) * step].view(steps - short, tokens, n, n)
        dx = torch.empty_like(x)
        try:
            triton_sinkhorn._launch(triton_sinkhorn._backward_kernel, x, n, x, g, dx, scratch, tokens,
                                    x.stride(0), g.stride(0), steps, EPS)
        except Exception as error:
            assert short and "_backward_kernel: store of" in str(error), error
            continue
        assert not short, "a scratch buffer one step short passed the bounds checker"
        assert torch.equal(dx, expected)
        assert buffer[:slack].isnan().all() and buffer[slack + steps * step:].isnan().all()
        assert not scratch.isnan().any()  # every entry written (the padding is never stored)


def main() -> None:
    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_triton_sinkhorn")
    triton_interpreter.run_cases(checks.CASES, checks.check_case)
    if triton_interpreter.takes_next():
        start = time.perf_counter()
        check_scratch()
        print(f"backward scratch buffer: ok ({time.perf_counter() - start:.1f} s)", flush=True)
    triton_interpreter.run_ops(checks, "efficient.sinkhorn and mhc_pre")
    triton_interpreter.report_passed(len(checks.CASES))


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


@needs_triton
def test_unsupported_sizes_are_named():
    from megatron_ext.kernels.residual import triton_sinkhorn

    for shape in [(3, 9, 9), (3, 1, 1), (3, 4, 5), (4,)]:
        with pytest.raises(ValueError, match=r"needs logits \[\.\.\., n, n\] with 2 <= n <= 8"):
            triton_sinkhorn.sinkhorn_forward(torch.zeros(shape))


if __name__ == "__main__":
    main()
