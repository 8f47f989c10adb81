"""Memory-lean autograd Functions for the residual-stream ops, equal to :mod:`.reference`.

Each forward computes the reference definition without a graph (in fp32 exactly; in bf16 the
mHC projection GEMM reads bf16, see below); each backward is written out by hand, so what stays
alive between forward and backward is chosen, not every intermediate:

- :func:`sinkhorn`: only its input; the iterations are recomputed in backward and
  differentiated step by step in reverse (the recompute-in-backward of mHC section 4.3).
- :func:`mhc_pre` (projection, coefficients with Sinkhorn, and the pre-mix of one sublayer, in
  one op so that a sublayer costs two autograd calls each way), :func:`rms_project`,
  :func:`stream_mix`, :func:`stream_update`: the n-stream tensor in its own dtype, never an
  fp32 copy, plus per-token coefficients; or no stream tensor at all when ``recompute_input``
  is given: a callable that re-creates it in backward (mHC's stage-wise recomputation,
  :class:`megatron_ext.residual.mhc.StreamReplay`).
- :func:`depth_attention`: references to its sources plus per-token fp32 scalars (inverse
  RMS, logits, weights), as the Attention Residuals paper describes for training.

What runs where is each call's ``backend`` (a :class:`Backend`; the model's residual schemes
pass the one ``ExtConfig.residual_backend`` maps to, :func:`megatron_ext.residual.ops_backend`).
The forward and backward of each op are PyTorch bodies (the ``_*_body`` and ``_*_vjp``
functions below). On CUDA (where Triton runs; ``Backend.triton``, on by default) some run in
Triton kernels of ours instead, each launched eagerly from its autograd Function: the Sinkhorn
iterations (two kernels, :mod:`.triton_sinkhorn`), :func:`depth_attention` (one kernel each way
for all source groups of a call, :mod:`.triton_depth`) and :func:`add_into_last_slot` (block
AttnRes's exit; also :mod:`.triton_depth`). The two mHC stream ops, :func:`mhc_pre` and
:func:`stream_update`, have fused kernels too (forward and backward, :mod:`.triton_mhc`), on
unless ``Backend.triton_mhc`` is off (in the 350M-class model's training step they beat the
compiled bodies: benchmarks/residual_step.py).
Kernels are used on a device only after passing a first-use check there (small random inputs
against the PyTorch bodies); where they cannot run (the CPU, no Triton, a failed check, sizes or
dtypes they do not take) the PyTorch bodies do. Each op with kernels (``sinkhorn``, ``mhc`` for
mhc_pre and stream_update, ``depth_attention``, ``add_into_last_slot``) is declared in the
backend registry (kernels.registry; the end of this module) with what its kernels take and
their first-use check; a call asks the registry, "auto" where its Backend has the kernels on,
else "pytorch", so the choice is logged once per op, device, dtype and choice.
Those bodies, and the ops without kernels (rms_project, stream_mix), can be compiled with
``torch.compile`` on CUDA (``Backend.compiled``): they are small elementwise and reduction
chains whose cost in eager mode is mostly kernel launches. A body whose compiled form fails
runs eagerly from then on in this process, the reason logged once (:func:`compile_failures`
names those bodies). The Sinkhorn iterations are never part of a compiled body (see the
Sinkhorn section): compiled, they would be unrolled into one kernel per normalisation.
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .. import registry
from . import reference
from .reference import EPS

__all__ = ["Backend", "compile_failures", "sinkhorn", "mhc_pre", "rms_project", "stream_mix",
           "stream_update", "depth_attention", "add_into_last_slot"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    """How the ops run (module docstring); every op takes one as ``backend``.

    ``compiled``: the PyTorch bodies through ``torch.compile`` (a body whose compiled form
    fails runs eagerly instead). ``triton``: our Triton kernels in place of the bodies where
    they run (CUDA tensors, after their first-use check on the device). ``triton_mhc``: with
    ``triton``, also the fused kernels of :func:`mhc_pre` and :func:`stream_update`; off, those
    two run the bodies while the other kernels stay on (to compare).

    The default, ``Backend()``: eager bodies, and every Triton kernel where it runs."""

    compiled: bool = False
    triton: bool = True
    triton_mhc: bool = True


_compiled: dict[Callable, Callable] = {}
_compile_failed: set[Callable] = set()  # bodies whose compiled form failed: eager from then on


def compile_failures() -> list[str]:
    """The names of the op bodies whose ``torch.compile``'d form failed in this process (each
    runs eagerly from then on); empty where every compiled body ran."""
    return sorted(fn.__name__ for fn in _compile_failed)


def _body(fn: Callable, dynamic: bool | None = None) -> Callable:
    """An op body, called as ``body(*args, compiled=...)``: compiled when ``compiled`` is true
    and its compiled form has not failed before; eager otherwise. ``dynamic=True`` for bodies
    whose shapes change from layer to layer (depth attention)."""

    @functools.wraps(fn)
    def call(*args, compiled: bool):
        if compiled and fn not in _compile_failed:
            compiled_fn = _compiled.get(fn)
            if compiled_fn is None:
                compiled_fn = _compiled[fn] = torch.compile(fn, dynamic=dynamic)
            try:
                return compiled_fn(*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:  # a compiler failure: the eager body computes the same
                _compile_failed.add(fn)
                _log.warning("torch.compile of the residual-stream op body %s failed (%s: %s); it "
                             "runs in eager PyTorch from now on", fn.__name__,
                             type(error).__name__, error)
        return fn(*args)

    return call


# ----------------------------------------------------------------------------- Triton kernels
# Where Triton runs (CUDA) and the backend has them on, the Sinkhorn iterations, mhc_pre /
# stream_update and depth_attention run in Triton kernels of ours (triton_sinkhorn.py,
# triton_mhc.py, triton_depth.py) in place of the PyTorch bodies; the rest of each op (saving
# for backward, recompute_input, the glue between kernels) is the same on every device. The
# kernels are launched from the autograd Functions between compiled bodies, never inside one
# (see the Sinkhorn section for why).
# The ops with kernels are declared in the backend registry (kernels.registry; at the end of
# this module): "pytorch" (the bodies) and "triton", which "auto" runs on CUDA (tests add the CPU
# under Triton's interpreter) where the kernels import and take the call and have passed their
# first-use check at the call's key. A Backend with the kernels off asks for "pytorch".
OPS = ("sinkhorn", "mhc", "depth_attention", "add_into_last_slot")


def _runs_triton(op: str, enabled: bool, *args, **kwargs) -> bool:
    """Whether ``op`` runs its Triton kernels for this call: the registry's choice, "auto"
    where the Backend has them on (``enabled``), else "pytorch"."""
    facts = registry.get(op).facts(*args, **kwargs)
    return registry.choose(op, registry.AUTO if enabled else "pytorch", facts) == "triton"


@functools.cache
def _kernel_constants(module: str):
    """Our Triton kernel module ``module`` for its limits (MAX_N, H_MULTIPLE, ...), or None where
    it does not import."""
    try:
        return importlib.import_module(f".{module}", __package__)
    except Exception:  # noqa: BLE001 - the rule then says the kernels do not import
        return None


def _import_kernels(module: str, label: str):
    """Our Triton kernel module ``module``, or None (logged) if it does not import."""
    try:
        return importlib.import_module(f".{module}", __package__)
    except Exception as error:  # no Triton here, or a broken one: the PyTorch bodies compute it
        _log.warning("the Triton %s kernels do not import (%s: %s); the PyTorch bodies run "
                     "instead", label, type(error).__name__, error)
        return None


@functools.cache
def _triton_kernels():
    """The module of the Triton Sinkhorn kernels, or None (logged once)."""
    return _import_kernels("triton_sinkhorn", "Sinkhorn")


@functools.cache
def _triton_mhc_kernels():
    """The module of the Triton mHC kernels, or None (logged once)."""
    return _import_kernels("triton_mhc", "mHC")


@functools.cache
def _triton_checked(label: str, check: Callable[..., None], device: torch.device, *key) -> bool:
    """Whether the Triton ``label`` kernels pass ``check(device, *key)``: a function that runs
    them on small random inputs and raises unless they give the PyTorch bodies' results. Run
    once per key, on the kernels' first use on ``device`` (at ``key``: n, and what else makes a
    different compiled kernel), so that they are only used once they have computed the right
    thing on this GPU and Triton (as the linear-recurrence kernels' self-check,
    kernels.backends). A failure or error is logged once and the PyTorch bodies run instead.
    The check runs without autocast (which would change the bodies' dtypes) and autograd."""
    try:
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            check(device, *key)
    except Exception as error:
        _log.warning("the Triton %s kernels failed their check on %s at n = %s (%s: %s); the "
                     "PyTorch bodies run instead", label, device, ", ".join(map(str, key)),
                     type(error).__name__, error)
        return False
    return True


def first_use_checks(device: torch.device) -> list:
    """The residual kernels' first-use checks as ``megatron-ext doctor`` runs them: one
    ``(kernels, configuration, dtype, run)`` per check, ``run()`` raising on a mismatch (without
    autocast and autograd, as on first use), or a string saying why it cannot run here. The
    configurations are the defaults': n = 4 streams; depth attention over 2 groups of 4
    sources (as a block AttnRes layer passes its completed blocks and its partial block); the
    in-place addition into the packed state's last slot over 3 slots. A row is skipped where
    its op's triton backend in the registry does not run on the device or the kernels do not
    import."""
    checks = [
        ("sinkhorn", "n=4, 20 iters", torch.float32, _triton_kernels, _check_triton_sinkhorn,
         (4,)),
        *(("mhc", "n=4", dtype, _triton_mhc_kernels, _check_triton_mhc, (4, dtype))
          for dtype in (torch.float32, torch.bfloat16)),
        *(("depth_attention", "2 groups of 4", dtype, _triton_depth_kernels,
           _check_triton_depth, (dtype, 2, 8)) for dtype in (torch.float32, torch.bfloat16)),
        *(("add_into_last_slot", "3 slots", dtype, _triton_depth_kernels,
           _check_triton_add_into_last_slot, (dtype,))
          for dtype in (torch.float32, torch.bfloat16)),
    ]

    def run(check, *args):
        with torch.autocast(device.type, enabled=False), torch.no_grad():
            check(device, *args)

    rows = []
    for kernels, configuration, dtype, module, check, args in checks:
        what = registry.get(kernels).backends["triton"].off_device(registry.Facts(device=device))
        if what is None and module() is None:
            what = "the Triton kernels do not import here (the log says why)"
        rows.append((kernels, configuration, dtype, what or functools.partial(run, check, *args)))
    return rows


# ---------------------------------------------------------------------------------- Sinkhorn
def _sinkhorn_vjp(logits: torch.Tensor, grad: torch.Tensor, iters: int, eps: float):
    """Gradient of :func:`reference.sinkhorn` at ``logits``: replay the iterations, keeping each
    normalised matrix and its divisor, then walk back. For ``M' = M / (sum_axis M + eps)``
    the vector-Jacobian product is ``(G - sum_axis(G * M')) / (sum_axis M + eps)``."""
    soft = torch.softmax(logits, dim=-1)
    m = soft + eps
    steps = []
    for axis in [-2] + [-1, -2] * (iters - 1):
        divisor = m.sum(axis, keepdim=True) + eps
        m = m / divisor
        steps.append((axis, m, divisor))
    g = grad
    for axis, out, divisor in reversed(steps):
        g = (g - (g * out).sum(axis, keepdim=True)) / divisor
    return soft * (g - (g * soft).sum(-1, keepdim=True))


_sinkhorn_forward = _body(reference.sinkhorn)
_sinkhorn_backward = _body(_sinkhorn_vjp)

# Where Triton runs (CUDA), the iterations run in two Triton kernels of ours, forward and
# backward, one launch each for all 2 iters - 1 normalisations of a block of tokens
# (triton_sinkhorn.py); elsewhere (the CPU, no Triton, n outside 2..8, a failed first-use
# check) in the PyTorch bodies above. Compiled, those bodies cost one kernel per normalisation,
# ~40 forward at 20 iterations.
#
# The kernels are launched between compiled bodies, never inside one. In mhc_pre the Sinkhorn
# is the forward's last step and the backward's first, so the forward body (or kernel) returns
# the logits of H_res and the backward recomputes them from the kept mixes (one addcmul) before
# its body (or kernel): one extra eager launch per backward, and no compiled graph ever holds a
# user-defined Triton kernel. We chose this over registering the kernels for Dynamo
# (torch.library.triton_op with wrap_triton, which Inductor would launch from its graph)
# because it is the robust option: it depends on nothing in Dynamo's and Inductor's handling of
# user kernels, which could be checked on a GPU only (wrap_triton refuses the kernels of
# Triton's CPU interpreter, on which our tests run everything else), and where a compiler
# failure would send the bodies holding the kernels to eager mode (_body's fallback). It also
# keeps one code path on every device: only the steps that run in kernels differ.
def _triton_sinkhorn_for(backend: Backend, logits: torch.Tensor):
    """The Triton kernels' module if they run ``logits [..., n, n]`` with ``backend`` (the
    registry's choice for ``sinkhorn``), else None."""
    return _triton_kernels() if _runs_triton("sinkhorn", backend.triton, logits) else None


def _sinkhorn_refusal(facts: registry.Facts) -> str | None:
    """Why the Triton Sinkhorn kernels cannot take logits ``[..., n, n]``, or None."""
    kernels = _triton_kernels()
    if kernels is None:
        return "the Triton Sinkhorn kernels do not import here (the log says why)"
    n = facts.extra.get("n")
    if n is not None and not kernels.MIN_N <= n <= kernels.MAX_N:
        return f"n = {n} streams (the Sinkhorn kernels take {kernels.MIN_N} to {kernels.MAX_N})"
    return None


def _sinkhorn_verified(facts: registry.Facts) -> str | None:
    passed = _triton_sinkhorn_checked(facts.device, facts.extra["n"])
    return None if passed else "failed its first-use check"


def _check_triton_sinkhorn(device: torch.device, n: int) -> None:
    """The Sinkhorn kernels' first-use check: forward and backward, fp32, 20 iterations, 45
    tokens of random logits, against the PyTorch bodies; raises on a mismatch."""
    generator = torch.Generator(device=device).manual_seed(0)
    logits = 3 * torch.randn(45, n, n, device=device, generator=generator)
    grad = torch.randn(45, n, n, device=device, generator=generator)
    kernels = _triton_kernels()
    got = (kernels.sinkhorn_forward(logits, 20, EPS),
           kernels.sinkhorn_backward(logits, grad, 20, EPS))
    expected = reference.sinkhorn(logits, 20, EPS), _sinkhorn_vjp(logits, grad, 20, EPS)
    for value, want in zip(got, expected):
        torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5)


