"""The Triton Sinkhorn kernels of mHC (kernels/residual/triton_sinkhorn.py) against the fp32
reference, forward and backward, and the mHC pre op with them in place, on CUDA (skipped
without a GPU).

``check_case`` and ``check_ops`` are the checks; tests/ops/test_triton_interpret_sinkhorn.py
also runs them on the CPU under Triton's interpreter.

``check_case`` compares the kernels' forward with ``reference.sinkhorn`` and their backward with
autograd through it and with ``efficient._sinkhorn_vjp`` (the PyTorch replay the backward
kernel runs, keeping the iterates in a scratch buffer as that keeps them in a list), all three
in fp32 on the CPU, on the same logits and output gradient. Cases: n = 4 (mHC's default) and
every other n of 2 .. 8 (3, 5, 6 and 7 padded to a power of two inside the kernels), 20
iterations, 7, 2 (the first row pass walked back) and 1 (the softmax and one column pass),
token counts that are not multiples of a program's block of tokens (8 at n = 4, 32 at n = 2,
2 at n = 5 .. 8) or smaller than one block, none at all, strongly peaked logits (standard
deviation 30: rows that are nearly one-hot, often two in the same column), a strided view (the
H_res columns of mHC's mixes, 24 floats a token) and bf16 logits (read and widened to fp32).

Tolerances: rtol 1e-5, atol 1e-6, fp32 rounding. Values and gradients are at most ~1 in
magnitude; the kernels add n numbers in another order than PyTorch, and on a GPU their ``tl.exp``
is not PyTorch's, so each of the 2 iters - 1 normalisations may round differently. Measured on
the interpreter: at most 2e-7 absolute, and the kernels are as close to an fp64 run of the same
definition as the fp32 reference is (both within 2e-7). The GPU's exponential (ex2.approx of
the fp32 product x log2(e), 2 ulp) emulated in the reference moves it by at most 3.6e-7 on
these cases (20 random draws each). An algebraic slip (a wrong axis, a reverse step of the
other axis, unmasked padding) gives 1e-1 or more, an access outside the tensors fails the
interpreter run.

``check_ops`` runs ``efficient.sinkhorn`` and ``efficient.mhc_pre`` (fp32, n = 4, 20 iterations)
with the kernels in place, checks that they ran, and compares values and gradients with the
plain-autograd reference at the tolerances of tests/ops/test_residual_ops.py, eagerly and (on
CUDA) with the op bodies compiled, which is how training runs them.
"""
import dataclasses
import functools
import zlib

import pytest
import torch

from megatron_ext.kernels.residual import efficient, reference

pytestmark = pytest.mark.gpu

RTOL, ATOL = 1e-5, 1e-6


@dataclasses.dataclass(frozen=True)
class Case:
    n: int = 4
    iters: int = 20
    shape: tuple[int, ...] = (37,)  # the token dimensions before [n, n]
    scale: float = 1.0  # standard deviation of the logits
    strided: bool = False  # logits as the H_res columns of a [..., (2 + n) n] mixes tensor
    dtype: torch.dtype = torch.float32

    def __str__(self) -> str:
        parts = [f"n{self.n}", f"iters{self.iters}", "x".join(map(str, self.shape)) or "scalar",
                 f"scale{self.scale:g}"]
        return "-".join(parts + ["strided"] * self.strided + [str(self.dtype)[6:]])


CASES = [
    Case(),
    Case(shape=(3, 13), scale=30.0),  # peaked; 39 tokens as [3, 13]
    Case(iters=1, scale=3.0),
    Case(n=3, scale=30.0),
    Case(n=8, shape=(13,), scale=5.0),
    Case(n=2, shape=(130,), scale=30.0),
    Case(n=5, iters=7, shape=(11,), scale=2.0),
    Case(shape=(29,), scale=5.0, strided=True),
    Case(shape=(1,), scale=5.0),
    Case(shape=(0,)),
    Case(scale=5.0, dtype=torch.bfloat16),
    # Each n of 2 .. 8 at 1, 2 and 20 iterations between them.
    Case(n=2, iters=2, shape=(45,), scale=3.0),
    Case(n=3, iters=1, shape=(21,), scale=2.0),
    Case(n=4, iters=2, shape=(3, 7), scale=5.0),
    Case(n=5, iters=20, shape=(9,), scale=30.0),
    Case(n=6, iters=2, shape=(7,), scale=3.0),
    Case(n=6, iters=20, shape=(5,), scale=5.0),
    Case(n=7, iters=1, shape=(5,), scale=2.0),
    Case(n=7, iters=20, shape=(11,), scale=5.0),
    Case(n=8, iters=2, shape=(3,), scale=5.0),
]


