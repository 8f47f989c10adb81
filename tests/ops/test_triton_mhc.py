"""The fused Triton kernels of mHC's stream ops (kernels/residual/triton_mhc.py) against the
PyTorch bodies they replace (kernels/residual/efficient.py), forward and backward, and
efficient.mhc_pre / efficient.stream_update with them in place, on CUDA (skipped without a GPU).

``check_launchers`` and ``check_ops`` are the checks; tests/ops/test_triton_interpret_mhc.py also
runs them on the CPU under Triton's interpreter (small fp32 and fp16 cases).

``check_launchers`` runs the four launchers (pre_forward, pre_backward, also with the streams'
gradient from the update added, update_forward, update_backward) and the bodies
(_mhc_pre_forward_body, _mhc_pre_vjp,
_stream_update_forward_body, _stream_update_vjp, eager) on the same device, inputs and dtype:
streams, y and the stream gradients in the case's dtype, parameters and coefficients fp32 (as
the model has them). ``mixes`` for the pre op's backward is the body's. Cases on CUDA: n = 4 (mHC's
default), h = 1024, T = 8192 + 37 tokens (a partial block of 16), in fp32 and bf16; n = 2, 3, 8
(3 padded to 4, 8 with 80 mixes padded to 128) at h = 272 (a partial chunk of columns where
n <= 4; several slabs of columns, the last partial); tokens as [3, 13]; streams as a strided view
(copied by the launchers).

Tolerances, rtol and atol relative to each output's largest magnitude (sums over h = 1024 or
over 8229 tokens grow with their length; their rounding with it):
  fp32: 1e-5. Both sides are fp32 with sums in another order, the GPU's exp, rsqrt and fused
        multiply-adds; an algebra slip (a wrong sign, a missing r, an unmasked pad) gives 1e-2
        or more.
  bf16 / fp16: 2^-6. Both sides round the same intermediates (GEMM results, the projection's
        dx) and results to the streams' dtype, from fp32 values that differ in rounding, so one
        may be a unit in the last place (2^-8 .. 2^-7 relative in bf16) off, and that shows in
        what follows (u through H_pre, dX through the projection).
Measured on the interpreter: at most 4e-7 of the largest magnitude in fp32, 2e-5 in fp16.
Those tolerances cannot tell whether the kernels round to bf16 / fp16 where the bodies do (a
rounding missed moves a value by less than 1e-3 of the largest), so in bf16 and fp16 at most
``MAX_DIFFERING`` = 2% of the elements of each output in that dtype (u, dX, out, dy) may differ
from the body's at all: both sides round fp32 values that differ in their last bits, so almost
all agree bitwise (on the interpreter in fp16, 0.1% differ; with the rounding of a GEMM result
or of the projection's dx left out of the kernels, 9% to 13%; with x @ W^T rounded per slab of
columns rather than after the sum over the slabs, 4% of u).
The launchers and bodies run with cuBLAS's reduced-precision bf16 reductions off
(:func:`fp32_reductions`): the bodies mean fp32 accumulation, as the kernels do.

``check_ops`` runs efficient.mhc_pre (also with ``pass_through``, its passed streams read by a
stream update, as mHC runs it) and efficient.stream_update with the Triton kernels in place
(their launches counted) and with them off (a backend with ``triton=False``: the PyTorch bodies,
compiled with ``compiled``), also with ``recompute_input``, and compares values and gradients at
the tolerances of tests/ops/test_residual_ops.py (fp32) or 2^-6 (bf16).
"""
import contextlib
import dataclasses
import zlib

import pytest
import torch

from megatron_ext.kernels.residual import efficient

pytestmark = pytest.mark.gpu

EPS = 1e-6
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -6}
HALF_DTYPES = (torch.bfloat16, torch.float16)
MAX_DIFFERING = 0.02


@dataclasses.dataclass(frozen=True)
class Case:
    n: int = 4
    shape: tuple[int, ...] = (8192 + 37,)  # the token dimensions before [n, h]
    h: int = 1024
    dtype: torch.dtype = torch.float32
    strided: bool = False  # streams as a view [..., n, :h] of a wider tensor

    def __str__(self) -> str:
        parts = [f"n{self.n}", "x".join(map(str, self.shape)), f"h{self.h}", str(self.dtype)[6:]]
        return "-".join(parts + ["strided"] * self.strided)


CASES = [
    Case(),
    Case(dtype=torch.bfloat16),
    Case(n=2, shape=(1000,), h=272),
    Case(n=3, shape=(1000,), h=272, dtype=torch.bfloat16),
    Case(n=8, shape=(517,), h=272),
    Case(shape=(3, 13), h=272, strided=True),
]