def _triton_sinkhorn_checked(device: torch.device, n: int) -> bool:
    """Whether the Sinkhorn kernels passed their first-use check on ``device`` at this n."""
    return _triton_checked("Sinkhorn", _check_triton_sinkhorn, device, n)


def _sinkhorn_values(logits, iters, eps, backend: Backend):
    """:func:`reference.sinkhorn` (fp32) on ``backend``'s path on this device."""
    kernels = _triton_sinkhorn_for(backend, logits)
    if kernels is not None:
        return kernels.sinkhorn_forward(logits, iters, eps)
    return _sinkhorn_forward(logits, iters, eps, compiled=backend.compiled)


def _sinkhorn_gradient(logits, grad, iters, eps, backend: Backend):
    """:func:`_sinkhorn_vjp` (fp32) on ``backend``'s path on this device."""
    kernels = _triton_sinkhorn_for(backend, logits)
    if kernels is not None:
        return kernels.sinkhorn_backward(logits, grad, iters, eps)
    return _sinkhorn_backward(logits.float(), grad.float(), iters, eps,
                              compiled=backend.compiled)


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, eps, backend):
        ctx.iters, ctx.eps, ctx.backend = iters, eps, backend
        ctx.save_for_backward(logits)
        return _sinkhorn_values(logits, iters, eps, backend)

    @staticmethod
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        dlogits = _sinkhorn_gradient(logits, grad, ctx.iters, ctx.eps, ctx.backend)
        return dlogits.to(logits.dtype), None, None, None