def _logits(case: Case, device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    n = case.n
    if case.strided:
        mixes = torch.randn(*case.shape, (2 + n) * n, generator=generator) * case.scale
        logits = mixes.to(device)[..., 2 * n:].unflatten(-1, (n, n))
        assert not logits.is_contiguous()
        return logits.to(case.dtype)
    return (torch.randn(*case.shape, n, n, generator=generator) * case.scale).to(case.dtype).to(device)


def check_case(case: Case, device) -> dict[str, float]:
    """Run the kernels on ``device`` and the references on the CPU; assert they agree. Returns
    the largest absolute differences."""
    from megatron_ext.kernels.residual import triton_sinkhorn

    logits = _logits(case, device)
    grad = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out = triton_sinkhorn.sinkhorn_forward(logits, case.iters)
    dlogits = triton_sinkhorn.sinkhorn_backward(logits, grad, case.iters)

    x = logits.detach().cpu().float().requires_grad_()
    expected = reference.sinkhorn(x, case.iters)
    (expected_grad,) = torch.autograd.grad(expected, x, grad.cpu())
    replay = efficient._sinkhorn_vjp(x.detach(), grad.cpu(), case.iters, reference.EPS)
    assert out.dtype == dlogits.dtype == torch.float32 and out.shape == dlogits.shape == logits.shape
    for actual, wanted, what in ((out, expected, "forward"), (dlogits, expected_grad, "backward"),
                                 (dlogits, replay, "backward vs _sinkhorn_vjp")):
        torch.testing.assert_close(actual.cpu(), wanted, rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{case} {what}: {m}")
    if logits.numel() == 0:
        return {"forward": 0.0, "backward": 0.0}
    return {"forward": (out.cpu() - expected).abs().max().item(),
            "backward": (dlogits.cpu() - expected_grad).abs().max().item()}


def _same_values_and_grads(fast, slow, inputs, rtol, grad_rtol, atol):
    """As tests/ops/test_residual_ops.py: outputs and the gradients of a random projection."""
    out_fast, out_slow = fast(*inputs), slow(*inputs)
    out_fast = out_fast if isinstance(out_fast, tuple) else (out_fast,)
    out_slow = out_slow if isinstance(out_slow, tuple) else (out_slow,)
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(o.shape, generator=generator).to(o.device) for o in out_slow]
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    for a, b in zip(out_fast, out_slow):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    for a, b in zip(torch.autograd.grad(out_fast, leaves, grads),
                    torch.autograd.grad(out_slow, leaves, grads)):
        torch.testing.assert_close(a, b, rtol=grad_rtol, atol=atol)


def _mhc_pre_reference(streams, weight, bias, gate):
    n = streams.shape[-2]
    mixes = reference.rms_project(streams.flatten(-2), weight)
    pre, post, res = reference.mhc_coefficients(mixes, bias, gate, n)
    return reference.stream_mix(streams, pre), post, res


def check_ops(device, compiled: bool = False) -> int:
    """efficient.sinkhorn and efficient.mhc_pre on ``device`` with the Triton kernels in place
    (asserted), against the reference; ``compiled``: with the op bodies compiled. Returns how
    many kernel launches the two ops made (forward and backward, 2 each)."""
    from megatron_ext.kernels.residual import triton_sinkhorn

    launches = []
    forward, backward = triton_sinkhorn.sinkhorn_forward, triton_sinkhorn.sinkhorn_backward

    def counted(fn):
        return lambda *args: launches.append(fn.__name__) or fn(*args)

    n, h = 4, 16
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(device).requires_grad_()

    # The kernels' first-use check on this device (not counted below), which they must pass.
    assert efficient._triton_sinkhorn_checked(torch.empty(0, device=device).device, n)  # cuda:0
    backend = efficient.Backend(compiled=compiled)
    triton_sinkhorn.sinkhorn_forward, triton_sinkhorn.sinkhorn_backward = counted(forward), counted(backward)
    try:
        _same_values_and_grads(functools.partial(efficient.sinkhorn, backend=backend),
                               reference.sinkhorn, (leaf(3, 5, n, n, scale=2.0), 20), 1e-5, 1e-4,
                               1e-5)
        width = (2 + n) * n
        _same_values_and_grads(functools.partial(efficient.mhc_pre, backend=backend),
                               _mhc_pre_reference,
                               (leaf(3, 5, n, h), leaf(width, n * h, scale=0.1), leaf(width),
                                leaf(3, scale=0.5)), 1e-5, 1e-4, 1e-5)
        # Still only the logits are kept for the backward.
        logits = leaf(32, n, n)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                      lambda t: t):
            efficient.sinkhorn(logits, 20, backend=backend)
        assert saved == [logits.numel()]
        if compiled:
            assert not efficient.compile_failures(), "op bodies fell back to eager mode"
    finally:
        triton_sinkhorn.sinkhorn_forward, triton_sinkhorn.sinkhorn_backward = forward, backward
    assert launches == ["sinkhorn_forward", "sinkhorn_backward"] * 2 + ["sinkhorn_forward"], launches
    return len(launches)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_equal_the_reference(case):
    check_case(case, "cuda")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ops_run_the_kernels_and_equal_the_reference(compiled):
    check_ops("cuda", compiled)