def _inputs(case: Case, device):
    """Streams-like tensors in the case's dtype, parameters and coefficients fp32."""
    generator = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))
    n, h, lead = case.n, case.h, case.shape
    width = (2 + n) * n

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=generator)).to(dtype).to(device)

    if case.strided:
        streams = randn(*lead, n, h + 16, dtype=case.dtype)[..., :h]
        assert not streams.is_contiguous()
    else:
        streams = randn(*lead, n, h, dtype=case.dtype)
    return dict(
        streams=streams, y=randn(*lead, h, dtype=case.dtype),
        grad_u=randn(*lead, h, dtype=case.dtype), grad=randn(*lead, n, h, dtype=case.dtype),
        weight=randn(width, n * h, scale=(n * h) ** -0.5), bias=randn(width),
        gate=randn(3, scale=0.5), grad_post=randn(*lead, n), dres=randn(*lead, n, n),
        post=randn(*lead, n), res=torch.softmax(randn(*lead, n, n), -2))


def compare(actual, expected, tolerance, what) -> float:
    """Assert ``actual`` equals ``expected`` (dtype and shape too) at rtol ``tolerance`` and atol
    ``tolerance`` times expected's largest magnitude; returns the largest difference relative
    to that magnitude."""
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, rtol=tolerance, atol=tolerance * scale,
                               msg=lambda m: f"{what}: {m}")
    if not expected.numel():
        return 0.0
    return ((actual.float() - expected.float()).abs().max() / scale).item()


@contextlib.contextmanager
def fp32_reductions():
    """bf16 matmuls reduce in fp32, as the bodies state and the kernels do. cuBLAS may otherwise
    reduce split-K partial sums in bf16 (``allow_bf16_reduced_precision_reduction``, on by
    default): on an H200 that alone makes 3.4% of pre_backward's bf16 dX differ at n = 3,
    h = 272."""
    matmul = torch.backends.cuda.matmul
    was = matmul.allow_bf16_reduced_precision_reduction
    matmul.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = was


def check_launchers(case: Case, device) -> dict[str, float]:
    """The four launchers against the PyTorch bodies on ``device`` (with fp32 reductions);
    returns the largest differences (relative to each output's largest magnitude) per
    launcher."""
    with fp32_reductions():
        return _check_launchers(case, device)


def _check_launchers(case: Case, device) -> dict[str, float]:
    from megatron_ext.kernels.residual import triton_mhc

    x = _inputs(case, device)
    streams, weight, bias, gate = x["streams"], x["weight"], x["bias"], x["gate"]
    y, post, res = x["y"], x["post"], x["res"]
    expected_forward = efficient._mhc_pre_forward_body(streams, weight, bias, gate, EPS)
    mixes = expected_forward[3]
    pre_grads = (streams, weight, bias, gate, mixes, x["grad_u"], x["grad_post"], x["dres"], EPS)
    runs = {
        "pre_forward": (triton_mhc.pre_forward(streams, weight, bias, gate, EPS), expected_forward,
                        ("u", "post", "res_logits", "mixes")),
        "pre_backward": (triton_mhc.pre_backward(*pre_grads), efficient._mhc_pre_vjp(*pre_grads),
                         ("dstreams", "dweight", "dbias", "dgate")),
        # with the streams' gradient from the update added (mhc_pre's pass_through)
        "pre_backward_plus": (triton_mhc.pre_backward(*pre_grads, x["grad"]),
                              efficient._mhc_pre_vjp(*pre_grads, x["grad"]),
                              ("dstreams", "dweight", "dbias", "dgate")),
        "update_forward": ((triton_mhc.update_forward(streams, y, post, res),),
                           (efficient._stream_update_forward_body(streams, y, post, res),),
                           ("out",)),
        "update_backward": (triton_mhc.update_backward(streams, y, post, res, x["grad"]),
                            efficient._stream_update_vjp(streams, y, post, res, x["grad"]),
                            ("dstreams", "dy", "dpost", "dres")),
    }
    tolerance = TOLERANCES[case.dtype]
    errors = {}
    for launcher, (got, expected, names) in runs.items():
        assert len(got) == len(expected) == len(names), launcher
        errors[launcher] = max(compare(value, want, tolerance, f"{case} {launcher} {name}")
                               for value, want, name in zip(got, expected, names))
        for value, want, name in zip(got, expected, names):
            if want.dtype in HALF_DTYPES and want.numel():
                differ = (value != want).float().mean().item()
                assert differ <= MAX_DIFFERING, (f"{case} {launcher} {name}: {differ:.1%} of the "
                                                 "elements differ from the body's")
    return errors


def kernels_backend(enabled: bool, compiled: bool = False) -> efficient.Backend:
    """The backend with efficient's Triton kernels, the fused mHC ones included, on or off,
    and the PyTorch bodies compiled with ``compiled``."""
    return efficient.Backend(compiled=compiled, triton=enabled, triton_mhc=enabled)


def _values_and_grads(op, inputs, backend: efficient.Backend):
    """``op``'s outputs and the gradients of a random projection of them with respect to the
    inputs that require them, forward and backward with ``backend``."""
    out = op(*inputs, backend=backend)
    out = out if isinstance(out, tuple) else (out,)
    generator = torch.Generator().manual_seed(2)
    grads = [torch.randn(o.shape, generator=generator).to(o.dtype).to(o.device) for o in out]
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    return out, torch.autograd.grad(out, leaves, grads)