def sinkhorn(logits: torch.Tensor, iters: int = 20, eps: float = EPS, *,
             backend: Backend = Backend()) -> torch.Tensor:
    """:func:`reference.sinkhorn`, recomputing its iterations in backward."""
    return _Sinkhorn.apply(logits, iters, eps, backend)


# ------------------------------------------------------------------------------------ mHC
# The bodies are broadcasts and reductions rather than einsums over fp32 copies: compiled, each
# becomes one pass over the n-stream tensor in its own dtype (an einsum would be a batched GEMM
# over an fp32 copy). The projection onto the (2 + n) n mixes is a real GEMM: it reads x and
# the weight in x's dtype and accumulates in fp32, as DeepSeek's kernels read x in bf16; the
# RMS factor and everything after the GEMM is fp32. In fp32 this is exactly the reference.
def _rms_project_forward_body(x, weight, eps):
    r = torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)
    return (x @ weight.to(x.dtype).t()).float() * r


def _rms_project_vjp(x, weight, grad, eps):
    # mixes = r * (x @ W^T) with r = rsqrt(mean(x^2) + eps), dr/dx = -r^3 x / D:
    # dx = r (g @ W) - (r^2 / D) (g . mixes) x ;  dW = (r g)^T x
    w, xf, g = weight.to(x.dtype), x.float(), grad.float()
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    gr = g * r
    mixes = (x @ w.t()).float() * r
    dx = (gr.to(x.dtype) @ w).float() - (r * r / x.shape[-1]) * (g * mixes).sum(-1, True) * xf
    dw = gr.flatten(0, -2).t().to(x.dtype) @ x.flatten(0, -2)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _stream_mix_forward_body(streams, weights):
    return (weights.float()[..., :, None] * streams.float()).sum(-2).to(streams.dtype)


def _stream_mix_vjp(streams, weights, grad):
    g = grad.float()[..., None, :]
    dstreams = (weights.float()[..., :, None] * g).to(streams.dtype)
    return dstreams, (streams.float() * g).sum(-1).to(weights.dtype)


def _coefficients_vjp(mixes, bias, gate, grad_pre, grad_post, dres, n, eps):
    """Gradients of :func:`reference.mhc_coefficient_logits` for (mixes, bias, gate), given
    those of H_pre, H_post and of the logits of H_res (``dres``, from the Sinkhorn's
    backward), plus H_pre."""
    mixes, bias, gate = mixes.float(), bias.float(), gate.float()
    scale = torch.cat([gate[0].expand(n), gate[1].expand(n), gate[2].expand(n * n)])
    z = mixes[..., :2 * n] * scale[:2 * n] + bias[:2 * n]
    pre = torch.sigmoid(z[..., :n])
    post = torch.sigmoid(z[..., n:2 * n])
    dz = torch.cat([grad_pre.float() * pre * (1 - pre), 2 * grad_post.float() * post * (1 - post),
                    dres.float().flatten(-2)], dim=-1)
    per_column = (dz * mixes).flatten(0, -2).sum(0)
    dgate = torch.stack([per_column[:n].sum(), per_column[n:2 * n].sum(), per_column[2 * n:].sum()])
    return dz * scale, dz.flatten(0, -2).sum(0), dgate, pre + eps


# The mHC pre op around its Sinkhorn (which runs between the two compiled bodies, see above):
# the forward body ends with the logits of H_res, the backward body starts from their gradient.
def _mhc_pre_forward_body(streams, weight, bias, gate, eps):
    n = streams.shape[-2]
    mixes = _rms_project_forward_body(streams.flatten(-2), weight, eps)
    pre, post, res_logits = reference.mhc_coefficient_logits(mixes, bias, gate, n, eps)
    return _stream_mix_forward_body(streams, pre), post, res_logits, mixes


def _res_logits(mixes, bias, gate, n):
    """The logits of H_res again from the kept mixes, as :func:`reference.mhc_coefficient_logits`
    (in one launch: an addcmul, which may fuse the multiply-add the forward body rounds twice)."""
    return torch.addcmul(bias[2 * n:], mixes[..., 2 * n:], gate[2]).unflatten(-1, (n, n))


