"""The Sinkhorn projection of mHC in Triton: one kernel for the forward and one for the backward,
each running every iteration of a block of tokens' n x n matrices in one program.

mHC (Xie et al. 2025, "mHC: Manifold-Constrained Hyper-Connections", DeepSeek-AI, arXiv
2512.24880) projects the per-token residual mixing matrix H_res towards the doubly stochastic
matrices by Sinkhorn-Knopp. The definition is :func:`.reference.sinkhorn`: for logits
``[..., n, n]``

    M_0 = softmax(logits, -1) + eps
    M_k = M_{k-1} / (sum_axis(k) M_{k-1} + eps),   k = 1 .. 2 iters - 1,

with axis(k) = -2 (columns) for odd k and -1 (rows) for even k: a column normalisation, then
``iters - 1`` (row, column) pairs. In PyTorch each normalisation is a reduction and a division
over the whole tensor, so that 20 iterations cost ~40 kernel launches forward (torch.compile
unrolls the loop into about as many kernels) and more backward; at n = 4 a token's matrix is 16
floats, and one program can run all iterations of a block of tokens in registers instead.

Forward (``_forward_kernel``): the definition above, token block by token block, fp32.

Backward (``_backward_kernel``), the vector-Jacobian product of :func:`.efficient._sinkhorn_vjp`:
for a normalisation ``M' = M / d`` with ``d = sum_axis M + eps``, ``dM = (dM' - sum_axis(dM' *
M')) / d``; walking the steps in reverse from the output gradient, then through the softmax,
``dlogits = S * (dM_0 - sum_-1(dM_0 * S))`` with ``S = softmax(logits, -1)``. Step k needs its
input M_{k-1} and its output M_k. The kernel first runs the 2 iters - 1 steps forward, storing
each step's input M_0 .. M_{2 iters - 2} in a scratch buffer ``[2 iters - 1, T, n, n]`` fp32
(allocated per call by :func:`sinkhorn_backward`: 2 iters - 1 matrices per token, 20 MB at
T = 8192, n = 4, 20 iterations), then walks back reading each input again (one step ahead) and
carrying the output from the step before; ``d`` is recomputed from the input. Per token that
is 2 (2 iters - 1) = 78 passes over the matrix at 20 iterations (39 normalisations forward, 39
VJP steps, one division of the matrix each), and 2 iters - 1 matrices written and read back.
Each program reads back only the part of the buffer that it wrote (tokens are its second
dimension, so a program's block of one step is contiguous).

Numerics: fp32 throughout (the logits are read in their dtype and widened); the divisions are
IEEE round-to-nearest (``tl.math.div_rn``, as PyTorch divides; Triton's ``/`` would be the
approximate div.full.f32 on NVIDIA GPUs), the exponential is Triton's ``tl.exp``, as in
Inductor's compiled softmax. The sums over n <= 8 entries may be added in another order than
PyTorch's. So results equal the reference to fp32 rounding, not bitwise.

Layout: the logits ``[..., n, n]`` are read as ``[T, n, n]`` tokens with any token stride (each
matrix contiguous; so the H_res columns of mHC's mixes could be read in place) and written
contiguous. A program holds ``BLOCK`` tokens as a ``[BLOCK, NP, NP]`` tile, NP the power of two
>= n; entries outside n x n are masked to 0, where they change no sum. Supported: 2 <= n <= 8,
CUDA tensors (or CPU tensors under Triton's interpreter, TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import EPS
from .triton_common import divide, launch_device

__all__ = ["sinkhorn_forward", "sinkhorn_backward", "MIN_N", "MAX_N"]

MIN_N, MAX_N = 2, 8
# One warp a program, BLOCK * NP * NP = 128 entries, 4 fp32 per thread: 8 tokens at n = 4 (1024
# programs at 8192 tokens), 32 at n = 2, 2 at n = 5 .. 8. Each step is a serial chain of sums and
# divisions; how many chains run at once is set by the fp32 per thread, not the program size
# (8192 tokens at n = 4 are 1024 warps either way, and at n <= 4 each thread runs the same code
# as in 4-warp programs of 4x the tokens). Smaller programs spread more evenly over the SMs, and
# at n >= 5 (8 x 8 tiles) one warp keeps every sum inside the warp, where 4 warps of 8 tokens
# would split each matrix's rows between warps and each column sum would take shared memory and
# a barrier (10 barriers in the backward compiled for sm_90, 1 with one warp).
_ELEMENTS_PER_PROGRAM = 128
_NUM_WARPS = 1


# ---------------------------------------------------------------------------------------------
# Helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _tile(T, N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """This program's block of tokens as a [BLOCK, NP, NP] tile: the token indices [BLOCK, 1, 1],
    the offsets of the entries inside a contiguous N x N matrix [1, NP, NP], the mask of real
    (token, entry) pairs, that of entries inside N x N and that of columns inside N."""
    tok = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)[:, None, None]
    row = tl.arange(0, NP)[None, :, None]
    col = tl.arange(0, NP)[None, None, :]
    entry = (row < N) & (col < N)
    return tok, row * N + col, (tok < T) & entry, entry, col < N


@triton.jit
def _softmax_rows(x, entry, in_cols, N: tl.constexpr, NP: tl.constexpr):
    """softmax(x, -1) of each matrix of the tile, 0 outside N x N."""
    if NP != N:
        x = tl.where(in_cols, x, float("-inf"))  # padded rows keep their 0s: no -inf - -inf
    e = tl.exp(x - tl.max(x, 2, keep_dims=True))
    soft = divide(e, tl.sum(e, 2, keep_dims=True))
    if NP != N:
        soft = tl.where(entry, soft, 0.0)
    return soft


@triton.jit
def _normalise(m, AXIS: tl.constexpr, eps):
    """``m / (sum_AXIS m + eps)``: AXIS 1 normalises columns (PyTorch's -2), 2 rows (-1)."""
    return divide(m, tl.sum(m, AXIS, keep_dims=True) + eps)


@triton.jit
def _iterate(m, steps, eps):
    """``m`` after the first ``steps`` normalisations: columns, then rows and columns in turn."""
    for k in range(steps):
        if k % 2 == 0:
            m = _normalise(m, 1, eps)
        else:
            m = _normalise(m, 2, eps)
    return m


@triton.jit
def _normalise_vjp(m, out, g, AXIS: tl.constexpr, eps):
    """The gradient at ``m`` of ``out = m / d``, ``d = sum_AXIS m + eps``, given ``g`` at out:
    ``(g - sum_AXIS(g * out)) / d``."""
    d = tl.sum(m, AXIS, keep_dims=True) + eps
    return divide(g - tl.sum(g * out, AXIS, keep_dims=True), d)


# ---------------------------------------------------------------------------------------------
# Kernels, grid [cdiv(T, BLOCK)]
# ---------------------------------------------------------------------------------------------

@triton.jit
def _forward_kernel(logits, out, T, stride_t, steps, eps,
                    N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """out = sinkhorn(logits) for BLOCK tokens; ``steps = 2 iters - 1`` normalisations."""
    tok, within, inside, entry, in_cols = _tile(T, N, NP, BLOCK)
    x = tl.load(logits + tok * stride_t + within, mask=inside, other=0.0).to(tl.float32)
    m = tl.where(entry, _softmax_rows(x, entry, in_cols, N, NP) + eps, 0.0)
    m = _iterate(m, steps, eps)
    tl.store(out + tok * (N * N) + within, m, mask=inside)


@triton.jit
def _backward_kernel(logits, grad, dlogits, scratch, T, stride_t, stride_g, steps, eps,
                     N: tl.constexpr, NP: tl.constexpr, BLOCK: tl.constexpr):
    """dlogits = the gradient of sinkhorn at logits given ``grad`` at its output, for BLOCK
    tokens: the steps run forward once, the input M_{k-1} of step k (k = 1 .. steps) stored in
    ``scratch[k - 1]`` (``scratch [steps, T, N, N]`` fp32), then walked in reverse, reading the
    inputs back."""
    tok, within, inside, entry, in_cols = _tile(T, N, NP, BLOCK)
    x = tl.load(logits + tok * stride_t + within, mask=inside, other=0.0).to(tl.float32)
    soft = _softmax_rows(x, entry, in_cols, N, NP)
    m = tl.where(entry, soft + eps, 0.0)
    # scratch[k] is ``at``, a scalar pointer moved a step at a time (no int32 product k T N N);
    # this tile of it is ``at + here``.
    here = tok * (N * N) + within
    at = scratch
    for k in range(steps):  # M_k, the input of step k + 1, into scratch[k]
        tl.store(at + here, m, mask=inside)
        at += T * (N * N)
        if k % 2 == 0:
            m = _normalise(m, 1, eps)
        else:
            m = _normalise(m, 2, eps)
    # Each thread reads back only what it stored itself (the same tile, the same layout); the
    # barrier makes the whole program's stores visible in any case.
    tl.debug_barrier()
    g = tl.load(grad + tok * stride_g + within, mask=inside, other=0.0).to(tl.float32)
    out = m  # the output of the step walked back: M_steps first, then the input loaded before
    at -= T * (N * N)
    following = tl.load(at + here, mask=inside, other=0.0)  # M_{steps-1}
    for r in range(steps):
        k = steps - 1 - r  # step k + 1 walked back; its input M_k was loaded one step ahead
        m = following
        at -= T * (N * N)  # scratch[k - 1]: M_{k-1}, for the next step (none after k = 0)
        following = tl.load(at + here, mask=inside & (k > 0), other=0.0)
        if k % 2 == 0:
            g = _normalise_vjp(m, out, g, 1, eps)
        else:
            g = _normalise_vjp(m, out, g, 2, eps)
        if NP != N:  # padded entries: their divisors are eps alone, keep them at exactly 0
            g = tl.where(entry, g, 0.0)
        out = m
    dx = soft * (g - tl.sum(g * soft, 2, keep_dims=True))
    tl.store(dlogits + tok * (N * N) + within, dx, mask=inside)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _check(logits: torch.Tensor) -> int:
    """n, or a ValueError naming what the kernels cannot run."""
    n = logits.shape[-1] if logits.dim() >= 2 else 0
    if logits.dim() < 2 or logits.shape[-2] != n or not MIN_N <= n <= MAX_N:
        raise ValueError(f"triton sinkhorn: needs logits [..., n, n] with {MIN_N} <= n <= {MAX_N}, "
                         f"got shape {tuple(logits.shape)}")
    if not logits.is_floating_point() or logits.dtype == torch.float64:
        raise ValueError(f"triton sinkhorn: needs fp32, bf16 or fp16 logits, got {logits.dtype}")
    return n


def _tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x [..., n, n]`` as ``[T, n, n]`` with contiguous matrices (a view where it can be)."""
    x = x.reshape(-1, n, n)
    return x if x.stride(2) == 1 and x.stride(1) == n else x.contiguous()


def _launch(kernel, x: torch.Tensor, n: int, *args) -> None:
    """``kernel`` over the T tokens of ``x [T, n, n]``, BLOCK tokens a program."""
    padded = triton.next_power_of_2(n)
    block = max(1, _ELEMENTS_PER_PROGRAM // (padded * padded))
    tokens = x.shape[0]
    if tokens == 0:
        return
    with launch_device(x.device):
        kernel[(triton.cdiv(tokens, block),)](*args, N=n, NP=padded, BLOCK=block,
                                              num_warps=_NUM_WARPS)


def _steps(iters: int) -> int:
    """Normalisations after the softmax: 2 iters - 1 (iters < 1 runs as 1, as in the reference,
    whose loop then runs no pass)."""
    return 2 * max(int(iters), 1) - 1


def sinkhorn_forward(logits: torch.Tensor, iters: int = 20, eps: float = EPS) -> torch.Tensor:
    """:func:`.reference.sinkhorn` of ``logits [..., n, n]``, fp32, in one kernel."""
    n = _check(logits)
    x = _tokens(logits, n)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    _launch(_forward_kernel, x, n, x, out, x.shape[0], x.stride(0), _steps(iters), float(eps))
    return out.view(logits.shape)


def sinkhorn_backward(logits: torch.Tensor, grad: torch.Tensor, iters: int = 20,
                      eps: float = EPS) -> torch.Tensor:
    """The gradient of :func:`.reference.sinkhorn` at ``logits`` given ``grad`` at its output
    (both ``[..., n, n]``), fp32, in one kernel that reruns the iterations, keeping them in a
    temporary fp32 buffer of ``2 iters - 1`` matrices per token."""
    n = _check(logits)
    if grad.shape != logits.shape:
        raise ValueError(f"triton sinkhorn: grad {tuple(grad.shape)} and logits "
                         f"{tuple(logits.shape)} differ in shape")
    x, g = _tokens(logits, n), _tokens(grad, n)
    steps = _steps(iters)
    dx = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    scratch = torch.empty((steps, *x.shape), dtype=torch.float32, device=x.device)  # M_0 .. M_{steps-1}
    _launch(_backward_kernel, x, n, x, g, dx, scratch, x.shape[0], x.stride(0), g.stride(0), steps,
            float(eps))
    return dx.view(logits.shape)