def check_ops(device, dtype=torch.float32, compiled: bool = False, h: int = 48) -> int:
    """efficient.mhc_pre and efficient.stream_update on ``device`` with the Triton kernels in
    place (asserted by counting their launches) against the same ops with them off (the PyTorch
    bodies, compiled with ``compiled``), with and without ``recompute_input``: values at rtol
    1e-5 and gradients at 1e-4 in fp32 (as tests/ops/test_residual_ops.py; atol 1e-5 times
    each tensor's largest magnitude), 2^-6 in bf16. Returns how many kernel launches the ops
    made."""
    from megatron_ext.kernels.residual import triton_mhc

    n, lead, width = 4, (3, 5), 24
    names = ("pre_forward", "pre_backward", "update_forward", "update_backward")
    originals = {name: getattr(triton_mhc, name) for name in names}
    launches = []

    def counted(name):
        return lambda *args: launches.append(name) or originals[name](*args)

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape, scale=1.0, dtype=torch.float32):
        value = (scale * torch.randn(*shape, generator=generator)).to(dtype).to(device)
        return value.requires_grad_()

    # The kernels' first-use check on this device (not counted below), which they must pass.
    assert efficient._triton_mhc_checked(torch.empty(0, device=device).device, n, dtype)
    if dtype == torch.float32:
        rtol, grad_rtol, atol = 1e-5, 1e-4, 1e-5
    else:
        rtol = grad_rtol = atol = TOLERANCES[dtype]
    streams, weight, bias, gate = (leaf(*lead, n, h, dtype=dtype), leaf(width, n * h, scale=0.1),
                                   leaf(width), leaf(3, scale=0.5))
    y, post, res = leaf(*lead, h, dtype=dtype), leaf(*lead, n), leaf(*lead, n, n)
    again = streams.detach().clone()  # what recompute_input returns

    def mhc_pre(recompute):
        return lambda *args, backend: efficient.mhc_pre(
            *args, recompute_input=(lambda: again) if recompute else None, backend=backend)

    def stream_update(recompute):
        return lambda *args, backend: efficient.stream_update(
            *args, recompute_input=(lambda: again) if recompute else None, backend=backend)

    def mhc_sublayer(recompute):
        """mhc_pre passing its streams on to a stream update of them, as mhc.py runs the two."""
        def call(streams, weight, bias, gate, y, backend):
            u, post, res, passed = efficient.mhc_pre(
                streams, weight, bias, gate, recompute_input=(lambda: again) if recompute
                else None, pass_through=True, backend=backend)
            return u, stream_update(recompute)(passed, y, post, res, backend=backend)
        return call

    for name in names:
        setattr(triton_mhc, name, counted(name))
    try:
        for recompute in (False, True):
            for label, op, inputs in (
                    ("mhc_pre", mhc_pre(recompute), (streams, weight, bias, gate)),
                    ("stream_update", stream_update(recompute), (streams, y, post, res)),
                    ("mhc_sublayer", mhc_sublayer(recompute), (streams, weight, bias, gate, y))):
                (out_fast, grads_fast), (out_slow, grads_slow) = (
                    _values_and_grads(op, inputs, kernels_backend(enabled, compiled))
                    for enabled in (True, False))
                for what, fast, slow, tolerance in (
                        ("value", out_fast, out_slow, rtol),
                        ("gradient", grads_fast, grads_slow, grad_rtol)):
                    for k, (a, b) in enumerate(zip(fast, slow, strict=True)):
                        scale = max(1.0, b.abs().max().item())
                        torch.testing.assert_close(
                            a, b, rtol=tolerance, atol=atol * scale,
                            msg=lambda m: f"{label} recompute={recompute} {what} {k}: {m}")
        # What is kept for backward is as without the kernels: with recompute_input, no streams.
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                      lambda t: t):
            stream_update(True)(streams, y, post, res, backend=kernels_backend(True, compiled))
        assert sorted(saved) == sorted([y.numel(), post.numel(), res.numel()]), saved
        if compiled:
            assert not efficient.compile_failures(), "op bodies fell back to eager mode"
    finally:
        for name in names:
            setattr(triton_mhc, name, originals[name])
    sublayer = ["pre_forward", "update_forward", "update_backward", "pre_backward"]
    assert launches == (["pre_forward", "pre_backward", "update_forward", "update_backward"]
                        + sublayer) * 2 + ["update_forward"], launches
    return len(launches)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_launchers_equal_the_bodies(case):
    check_launchers(case, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_first_use_check_passes(dtype):
    efficient._triton_checked.cache_clear()
    device = torch.empty(0, device="cuda").device  # cuda:0, as the ops see it
    assert efficient._triton_mhc_checked(device, 4, dtype)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_run_the_kernels_and_equal_the_bodies(dtype, compiled):
    check_ops("cuda", dtype, compiled, h=1024)