def _mhc_pre_vjp(streams, weight, bias, gate, mixes, grad_u, grad_post, dres, eps, plus=None):
    """The pre op's gradients; ``plus`` (or None), a gradient the streams have from elsewhere,
    is added to theirs in fp32 before the rounding to their dtype."""
    n = streams.shape[-2]
    dpre = (streams.float() * grad_u.float()[..., None, :]).sum(-1)
    dmixes, dbias, dgate, pre = _coefficients_vjp(mixes, bias, gate, dpre, grad_post, dres, n,
                                                  eps)
    dflat, dweight = _rms_project_vjp(streams.flatten(-2), weight, dmixes, eps)
    dstreams = pre[..., :, None] * grad_u.float()[..., None, :] + dflat.float().unflatten(-1, (
        n, streams.shape[-1]))
    if plus is not None:
        dstreams = dstreams + plus.float()
    return dstreams.to(streams.dtype), dweight, dbias.to(bias.dtype), dgate.to(gate.dtype)


def _stream_update_forward_body(streams, y, post, res):
    # out[j] = post[j] y + sum_m res[m, j] X[m]
    mixed = (res.float()[..., :, :, None] * streams.float()[..., :, None, :]).sum(-3)
    return (post.float()[..., :, None] * y.float()[..., None, :] + mixed).to(streams.dtype)


def _stream_update_vjp(streams, y, post, res, grad):
    g, x = grad.float(), streams.float()
    dstreams = (res.float()[..., :, :, None] * g[..., None, :, :]).sum(-2)
    dy = (post.float()[..., :, None] * g).sum(-2)
    dpost = (g * y.float()[..., None, :]).sum(-1)
    dres = (x[..., :, None, :] * g[..., None, :, :]).sum(-1)
    return (dstreams.to(streams.dtype), dy.to(y.dtype), dpost.to(post.dtype),
            dres.to(res.dtype))


_mhc_pre_forward = _body(_mhc_pre_forward_body)
_mhc_pre_backward = _body(_mhc_pre_vjp)
_rms_project_forward = _body(_rms_project_forward_body)
_rms_project_backward = _body(_rms_project_vjp)
_stream_mix_forward = _body(_stream_mix_forward_body)
_stream_mix_backward = _body(_stream_mix_vjp)
_stream_update_forward = _body(_stream_update_forward_body)
_stream_update_backward = _body(_stream_update_vjp)


# Where Triton runs and the backend has them on (Backend.triton and triton_mhc), mhc_pre and
# stream_update run in fused Triton kernels instead of the bodies above, forward and backward
# (triton_mhc.py: each reads the stream tensor once or twice in its own dtype, where the bodies
# make several passes, some over fp32 copies); the Sinkhorn between mhc_pre's forward and
# backward stays in its own kernels.
# Not where the kernels do not take the sizes (n outside 2..8, h not a multiple of 16, streams
# not fp32/bf16/fp16, coefficients broadcast over tokens) or failed their first-use check at
# (device, n, streams' dtype).
def _triton_mhc_for(backend: Backend, streams: torch.Tensor, *update):
    """The Triton mHC kernels' module if they run ``streams [..., n, h]`` (and stream_update's
    ``y, post, res``) with ``backend`` (the registry's choice for ``mhc``), else None."""
    enabled = backend.triton and backend.triton_mhc
    return _triton_mhc_kernels() if _runs_triton("mhc", enabled, streams, *update) else None


def _triton_update_for(backend: Backend, streams, y, post, res):
    """:func:`_triton_mhc_for` for stream_update, whose kernels do not broadcast."""
    return _triton_mhc_for(backend, streams, y, post, res)


def _mhc_facts(streams, y=None, post=None, res=None, *_args, **_options) -> registry.Facts:
    extra = {"shape": tuple(streams.shape)}
    if y is not None:
        lead, (n, h) = streams.shape[:-2], streams.shape[-2:]
        extra["broadcast"] = (y.shape, post.shape, res.shape) != (lead + (h,), lead + (n,), lead + (n, n))
    return registry.Facts(device=streams.device, dtype=streams.dtype, extra=extra)


def _mhc_refusal(facts: registry.Facts) -> str | None:
    """Why the Triton mHC kernels cannot run streams ``[..., n, h]`` (and stream_update's
    operands), or None: n in MIN_N..MAX_N, h a multiple of H_MULTIPLE, fp32/bf16/fp16 streams,
    no broadcasting of stream_update's operands."""
    kernels = _kernel_constants("triton_mhc")
    if kernels is None or _triton_mhc_kernels() is None:
        return "the Triton mHC kernels do not import here (the log says why)"
    shape = facts.extra.get("shape")
    if shape is not None:
        if len(shape) < 2:
            return f"triton mhc: needs streams [..., n, h], got shape {shape}"
        n, h = shape[-2:]
        if not kernels.MIN_N <= n <= kernels.MAX_N:
            return f"triton mhc: needs {kernels.MIN_N} <= n <= {kernels.MAX_N} streams, got n = {n}"
        if h == 0 or h % kernels.H_MULTIPLE:
            return (f"triton mhc: needs a hidden size h that is a multiple of {kernels.H_MULTIPLE}, "
                    f"got h = {h}")
    if facts.dtype is not None and facts.dtype not in kernels._DOT_DTYPES:
        return f"triton mhc: needs fp32, bf16 or fp16 streams, got {facts.dtype}"
    if facts.extra.get("broadcast"):
        return "triton mhc: stream_update's kernels take y, post and res of the streams' tokens (no broadcasting)"
    return None


def _mhc_verified(facts: registry.Facts) -> str | None:
    passed = _triton_mhc_checked(facts.device, facts.extra["shape"][-2], facts.dtype)
    return None if passed else "failed its first-use check"


# Tolerances of the first-use checks of the mHC and depth-attention kernels, as rtol and as
# atol relative to each output's largest value: fp32 rounding (with room for a GPU's
# approximate exp and rsqrt) in fp32. In bf16 and fp16 the results, and the GEMMs' results
# inside, are rounded to the streams' dtype after sums
# in another order than PyTorch's, so a kernel and a body may differ by a unit in the last
# place of an intermediate: 2^-5. A miscompile or a slip is off by the values themselves.
_CHECK_TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2 ** -5, torch.float16: 2 ** -5}


def _check_triton_mhc(device: torch.device, n: int, dtype: torch.dtype) -> None:
    """The mHC kernels' first-use check: the four launchers of triton_mhc against the PyTorch
    bodies (eager) on 37 tokens, h = 144 (several chunks of columns, a partial one at n <= 4),
    random streams and gradients in ``dtype`` and fp32 parameters and coefficients; raises on
    a mismatch (rtol and atol relative to each output's largest value,
    ``_CHECK_TOLERANCES``)."""
    kernels = _triton_mhc_kernels()
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, device=device, generator=generator)).to(dtype)

    tokens, h, width = 37, 144, (2 + n) * n
    streams, y = randn(tokens, n, h, dtype=dtype), randn(tokens, h, dtype=dtype)
    grad_u, grad = randn(tokens, h, dtype=dtype), randn(tokens, n, h, dtype=dtype)
    weight, bias, gate = randn(width, n * h, scale=0.1), randn(width), randn(3, scale=0.5)
    grad_post, dres = randn(tokens, n), randn(tokens, n, n)
    post, res = randn(tokens, n), randn(tokens, n, n)
    forward = _mhc_pre_forward_body(streams, weight, bias, gate, EPS)
    mixes = forward[3]
    # With the gradient from the stream update added (mhc_pre's pass_through, as mHC runs).
    pre_grads = (streams, weight, bias, gate, mixes, grad_u, grad_post, dres, EPS, grad)
    pairs = [(kernels.pre_forward(streams, weight, bias, gate, EPS), forward),
             (kernels.pre_backward(*pre_grads), _mhc_pre_vjp(*pre_grads)),
             ((kernels.update_forward(streams, y, post, res),),
              (_stream_update_forward_body(streams, y, post, res),)),
             (kernels.update_backward(streams, y, post, res, grad),
              _stream_update_vjp(streams, y, post, res, grad))]
    tolerance = _CHECK_TOLERANCES[dtype]
    for got, expected in pairs:
        for value, want in zip(got, expected, strict=True):
            torch.testing.assert_close(value, want, rtol=tolerance,
                                       atol=tolerance * max(1.0, want.abs().max().item()))


def _triton_mhc_checked(device: torch.device, n: int, dtype: torch.dtype) -> bool:
    """Whether the mHC kernels passed their first-use check on ``device`` at this n and dtype."""
    return _triton_checked("mHC", _check_triton_mhc, device, n, dtype)


def _keep(ctx, x, recompute_input, *others):
    """Save ``others`` and ``x``, or only ``others`` when ``x`` can be recomputed in backward."""
    ctx.recompute_input = recompute_input
    ctx.save_for_backward(*others, *(() if recompute_input is not None else (x,)))


def _kept(ctx):
    """``(x, *others)`` as :func:`_keep` stored them."""
    saved = ctx.saved_tensors
    if ctx.recompute_input is not None:
        return (ctx.recompute_input(), *saved)
    return (saved[-1], *saved[:-1])


class _MHCPre(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, weight, bias, gate, iters, eps, recompute_input, pass_through,
                backend):
        kernels = _triton_mhc_for(backend, streams)
        if kernels is not None:
            u, post, res_logits, mixes = kernels.pre_forward(streams, weight, bias, gate, eps)
        else:
            u, post, res_logits, mixes = _mhc_pre_forward(streams, weight, bias, gate, eps,
                                                          compiled=backend.compiled)
        ctx.config, ctx.backend = (iters, eps), backend
        _keep(ctx, streams, recompute_input, weight, bias, gate, mixes)
        res = _sinkhorn_values(res_logits, iters, eps, backend)
        return (u, post, res, streams) if pass_through else (u, post, res)

    @staticmethod
    def backward(ctx, grad_u, grad_post, grad_res, grad_passed=None):
        streams, weight, bias, gate, mixes = _kept(ctx)
        (iters, eps), backend = ctx.config, ctx.backend
        logits = _res_logits(mixes, bias, gate, streams.shape[-2])
        dres = _sinkhorn_gradient(logits, grad_res, iters, eps, backend)
        args = (streams, weight, bias, gate, mixes, grad_u, grad_post, dres, eps, grad_passed)
        kernels = _triton_mhc_for(backend, streams)
        if kernels is not None:
            grads = kernels.pre_backward(*args)
        else:
            grads = _mhc_pre_backward(*args, compiled=backend.compiled)
        return (*grads, None, None, None, None, None)


class _RMSProject(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, recompute_input, backend):
        ctx.eps, ctx.backend = eps, backend
        _keep(ctx, x, recompute_input, weight)
        return _rms_project_forward(x, weight, eps, compiled=backend.compiled)

    @staticmethod
    def backward(ctx, grad):
        x, weight = _kept(ctx)
        return (*_rms_project_backward(x, weight, grad, ctx.eps, compiled=ctx.backend.compiled),
                None, None, None)


class _StreamMix(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, weights, recompute_input, backend):
        ctx.backend = backend
        _keep(ctx, streams, recompute_input, weights)
        return _stream_mix_forward(streams, weights, compiled=backend.compiled)

    @staticmethod
    def backward(ctx, grad):
        streams, weights = _kept(ctx)
        return (*_stream_mix_backward(streams, weights, grad, compiled=ctx.backend.compiled),
                None, None)


class _StreamUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, streams, y, post, res, recompute_input, backend):
        ctx.backend = backend
        _keep(ctx, streams, recompute_input, y, post, res)
        kernels = _triton_update_for(backend, streams, y, post, res)
        if kernels is not None:
            return kernels.update_forward(streams, y, post, res)
        return _stream_update_forward(streams, y, post, res, compiled=backend.compiled)

    @staticmethod
    def backward(ctx, grad):
        streams, y, post, res = _kept(ctx)
        backend = ctx.backend
        kernels = _triton_update_for(backend, streams, y, post, res)
        if kernels is not None:
            grads = kernels.update_backward(streams, y, post, res, grad)
        else:
            grads = _stream_update_backward(streams, y, post, res, grad,
                                            compiled=backend.compiled)
        return (*grads, None, None)


def mhc_pre(streams: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, gate: torch.Tensor,
            iters: int = 20, eps: float = EPS,
            recompute_input: Callable[[], torch.Tensor] | None = None, *,
            pass_through: bool = False, backend: Backend = Backend()):
    """Everything of an mHC sublayer before the sublayer itself, in one op: ``(u, H_post,
    H_res)`` with ``u = stream_mix(X, H_pre)`` and ``(H_pre, H_post, H_res) =
    mhc_coefficients(rms_project(vec X, weight), bias, gate)`` (:mod:`.reference`) for streams
    ``X [..., n, h]``. Keeps the streams (or recomputes them), the parameters and the mixes
    ``[..., (2 + n) n]``; the Sinkhorn iterations are recomputed in backward.

    ``pass_through``: return ``(u, H_post, H_res, X)``; the gradient reaching that X (from the
    stream update that reads it) is added to the streams' own inside the backward, which on
    the Triton path saves autograd's separate sum of the two ``[..., n, h]`` gradients."""
    return _MHCPre.apply(streams, weight, bias, gate, iters, eps, recompute_input, pass_through,
                         backend)


def rms_project(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS,
                recompute_input: Callable[[], torch.Tensor] | None = None, *,
                backend: Backend = Backend()) -> torch.Tensor:
    """:func:`reference.rms_project` with the GEMM in ``x``'s dtype (fp32 accumulation and
    output); keeps ``x`` (or calls ``recompute_input()`` in backward)."""
    return _RMSProject.apply(x, weight, eps, recompute_input, backend)


def stream_mix(streams: torch.Tensor, weights: torch.Tensor,
               recompute_input: Callable[[], torch.Tensor] | None = None, *,
               backend: Backend = Backend()) -> torch.Tensor:
    """:func:`reference.stream_mix`; keeps ``streams`` (or recomputes them in backward)."""
    return _StreamMix.apply(streams, weights, recompute_input, backend)


def stream_update(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor, res: torch.Tensor,
                  recompute_input: Callable[[], torch.Tensor] | None = None, *,
                  backend: Backend = Backend()) -> torch.Tensor:
    """:func:`reference.stream_update`; keeps ``streams`` (or recomputes them in backward)."""
    return _StreamUpdate.apply(streams, y, post, res, recompute_input, backend)


# -------------------------------------------------------------------------- depth attention
# The sources come in groups (a view into the packed state, the layer's own outputs), and their
# number and the group sizes change from layer to layer; the compiled bodies (the PyTorch path,
# where the Triton kernels below do not run) therefore work on one group at a time with dynamic
# shapes, and the few glue ops between them run eagerly.
#
# z_k = r_k (v_k . q), r_k = rsqrt(mean(v_k^2) + eps), out = sum_k alpha_k v_k, alpha = softmax(z):
# dz = alpha (dalpha - sum_k alpha_k dalpha_k) with dalpha_k = g . v_k;
# dv_k = alpha_k g + dz_k r_k q - dz_k z_k r_k^2 v_k / h ;  dq = sum dz_k r_k v_k.
def _group_logits(v, q, eps):
    vf = v.float()
    r = torch.rsqrt(vf.square().mean(-1) + eps)
    return (vf * q).sum(-1) * r, r


def _group_sum(alpha, v):
    return (alpha[..., None] * v.float()).sum(-2)


def _group_dalpha(v, g):
    return (v.float() * g[..., None, :]).sum(-1)


def _group_vjp(v, g, q, alpha, dz, z, r):
    vf = v.float()
    along_q = dz * r
    dv = (alpha[..., None] * g[..., None, :] + along_q[..., None] * q
          - (along_q * z * r / q.numel())[..., None] * vf)
    return dv.to(v.dtype), (along_q[..., None] * vf).flatten(0, -2).sum(0)


_group_logits_body = _body(_group_logits, dynamic=True)
_group_sum_body = _body(_group_sum, dynamic=True)
_group_dalpha_body = _body(_group_dalpha, dynamic=True)
_group_vjp_body = _body(_group_vjp, dynamic=True)


def _split(x, groups):
    """``x [..., K]`` per group, contiguous (one stride pattern for the compiled bodies)."""
    return [part.contiguous() for part in x.split([v.shape[-2] for v in groups], dim=-1)]


def _depth_forward(query, groups, eps, *, compiled: bool = False):
    """The PyTorch path of the forward over ``groups`` (tensors ``[..., k_i, h]``):
    ``(out in the groups' dtype, z, r, alpha [..., K] fp32)``; the bodies compiled with
    ``compiled``."""
    q = query.float()
    logits = [_group_logits_body(v, q, eps, compiled=compiled) for v in groups]
    z, r = (torch.cat(parts, -1) for parts in zip(*logits))
    alpha = torch.softmax(z, dim=-1)
    out = sum(_group_sum_body(a, v, compiled=compiled)
              for a, v in zip(_split(alpha, groups), groups))
    return out.to(groups[0].dtype), z, r, alpha


def _depth_backward(query, groups, grad, z, r, alpha, *, compiled: bool = False):
    """The PyTorch path of the backward: ``(dquery, [dv of each group])``; the bodies compiled
    with ``compiled``."""
    q, g = query.float(), grad.float()
    dalpha = torch.cat([_group_dalpha_body(v, g, compiled=compiled) for v in groups], -1)
    dz = alpha * (dalpha - (alpha * dalpha).sum(-1, keepdim=True))
    dgroups, dquery = [], 0
    for v, *parts in zip(groups, *(_split(x, groups) for x in (alpha, dz, z, r))):
        dv, dq = _group_vjp_body(v, g, q, *parts, compiled=compiled)
        dgroups.append(dv)
        dquery = dquery + dq
    return dquery.to(query.dtype), dgroups


# Where Triton runs, the forward and backward each run in one Triton kernel for all groups of a
# call (triton_depth.py: the sources read in place through up to four group pointers, twice per
# pass, no glue ops, no fp32 copies), instead of a compiled body per group plus cat, split,
# softmax and contiguous copies. Not where the kernels do not take the call (more than four
# groups or 64 sources, h not a multiple of 16, groups of different dtypes or leading shapes,
# sources not fp32/bf16/fp16) or failed their first-use check at (device, dtype, number of
# groups, K rounded up to a power of two: what makes a different compiled kernel).
#
# Two options serve a packed residual state (block AttnRes) without the copies and additions
# autograd would otherwise make of it (each the size of the whole state):
# - ``last_plus``: the first group's last source is that slot plus ``last_plus`` (block AttnRes's
#   FFN reads the partial sum as the packed input's last slot plus the mixer's output), without
#   materialising the sum for the attention; its gradient goes to both;
# - ``pass_through``: the op also returns its first group, so that the next use of the state
#   takes it from here; the gradient reaching that output is added to the first group's dv by
#   the backward kernel, instead of by autograd after the backward (one more pass over it).
#   With ``last_plus`` the passed group is a new tensor, the first group with ``last_plus``
#   added to its last source (the kernel writes it in the pass that reads the group): block
#   AttnRes's exit then only adds the FFN's output into it (add_into_last_slot), and the
#   passed gradient's last slot is part of ``last_plus``'s, written by the same kernel (a
#   separate exit op would make a new state from the input and both outputs, and autograd would
#   add the mixer output's two gradients).
@functools.cache
def _triton_depth_kernels():
    """The module of the Triton depth-attention kernels, or None (logged once)."""
    return _import_kernels("triton_depth", "depth-attention")


def _triton_depth_for(backend: Backend, query, groups, last_plus):
    """The Triton depth-attention kernels' module if they run this call with ``backend`` (the
    registry's choice for ``depth_attention``), else None."""
    if not _runs_triton("depth_attention", backend.triton, query, groups, last_plus=last_plus):
        return None
    return _triton_depth_kernels()


def _depth_facts(query, groups, *_args, last_plus=None, **_options) -> registry.Facts:
    first = groups[0]
    return registry.Facts(device=first.device, dtype=first.dtype, extra={
        "query_shape": tuple(query.shape), "group_shapes": tuple(tuple(g.shape) for g in groups),
        "group_dtypes": tuple(g.dtype for g in groups),
        "last_plus": None if last_plus is None else (last_plus.dtype, tuple(last_plus.shape))})


def _depth_refusal(facts: registry.Facts) -> str | None:
    """Why the Triton depth-attention kernels cannot run the groups ``[..., k_i, h]`` with the
    query ``[h]`` (and ``last_plus [..., h]`` added to the first group's last source), or None."""
    kernels = _kernel_constants("triton_depth")
    if kernels is None or _triton_depth_kernels() is None:
        return "the Triton depth-attention kernels do not import here (the log says why)"
    if "group_shapes" not in facts.extra:
        return None
    shapes, dtypes = facts.extra["group_shapes"], facts.extra["group_dtypes"]
    if not 1 <= len(shapes) <= kernels.MAX_GROUPS:
        return f"triton depth: needs 1 to {kernels.MAX_GROUPS} source groups, got {len(shapes)}"
    first = shapes[0]
    if len(first) < 2:
        return f"triton depth: needs source groups [..., k, h], got shape {first}"
    lead, h = first[:-2], first[-1]
    if h == 0 or h % kernels.H_MULTIPLE:
        return f"triton depth: needs a hidden size h that is a multiple of {kernels.H_MULTIPLE}, got h = {h}"
    if facts.extra["query_shape"] != (h,):
        return f"triton depth: needs a query [h] = [{h}], got shape {facts.extra['query_shape']}"
    for shape, dtype in zip(shapes, dtypes):
        if len(shape) < 2 or shape[:-2] != lead or shape[-1] != h:
            return (f"triton depth: needs source groups of one shape [..., k, h] = "
                    f"{(*lead, 'k', h)} (no broadcasting), got {shape}")
        if dtype != dtypes[0]:
            return f"triton depth: needs the groups in one dtype, got {dtypes[0]} and {dtype}"
    if dtypes[0] not in kernels._DTYPES:
        return f"triton depth: needs fp32, bf16 or fp16 sources, got {dtypes[0]}"
    plus = facts.extra["last_plus"]
    if plus is not None and (plus[1] != (*lead, h) or plus[0] != dtypes[0] or first[-2] == 0):
        return (f"triton depth: last_plus must be {dtypes[0]} {(*lead, h)} with a first group "
                f"of at least one source, got {plus[0]} {plus[1]}")
    total = sum(shape[-2] for shape in shapes)
    if not 1 <= total <= kernels.MAX_SOURCES:
        return f"triton depth: needs 1 to {kernels.MAX_SOURCES} sources in all, got {total}"
    return None


def _depth_verified(facts: registry.Facts) -> str | None:
    shapes = facts.extra["group_shapes"]
    padded = _triton_depth_kernels().padded_sources(sum(shape[-2] for shape in shapes))
    passed = _triton_depth_checked(facts.device, facts.dtype, len(shapes), padded)
    return None if passed else "failed its first-use check"


def _with_last_plus(groups, last_plus) -> list:
    """The groups with ``last_plus`` added to the first group's last source (a new tensor)."""
    if last_plus is None:
        return list(groups)
    first = groups[0].clone()
    first[..., -1, :] += last_plus
    return [first, *groups[1:]]


def _depth_backward_pytorch(query, groups, grad, z, r, alpha, last_plus, first_grad, *,
                            compiled: bool = False):
    """The PyTorch path of triton_depth.backward (with its last_plus and first_grad); the
    bodies compiled with ``compiled``."""
    dquery, dgroups = _depth_backward(query, _with_last_plus(groups, last_plus), grad, z, r,
                                      alpha, compiled=compiled)
    if first_grad is not None:
        dgroups[0] = dgroups[0] + first_grad
    dplus = None if last_plus is None else dgroups[0][..., -1, :]
    return dquery, dgroups, dplus


def _check_triton_depth(device: torch.device, dtype: torch.dtype, groups: int,
                        padded: int) -> None:
    """The depth-attention kernels' first-use check: forward and backward on 37 tokens, h = 144
    (a partial chunk of columns), ``groups`` groups of ``padded`` sources in all (K = KP, the
    others strided views, the first with a ``last_plus``, passed on as ``first_out``, and an
    incoming gradient), random sources and gradient in ``dtype`` and an fp32 query, against the
    PyTorch path (eager); raises on a mismatch (``_CHECK_TOLERANCES``, relative to each output's
    largest value; the passed-on group bitwise)."""
    kernels = _triton_depth_kernels()
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=dtype):
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    tokens, h = 37, 144
    sizes = [padded // groups + (i < padded % groups) for i in range(groups)]
    sources = [randn(tokens, sizes[0], h)]
    sources += [randn(tokens, size + 1, h)[:, 1:] for size in sizes[1:]]
    plus, first_grad = randn(tokens, h), randn(tokens, sizes[0], h)
    query, grad = randn(h, dtype=torch.float32), randn(tokens, h)
    passed = torch.empty_like(sources[0], memory_format=torch.contiguous_format)
    forward = kernels.forward(query, sources, EPS, plus, passed)
    read = _with_last_plus(sources, plus)
    expected = _depth_forward(query, read, EPS)
    torch.testing.assert_close(passed, read[0], rtol=0, atol=0)
    dquery, dgroups, dplus = kernels.backward(query, sources, grad, *forward[1:], EPS, plus,
                                              first_grad)
    want_dquery, want_dgroups, want_dplus = _depth_backward_pytorch(
        query, sources, grad, *expected[1:], plus, first_grad)
    pairs_of = [(forward, expected), ((dquery, dplus, *dgroups),
                                      (want_dquery, want_dplus, *want_dgroups))]
    tolerance = _CHECK_TOLERANCES[dtype]
    for got, want_all in pairs_of:
        for value, want in zip(got, want_all, strict=True):
            torch.testing.assert_close(value, want, rtol=tolerance,
                                       atol=tolerance * max(1.0, want.abs().max().item()))


def _triton_depth_checked(device: torch.device, dtype: torch.dtype, groups: int,
                          padded: int) -> bool:
    """Whether the depth-attention kernels passed their first-use check on ``device`` at this
    dtype, number of groups and padded number of sources."""
    return _triton_checked("depth-attention", _check_triton_depth, device, dtype, groups, padded)


class _DepthAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, eps, pass_through, last_plus, backend, *groups):
        kernels = _triton_depth_for(backend, query, groups, last_plus)
        if kernels is not None:
            # what pass_through returns, the first group as read: with last_plus a new tensor
            copy = (torch.empty_like(groups[0], memory_format=torch.contiguous_format)
                    if pass_through and last_plus is not None else None)
            out, z, r, alpha = kernels.forward(query, groups, eps, last_plus, copy)
            passed = groups[0] if copy is None else copy
        else:
            read = _with_last_plus(groups, last_plus)
            out, z, r, alpha = _depth_forward(query, read, eps, compiled=backend.compiled)
            passed = read[0]
        ctx.eps, ctx.backend = eps, backend
        ctx.save_for_backward(query, z, r, alpha, last_plus, *groups)
        return (out, passed) if pass_through else out

    @staticmethod
    def backward(ctx, grad, first_grad=None):
        query, z, r, alpha, last_plus, *groups = ctx.saved_tensors
        backend = ctx.backend
        kernels = _triton_depth_for(backend, query, groups, last_plus)
        if kernels is not None:
            dquery, dgroups, dplus = kernels.backward(query, groups, grad, z, r, alpha, ctx.eps,
                                                      last_plus, first_grad)
        else:
            dquery, dgroups, dplus = _depth_backward_pytorch(query, groups, grad, z, r, alpha,
                                                             last_plus, first_grad,
                                                             compiled=backend.compiled)
        return (dquery, None, None, dplus, None, *dgroups)


def depth_attention(query: torch.Tensor, sources: Sequence[torch.Tensor], eps: float = EPS, *,
                    last_plus: torch.Tensor | None = None, pass_through: bool = False,
                    backend: Backend = Backend()):
    """:func:`reference.depth_attention` over ``sources``, a list of ``[..., k_i, h]`` groups
    (views into a packed state need no copy), keeping only references and per-token scalars.

    ``last_plus [..., h]``: the first group's last source is that slot plus ``last_plus``
    (computed where it is read). ``pass_through``: return ``(out, first)``, ``first`` the first
    group as read: ``sources[0]`` itself, or with ``last_plus`` a new contiguous tensor, the
    group with ``last_plus`` added to its last source; a gradient reaching the second output is
    added to the first group's (and, in its last slot, to ``last_plus``'s) inside the backward
    (see the comment above :func:`_triton_depth_kernels`)."""
    return _DepthAttention.apply(query, eps, pass_through, last_plus, backend, *sources)


# ------------------------------------------------------------- the packed state's last slot
# Block AttnRes's exit adds the FFN's output into the last slot (the partial sum of the block) of
# the state its depth attention passed on, a new tensor of its own (depth_attention's
# pass_through with last_plus), in place. In PyTorch that slot is a strided view, whose
# addition runs TensorIterator's strided (not vectorised) kernel; where Triton runs, one kernel
# (triton_depth.add_into_last_slot) adds it, bitwise the same.
def _add_into_last_slot_pytorch(slots, addend):
    slots[..., -1, :] += addend
    return slots


def _check_triton_add_into_last_slot(device: torch.device, dtype: torch.dtype) -> None:
    """The first-use check of triton_depth.add_into_last_slot: 37 tokens, 3 slots of h = 144,
    random values in ``dtype``, bitwise against the PyTorch path."""
    kernels = _triton_depth_kernels()
    generator = torch.Generator(device=device).manual_seed(0)
    slots = torch.randn(37, 3, 144, device=device, generator=generator).to(dtype)
    addend = torch.randn(37, 144, device=device, generator=generator).to(dtype)
    torch.testing.assert_close(kernels.add_into_last_slot(slots.clone(), addend),
                               _add_into_last_slot_pytorch(slots.clone(), addend), rtol=0, atol=0)


class _AddIntoLastSlot(torch.autograd.Function):
    """In place. Backward: the slots' gradient is the incoming one as it is; the addend's a
    contiguous copy of its last slot."""

    @staticmethod
    def forward(ctx, slots, addend, backend):
        if _runs_triton("add_into_last_slot", backend.triton, slots, addend):
            _triton_depth_kernels().add_into_last_slot(slots, addend)
        else:
            _add_into_last_slot_pytorch(slots, addend)
        ctx.mark_dirty(slots)
        return slots

    @staticmethod
    def backward(ctx, grad):
        return grad, grad[..., -1, :].contiguous(), None


def add_into_last_slot(slots: torch.Tensor, addend: torch.Tensor, *,
                       backend: Backend = Backend()) -> torch.Tensor:
    """``slots [..., S, h]`` with ``addend [..., h]`` added to its last slot, in place (the sum
    rounded to the dtype); returns ``slots`` (block AttnRes's exit). ``slots`` must be a tensor
    no other op saved for backward (depth_attention's passed-on state with ``last_plus`` is)."""
    return _AddIntoLastSlot.apply(slots, addend, backend)


def _add_facts(slots, addend, **_options) -> registry.Facts:
    return registry.Facts(device=slots.device, dtype=slots.dtype, extra={
        "shape": tuple(slots.shape), "contiguous": slots.is_contiguous(),
        "addend": (addend.dtype, tuple(addend.shape))})


def _add_refusal(facts: registry.Facts) -> str | None:
    """Why triton_depth.add_into_last_slot cannot run these slots ``[..., S, h]`` and addend
    ``[..., h]``, or None: contiguous slots, an addend of their dtype (fp32, bf16 or fp16), h a
    multiple of H_MULTIPLE."""
    kernels = _kernel_constants("triton_depth")
    if kernels is None or _triton_depth_kernels() is None:
        return "the Triton depth-attention kernels do not import here (the log says why)"
    if "shape" not in facts.extra:
        return None
    shape, contiguous, (dtype, addend) = (facts.extra[key] for key in ("shape", "contiguous", "addend"))
    if (len(shape) < 2 or facts.dtype not in kernels._DTYPES or dtype != facts.dtype
            or shape[-1] % kernels.H_MULTIPLE or not contiguous or addend != (*shape[:-2], shape[-1])):
        return (f"triton depth: add_into_last_slot needs contiguous slots [..., S, h] and an "
                f"addend [..., h] of its dtype (fp32, bf16 or fp16), h a multiple of "
                f"{kernels.H_MULTIPLE}; got {facts.dtype} {shape} "
                f"{'' if contiguous else '(strided) '}and {dtype} {addend}")
    return None


def _add_verified(facts: registry.Facts) -> str | None:
    passed = _triton_checked("packed-state", _check_triton_add_into_last_slot, facts.device, facts.dtype)
    return None if passed else "failed its first-use check"


def _declare(op: str, function, facts, unsupported, verify) -> None:
    """Declare a residual op with kernels: its PyTorch bodies ("pytorch": ``function`` with the
    kernels off) and our Triton kernels ("triton": with them on; "auto" on CUDA where
    ``unsupported`` allows, once ``verify``, its first-use check at the call's key, passed)."""
    registry.declare(registry.Op(
        op,
        backends={"pytorch": registry.Backend("pytorch", functools.partial(function, backend=_BODIES)),
                  "triton": registry.Backend("triton", function, unsupported=unsupported, verify=verify,
                                             auto_devices=("cuda",))},
        auto=("triton", "pytorch"),
        facts=facts,
    ))


_BODIES = Backend(triton=False, triton_mhc=False)
_declare("sinkhorn", sinkhorn, lambda logits, *args, **options: registry.Facts(
    device=logits.device, dtype=logits.dtype, extra={"n": logits.shape[-1]}), _sinkhorn_refusal,
    _sinkhorn_verified)
_declare("mhc", stream_update, _mhc_facts, _mhc_refusal, _mhc_verified)
_declare("depth_attention", depth_attention, _depth_facts, _depth_refusal, _depth_verified)
_declare("add_into_last_slot", add_into_last_slot, _add_facts, _add_refusal, _add_verified)
