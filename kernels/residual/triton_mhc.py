"""The two stream ops of mHC in Triton, forward and backward: the pre op (RMS-normalised
projection onto the mixes, the coefficients, and the pre-mix of the streams into the sublayer's
input) and the stream update after the sublayer.

mHC (Xie et al. 2025, "mHC: Manifold-Constrained Hyper-Connections", DeepSeek-AI, arXiv
2512.24880) keeps n residual streams ``X [T, n, h]`` (definitions in :mod:`.reference`). The
kernels compute exactly the PyTorch bodies of :mod:`.efficient` (to fp32 rounding), each in one
or two kernels over blocks of ``BLOCK_T`` tokens and slabs of columns of h, which together read
the stream tensor ``[T, n h]`` in its own dtype once or twice and make no fp32 copy of it:

    pre_forward      = efficient._mhc_pre_forward_body -> (u, H_post, logits of H_res, mixes).
                       Kernel 1, pass 1 over x = vec X, per slab of columns: sum(x^2) and the
                       GEMM x @ W^T (tl.dot, fp32 accumulation), summed over the slabs by torch;
                       kernel 2: r = rsqrt(mean(x^2) + eps), mixes = r (x @ W^T) and the
                       coefficients as reference.mhc_coefficient_logits, then pass 2 over x per
                       slab: u = sum_m H_pre[m] X[m].        Reads X twice, writes u.
    pre_backward     = efficient._mhc_pre_vjp (given dres, the gradient of the H_res logits from
                       the Sinkhorn's backward). One kernel over whole rows of its tokens:
                       pass 1 over X and du: dH_pre[m] = <X[m], du> and sum(x^2); the
                       coefficient backward (as efficient._coefficients_vjp) giving dmixes;
                       pass 2 over X and du again: dX = r (dmixes @ W) - (r^2 / D)
                       (dmixes . mixes) x + H_pre[m] du, plus the gradient the streams have
                       from the stream update where given (efficient.mhc_pre's pass_through:
                       autograd's sum of the two, a read and a write of [T, n h], saved).
                       Reads X twice (and that gradient once), writes dX. Pass 1's loads
                       of X and du ask L2 to keep their lines (evict_last) and pass 2's, their
                       last use, to drop them first (evict_first), for pass 2 to find them
                       in L2 (the depth kernels go without these hints).
                       Outside the kernel: dW = (r dmixes)^T x in one torch matmul (cuBLAS; a
                       third read of X), and the bias and gate gradients as one sum over tokens
                       of a [T, (2 + n) n + 3] fp32 tensor the kernel writes.
    update_forward   = efficient._stream_update_forward_body: out[j] = H_post[j] y + sum_m
                       H_res[m, j] X[m].                     Reads X and y, writes out.
    update_backward  = efficient._stream_update_vjp: dX[m] = sum_j H_res[m, j] g[j], dy = sum_j
                       H_post[j] g[j], and per token dH_post[j] = <g[j], y>, dH_res[m, j] =
                       <X[m], g[j]>. Each program takes one chunk of 128 columns of h, so the last
                       two are written as per-chunk partial sums (fp32; a [BLOCK_T, n + n n] tile
                       a program, stored once) and summed over the chunks outside the kernel in
                       one torch sum.  Reads X, g and y, writes dX and dy.

(The Sinkhorn iterations between the pre op's forward logits and its backward run in the
kernels of :mod:`.triton_sinkhorn`.) Everything else, per token, is [BLOCK_T, (2 + n) n] or
[BLOCK_T, n, n] tiles in registers, and reads of W (a few hundred KB, from L2; in the streams'
dtype, cast once a call by the launcher where W is fp32, as with autocast or fp32 parameters,
which is faster than every program of the pre op reading fp32 W).

Numerics, as the bodies: every sum and product in fp32 after reading its operands in their
dtype; results written in the dtype of the tensor they are the value or gradient of (u, dX in
the streams' dtype; the coefficients, mixes and their gradients fp32). The GEMMs run in the
streams' dtype as in the bodies: with bf16 (fp16) streams, the operands of x @ W^T and of
(r dmixes) @ W are rounded to bf16 (W cast in the kernel), accumulated in fp32 and the GEMM
results rounded to bf16 once, as PyTorch's bf16 matmul returns them (x @ W^T after its sum over
the slabs, not per slab); so are the dX of the projection before H_pre du is added, as in
efficient._rms_project_vjp. (PyTorch's bf16 matmul does so with
``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` off; with it on, the
default, cuBLAS may reduce in lower precision, and 3.4% of the body's bf16 dX differed in their
last bit at n = 3, h = 272 on an H200.) With fp32 streams the dots run in full fp32
(``input_precision="ieee"``, not TF32), as kernels/delta_rule/triton.py does. The backward uses
the mixes kept from the forward where efficient._rms_project_vjp recomputes them (the same
GEMM). Sums run in another order than PyTorch's (per chunk of h, then over the chunks of a
program's slab of columns, then over the slabs; the bias and gate gradients per token, then over
tokens), and on a GPU multiply-adds may fuse, so results equal the bodies to fp32 rounding, not
bitwise.

Launch configuration (fixed, no autotuning; each choice comes from sweeps made with
``benchmarks/residual_ops.py --mhc-sweep``, which records their timings):

- Tiles (``LAUNCH``, per launcher): BLOCK_T = 16 tokens a program (the smallest tile tl.dot
  takes), 64 in the pre op's forward and 32 in its backward; columns of one stream in chunks of
  BLOCK_H = 128 (256 contiguous bytes of a bf16 row); 8 warps (4 in the pre op's forward) and 2
  pipeline stages. NP is n rounded up to a power of two and MP = (2 + n) n rounded up to one (at
  least 16, for tl.dot); the padding is masked (loads give 0, stores are skipped). From 5 streams
  on (NP = 8) the tiles would hold 2 to 4 times as much, and ``LAUNCH_WIDE`` takes 16 tokens and
  chunks of 16 columns.
- Grids: the pre op's forward kernels and the update kernels run on [cdiv(T, BLOCK_T), slabs of
  columns of h]; a slab is ``_PRE_COLS = 128`` columns (of every stream) in the pre op's forward
  and one chunk of BLOCK_H in the update kernels. The pre op's backward runs on
  [cdiv(T, BLOCK_T)]: each program loops over all of h, in chunks, twice: for the backward one
  kernel over whole rows beats a slab kernel and a second launch, for the forward the slabs win
  (``benchmarks/residual_ops.py``).
- Sums over h: the pre forward's first kernel and update_backward write per-slab sums to an fp32
  buffer that torch sums over its first axis (deterministic; no atomics): [cdiv(h, 128), T,
  (2 + n) n + 1] and [cdiv(h, 128), T, n + n n] (6.6 and 5 MB at T = 8192, h = 1024, n = 4). The
  pre forward's second kernel recomputes the coefficients from the summed tile in every slab's
  program (a few operations on a [BLOCK_T, MP] tile, for a third launch saved), and only slab 0's
  programs write them.
- 2-D tiles: every pass over the streams without a tl.dot works on [BLOCK_T, 128] tiles of one
  stream at a time, the sums over streams unrolled (n is a constexpr); only update_forward, which
  reduces nothing, keeps n-stream tiles [BLOCK_T, NP, 128] (reductions over one axis of such
  tiles are slow in update_backward). Per-token sums are set into one [BLOCK_T, SP] tile and
  stored as whole rows at the end, not one store per sum.
- Registers (ptxas for sm_90): update_backward up to 255 without spills at n = 4; the pre
  backward's single kernel at BLOCK_T = 32 uses 128 registers and a 1.6 KB stack at n = 4 in
  bf16.
- T is not specialised on: one compiled kernel serves every token count, which the first-use
  check in :mod:`.efficient` therefore covers.

Constraints: 2 <= n <= 8, h a multiple of 16, streams in fp32, bf16 or fp16, every tensor of
the op with the streams' leading (token) dimensions, no broadcasting; inputs ``[..., n, h]`` are
read as ``[T, n, h]`` (copied where not contiguous). Anything else raises a ValueError naming
the constraint (the rule of the ``mhc`` op's triton backend, declared in the backend registry
by efficient.py: ``registry.BackendUnavailable``); efficient.py then runs the PyTorch bodies. CUDA
tensors, or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import registry
from .triton_common import block_tokens, divide, launch_device

__all__ = ["pre_forward", "pre_backward", "update_forward", "update_backward",
           "MIN_N", "MAX_N", "H_MULTIPLE"]

MIN_N, MAX_N = 2, 8
H_MULTIPLE = 16
# Each launcher's sizes (module docstring, "Launch configuration"): BLOCK_T tokens a program,
# BLOCK_H columns of h a chunk (pre_forward's: of its slab of _PRE_COLS, which BLOCK_H divides;
# pre_backward's: of its loops over h; update_forward's and update_backward's: a program's),
# and its warps. Read at each launch:
# ``benchmarks/residual_ops.py --mhc-sweep`` times other values by setting them.
LAUNCH = {"pre_forward": dict(BLOCK_T=64, BLOCK_H=128, num_warps=4),
          "pre_backward": dict(BLOCK_T=32, BLOCK_H=128, num_warps=8),
          "update_forward": dict(BLOCK_T=16, BLOCK_H=128, num_warps=8),
          "update_backward": dict(BLOCK_T=16, BLOCK_H=128, num_warps=8)}
# From 5 streams on (NP = 8) the tiles at those sizes hold 2 to 4 times as much (MP = 64 or 128
# mix columns, n-stream tiles of 8); there the smaller sizes below are used, under which the
# kernels pass tests/ops/test_triton_mhc.py (at the sizes above, its n = 8 fp32 case runs past
# the test's time limit).
LAUNCH_WIDE = {"pre_forward": dict(BLOCK_T=16, BLOCK_H=16, num_warps=4),
               "pre_backward": dict(BLOCK_T=16, BLOCK_H=16, num_warps=8),
               "update_forward": dict(BLOCK_T=16, BLOCK_H=16, num_warps=8),
               "update_backward": dict(BLOCK_T=16, BLOCK_H=128, num_warps=8)}
_STAGES = 2
_PRE_COLS = 128  # the pre op: columns of h (of every stream) a program
# (a power of two: the passes without a tl.dot take them as one tile)
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------------
# Helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _dot(a, b, acc, DOT: tl.constexpr, IEEE: tl.constexpr):
    """acc + a @ b with fp32 accumulation, the operands in DOT (fp32 without TF32 where IEEE)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a.to(DOT), b.to(DOT), acc)


@triton.jit
def _in_dtype(x, DOT: tl.constexpr, IEEE: tl.constexpr):
    """fp32 ``x`` rounded to the streams' dtype DOT (as a PyTorch op in that dtype returns it)."""
    if IEEE:
        return x
    else:
        return x.to(DOT).to(tl.float32)


@triton.jit
def _column_scale(gate, cols, N: tl.constexpr):
    """The gating factor of each mix column: gate[0] for H_pre, gate[1] for H_post, gate[2] for
    the H_res logits."""
    g0 = tl.load(gate).to(tl.float32)
    g1 = tl.load(gate + 1).to(tl.float32)
    g2 = tl.load(gate + 2).to(tl.float32)
    return tl.where(cols < N, g0, tl.where(cols < 2 * N, g1, g2))


@triton.jit
def _column(tile, cols, m: tl.constexpr):
    """Column m of a [BLOCK_T, MP] tile as [BLOCK_T]: an exact selection (one term of each sum
    is not zero)."""
    return tl.sum(tl.where(cols[None, :] == m, tile, 0.0), 1)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def _pre_project_kernel(x_ptr, w_ptr, partial_ptr, T, H, N: tl.constexpr, M: tl.constexpr,
                        MP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                        COLS: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """Pass 1 of the pre op's forward on BLOCK_T tokens and one slab of COLS columns of h (of
    every stream; x [T, N, H], W [M, N H]): ``partial[slab, token] = (x @ W^T [M], sum(x^2))``
    summed over the slab's columns only."""
    tok, live = block_tokens(T, BLOCK_T)
    slab = tl.program_id(1)
    hs = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, MP)
    in_m = cols < M
    x_rows = x_ptr + tok[:, None] * N * H  # [BLOCK_T, 1]
    w_rows = w_ptr + cols[None, :] * N * H  # [1, MP]: W's rows, as W^T's columns
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    # A fixed trip count (COLS / BLOCK_H chunks); in the last slab the chunks past h are masked.
    for c0 in range(0, COLS, BLOCK_H):
        c = slab * COLS + c0 + hs
        in_h = c < H
        for m in tl.static_range(N):  # x's column m H + c
            xm = tl.load(x_rows + m * H + c[None, :], mask=live[:, None] & in_h[None, :], other=0.0)
            xf = xm.to(tl.float32)
            sumsq += tl.sum(xf * xf, 1)
            wt = tl.load(w_rows + (m * H + c)[:, None], mask=in_h[:, None] & in_m[None, :],
                         other=0.0)  # [BLOCK_H, MP], loaded transposed
            acc = _dot(xm, wt, acc, DOT, IEEE)
    # int64 rows: slabs x T may pass 2^31 elements of the buffer.
    part = partial_ptr + (slab.to(tl.int64) * T + tok) * (M + 1)
    tl.store(part[:, None] + cols[None, :], acc, mask=live[:, None] & in_m[None, :])
    tl.store(part + M, sumsq, mask=live)


@triton.jit(do_not_specialize=["T"])
def _pre_mix_kernel(x_ptr, sums_ptr, bias_ptr, gate_ptr, u_ptr, post_ptr, res_ptr, mixes_ptr, T, H,
                    eps, N: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                    BLOCK_T: tl.constexpr, COLS: tl.constexpr, DOT: tl.constexpr,
                    IEEE: tl.constexpr):
    """The rest of the pre op's forward on BLOCK_T tokens, given pass 1 summed over the slabs
    (``sums [T, M + 1]``: x @ W^T and sum(x^2)): the mixes and coefficients (written by the
    programs of slab 0), and u = sum_m H_pre[m] X[m] on one slab of COLS columns."""
    tok, live = block_tokens(T, BLOCK_T)
    slab = tl.program_id(1)
    cols = tl.arange(0, MP)
    in_m = cols < M
    live_m = live[:, None] & in_m[None, :]
    sums = sums_ptr + tok * (M + 1)
    projected = tl.load(sums[:, None] + cols[None, :], mask=live_m, other=0.0)
    sumsq = tl.load(sums + M, mask=live, other=0.0)
    r = tl.math.rsqrt(divide(sumsq, (N * H).to(tl.float32)) + eps)
    # The GEMM result rounded once, after the sum over all of x's columns, as PyTorch's matmul.
    mixes = _in_dtype(projected, DOT, IEEE) * r[:, None]

    # The coefficients (reference.mhc_coefficient_logits), computed by every slab's program
    # (a [BLOCK_T, MP] tile, cheaper than another launch) and written by slab 0's.
    scale = _column_scale(gate_ptr, cols, N)
    bias = tl.load(bias_ptr + cols, mask=in_m, other=0.0).to(tl.float32)
    z = mixes * scale[None, :] + bias[None, :]
    s = tl.sigmoid(z)
    is_post = (cols >= N) & (cols < 2 * N)
    is_res = (cols >= 2 * N) & in_m
    writes = live & (slab == 0)
    tl.store(mixes_ptr + tok[:, None] * M + cols[None, :], mixes,
             mask=writes[:, None] & in_m[None, :])
    tl.store(post_ptr + tok[:, None] * N + (cols - N)[None, :], 2 * s,
             mask=writes[:, None] & is_post[None, :])
    tl.store(res_ptr + tok[:, None] * (N * N) + (cols - 2 * N)[None, :], z,
             mask=writes[:, None] & is_res[None, :])
    pre = s + eps  # H_pre[m] is column m

    # Pass 2: u = sum_m H_pre[m] X[m] on the slab's columns, one 2-D tile of them a stream.
    c = slab * COLS + tl.arange(0, COLS)
    live_h = live[:, None] & (c < H)[None, :]
    x_rows = x_ptr + tok[:, None] * N * H
    u = tl.zeros([BLOCK_T, COLS], dtype=tl.float32)
    for m in tl.static_range(N):
        xm = tl.load(x_rows + m * H + c[None, :], mask=live_h, other=0.0).to(tl.float32)
        u += _column(pre, cols, m)[:, None] * xm
    tl.store(u_ptr + tok[:, None] * H + c[None, :], u.to(u_ptr.dtype.element_ty), mask=live_h)


@triton.jit(do_not_specialize=["T"])
def _pre_backward_kernel(x_ptr, w_ptr, bias_ptr, gate_ptr, mixes_ptr, du_ptr, dpost_ptr,
                         dres_ptr, plus_ptr, dx_ptr, grad_r_ptr, per_token_ptr, T, H, eps,
                         N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, PLUS: tl.constexpr,
                         DOT: tl.constexpr, IEEE: tl.constexpr):
    """The pre op's backward on BLOCK_T tokens. Pass 1 over the tokens' rows of X and du:
    dH_pre[m] = <X[m], du> and sum(x^2); then the coefficients' backward, writing r dmixes
    (``grad_r [T, M]``, for dW) and ``per_token [T, M + 3]``: dz (the gradient of the
    pre-activations, whose sum over tokens is the bias gradient) and the three per-token sums
    of dz * mixes (whose sums over tokens are the gate gradient); pass 2 over the rows again:
    dX, plus ``plus [T, N, H]`` (a gradient the streams have from elsewhere) where PLUS."""
    tok, live = block_tokens(T, BLOCK_T)
    ns = tl.arange(0, NP)
    cols = tl.arange(0, MP)
    in_m = cols < M
    hs = tl.arange(0, BLOCK_H)
    x_rows = x_ptr + tok[:, None] * N * H
    dpre = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):  # one 2-D tile a stream
        c = c0 + hs
        live_h = live[:, None] & (c < H)[None, :]
        du = tl.load(du_ptr + tok[:, None] * H + c[None, :], mask=live_h, other=0.0,
                     eviction_policy="evict_last").to(tl.float32)
        for m in tl.static_range(N):
            xm = tl.load(x_rows + m * H + c[None, :], mask=live_h, other=0.0,
                         eviction_policy="evict_last").to(tl.float32)
            sumsq += tl.sum(xm * xm, 1)
            dpre += tl.where(ns[None, :] == m, tl.sum(xm * du, 1)[:, None], 0.0)
    r = tl.math.rsqrt(divide(sumsq, (N * H).to(tl.float32)) + eps)

    # The coefficients' backward (efficient._coefficients_vjp), one column per mix.
    live_m = live[:, None] & in_m[None, :]
    is_pre = cols < N
    is_post = (cols >= N) & (cols < 2 * N)
    is_res = (cols >= 2 * N) & in_m
    mixes = tl.load(mixes_ptr + tok[:, None] * M + cols[None, :], mask=live_m,
                    other=0.0).to(tl.float32)
    scale = _column_scale(gate_ptr, cols, N)
    bias = tl.load(bias_ptr + cols, mask=in_m, other=0.0).to(tl.float32)
    s = tl.sigmoid(mixes * scale[None, :] + bias[None, :])
    dpre_cols = tl.sum(tl.where(cols[None, None, :] == ns[None, :, None], dpre[:, :, None], 0.0), 1)
    dpost = tl.load(dpost_ptr + tok[:, None] * N + (cols - N)[None, :],
                    mask=live[:, None] & is_post[None, :], other=0.0).to(tl.float32)
    dres = tl.load(dres_ptr + tok[:, None] * (N * N) + (cols - 2 * N)[None, :],
                   mask=live[:, None] & is_res[None, :], other=0.0).to(tl.float32)
    dz = tl.where(is_pre[None, :], dpre_cols * s * (1 - s),
                  tl.where(is_post[None, :], 2 * dpost * s * (1 - s), dres))
    dmixes = dz * scale[None, :]
    grad_r = dmixes * r[:, None]
    along = tl.sum(dmixes * mixes, 1)  # dmixes . mixes
    coef = divide(r * r, (N * H).to(tl.float32)) * along
    dzm = dz * mixes
    tl.store(grad_r_ptr + tok[:, None] * M + cols[None, :], grad_r, mask=live_m)
    row = per_token_ptr + tok * (M + 3)
    tl.store(row[:, None] + cols[None, :], dz, mask=live_m)
    tl.store(row + M, tl.sum(tl.where(is_pre[None, :], dzm, 0.0), 1), mask=live)
    tl.store(row + M + 1, tl.sum(tl.where(is_post[None, :], dzm, 0.0), 1), mask=live)
    tl.store(row + M + 2, tl.sum(tl.where(is_res[None, :], dzm, 0.0), 1), mask=live)
    pre = s + eps  # H_pre[m] is column m

    # Pass 2: dX[m] = [(r dmixes) @ W[:, m] - coef x[m]] (the projection's part, rounded to x's
    # dtype as _rms_project_vjp returns it) + H_pre[m] du (+ plus[m]), rounded once.
    for c0 in range(0, H, BLOCK_H):
        c = c0 + hs
        in_h = c < H
        live_h = live[:, None] & in_h[None, :]
        du = tl.load(du_ptr + tok[:, None] * H + c[None, :], mask=live_h, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        for m in tl.static_range(N):
            w = tl.load(w_ptr + cols[:, None] * N * H + (m * H + c)[None, :],
                        mask=in_m[:, None] & in_h[None, :], other=0.0)  # [MP, BLOCK_H]
            projected = _dot(grad_r, w, tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32), DOT, IEEE)
            xm = tl.load(x_rows + m * H + c[None, :], mask=live_h, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            dflat = _in_dtype(_in_dtype(projected, DOT, IEEE) - coef[:, None] * xm, DOT, IEEE)
            dxm = _column(pre, cols, m)[:, None] * du + dflat
            at = tok[:, None] * N * H + m * H + c[None, :]
            if PLUS:
                dxm += tl.load(plus_ptr + at, mask=live_h, other=0.0,
                               eviction_policy="evict_first").to(tl.float32)
            tl.store(dx_ptr + at, dxm.to(dx_ptr.dtype.element_ty), mask=live_h)


@triton.jit(do_not_specialize=["T"])
def _update_forward_kernel(x_ptr, y_ptr, post_ptr, res_ptr, out_ptr, T, H, N: tl.constexpr,
                           NP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[j] = H_post[j] y + sum_m H_res[m, j] X[m] on BLOCK_T tokens and BLOCK_H columns."""
    tok, live = block_tokens(T, BLOCK_T)
    c = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    in_h = c < H
    ns = tl.arange(0, NP)
    in_n = ns < N
    live_h = live[:, None] & in_h[None, :]
    live_n = live[:, None] & in_n[None, :]
    mixed = tl.zeros([BLOCK_T, NP, BLOCK_H], dtype=tl.float32)
    for m in tl.static_range(N):
        xm = tl.load(x_ptr + tok[:, None] * N * H + m * H + c[None, :], mask=live_h,
                     other=0.0).to(tl.float32)
        res_m = tl.load(res_ptr + tok[:, None] * (N * N) + m * N + ns[None, :], mask=live_n,
                        other=0.0).to(tl.float32)  # H_res[m, :]
        mixed += res_m[:, :, None] * xm[:, None, :]
    post = tl.load(post_ptr + tok[:, None] * N + ns[None, :], mask=live_n, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + tok[:, None] * H + c[None, :], mask=live_h, other=0.0).to(tl.float32)
    out = post[:, :, None] * y[:, None, :] + mixed
    tl.store(out_ptr + tok[:, None, None] * N * H + ns[None, :, None] * H + c[None, None, :],
             out.to(out_ptr.dtype.element_ty), mask=live_n[:, :, None] & in_h[None, None, :])


@triton.jit(do_not_specialize=["T"])
def _update_backward_kernel(x_ptr, y_ptr, post_ptr, res_ptr, g_ptr, dx_ptr, dy_ptr, partial_ptr,
                            T, H, N: tl.constexpr, SP: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_H: tl.constexpr):
    """dX and dy of BLOCK_T tokens and one chunk of BLOCK_H columns given g = dout, and the
    chunk's share of dH_post and dH_res: ``partial[chunk, token] = (dH_post [N], dH_res [N, N])``
    summed over the chunk's columns only.

    Only 2-D [BLOCK_T, BLOCK_H] tiles: the sums over streams are unrolled (N is a constexpr),
    every sum over columns reduces axis 1 of such a tile into its column of a [BLOCK_T, SP]
    tile of the shares (SP = N + N N rounded up to a power of two), stored at the end in one
    store of whole rows. g[j] is loaded once a stream m (N times; the later loads come from the
    cache)."""
    tok, live = block_tokens(T, BLOCK_T)
    chunk = tl.program_id(1)
    c = chunk * BLOCK_H + tl.arange(0, BLOCK_H)
    live_h = live[:, None] & (c < H)[None, :]
    column = tok[:, None] * N * H + c[None, :]  # column c of stream 0 of each token
    slots = tl.arange(0, SP)
    shares = tl.zeros([BLOCK_T, SP], dtype=tl.float32)
    y = tl.load(y_ptr + tok[:, None] * H + c[None, :], mask=live_h, other=0.0).to(tl.float32)
    dy = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(N):
        gj = tl.load(g_ptr + column + j * H, mask=live_h, other=0.0).to(tl.float32)
        post_j = tl.load(post_ptr + tok * N + j, mask=live, other=0.0).to(tl.float32)
        dy += post_j[:, None] * gj
        shares = tl.where(slots[None, :] == j, tl.sum(gj * y, 1)[:, None], shares)  # dH_post[j]
    tl.store(dy_ptr + tok[:, None] * H + c[None, :], dy.to(dy_ptr.dtype.element_ty), mask=live_h)
    for m in tl.static_range(N):
        xm = tl.load(x_ptr + column + m * H, mask=live_h, other=0.0).to(tl.float32)
        dxm = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(N):
            gj = tl.load(g_ptr + column + j * H, mask=live_h, other=0.0).to(tl.float32)
            res_mj = tl.load(res_ptr + tok * (N * N) + m * N + j, mask=live,
                             other=0.0).to(tl.float32)
            dxm += res_mj[:, None] * gj
            shares = tl.where(slots[None, :] == N + m * N + j, tl.sum(xm * gj, 1)[:, None],
                              shares)  # dH_res[m, j]
        tl.store(dx_ptr + column + m * H, dxm.to(dx_ptr.dtype.element_ty), mask=live_h)
    # int64 rows: chunks x T may pass 2^31 elements of the buffer.
    part = partial_ptr + (chunk.to(tl.int64) * T + tok) * (N + N * N)
    tl.store(part[:, None] + slots[None, :], shares,
             mask=live[:, None] & (slots < N + N * N)[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _streams(streams: torch.Tensor):
    """``(x [T, n, h] contiguous, n, h, the leading shape)``, or a ValueError (the rule of the
    ``mhc`` op's triton backend in the backend registry: ``registry.BackendUnavailable``)."""
    registry.require("mhc", "triton", streams)
    n, h = streams.shape[-2:]
    return streams.reshape(-1, n, h).contiguous(), n, h, streams.shape[:-2]


def _tokens_of(name: str, tensor: torch.Tensor, lead, tail) -> torch.Tensor:
    """``tensor [*lead, *tail]`` as contiguous ``[T, *tail]``, or a ValueError."""
    if tuple(tensor.shape) != (*lead, *tail):
        raise ValueError(f"triton mhc: {name} must have shape {(*lead, *tail)} (no broadcasting), "
                         f"got {tuple(tensor.shape)}")
    return tensor.reshape(-1, *tail).contiguous()


def _launch(name: str, padded: int) -> dict:
    """The launch sizes of launcher ``name`` at NP = ``padded`` streams."""
    return (LAUNCH if padded <= 4 else LAUNCH_WIDE)[name]


def _padded(n: int):
    """``(NP, M, MP)`` for n streams."""
    padded = triton.next_power_of_2(n)
    width = (2 + n) * n
    return padded, width, max(16, triton.next_power_of_2(width))


def _parameters(weight, bias, gate, n: int, h: int):
    width = (2 + n) * n
    weight = _tokens_of("weight", weight, (width,), (n * h,))
    return weight, _tokens_of("bias", bias, (), (width,)), _tokens_of("gate", gate, (), (3,))


def _operand(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """W as the kernels' GEMMs take it: in the streams' dtype, to which they round it (so the
    same values; cast once here, a bf16 W is half the bytes each program reads of an fp32 one)."""
    return weight.to(x.dtype)


def _dot_flags(dtype: torch.dtype) -> dict:
    return dict(DOT=_DOT_DTYPES[dtype], IEEE=dtype == torch.float32)


def pre_forward(streams: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                gate: torch.Tensor, eps: float):
    """:func:`.efficient._mhc_pre_forward_body`: ``(u [..., h] in the streams' dtype, H_post
    [..., n], H_res logits [..., n, n], mixes [..., (2 + n) n])``, the last three fp32."""
    x, n, h, lead = _streams(streams)
    weight, bias, gate = _parameters(weight, bias, gate, n, h)
    padded, width, width_padded = _padded(n)
    tokens = x.shape[0]
    slabs = triton.cdiv(h, _PRE_COLS)
    launch = _launch("pre_forward", padded)
    u = torch.empty((tokens, h), dtype=x.dtype, device=x.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    res = torch.empty((tokens, n, n), dtype=torch.float32, device=x.device)
    mixes = torch.empty((tokens, width), dtype=torch.float32, device=x.device)
    # Per slab of columns and token: x @ W^T [(2 + n) n] and sum(x^2), fp32, summed over the
    # slabs below (in a fixed order: deterministic, no atomics).
    partial = torch.empty((slabs, tokens, width + 1), dtype=torch.float32, device=x.device)
    if tokens:
        grid = (triton.cdiv(tokens, launch["BLOCK_T"]), slabs)
        shapes = dict(N=n, M=width, MP=width_padded, BLOCK_T=launch["BLOCK_T"], COLS=_PRE_COLS,
                      num_warps=launch["num_warps"], num_stages=_STAGES, **_dot_flags(x.dtype))
        with launch_device(x.device):
            _pre_project_kernel[grid](x, _operand(weight, x), partial, tokens, h,
                                      BLOCK_H=launch["BLOCK_H"], **shapes)
            _pre_mix_kernel[grid](x, partial.sum(0), bias, gate, u, post, res, mixes, tokens, h,
                                  float(eps), **shapes)
    return (u.view(*lead, h), post.view(*lead, n), res.view(*lead, n, n),
            mixes.view(*lead, width))


def pre_backward(streams: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                 gate: torch.Tensor, mixes: torch.Tensor, grad_u: torch.Tensor,
                 grad_post: torch.Tensor, dres: torch.Tensor, eps: float,
                 plus: torch.Tensor | None = None):
    """:func:`.efficient._mhc_pre_vjp`: ``(dstreams, dweight, dbias, dgate)`` in the dtypes of
    streams, weight, bias and gate, given the gradients of u, H_post and the H_res logits, and
    ``plus`` (streams' shape and dtype, or None) added to dstreams in fp32 before its rounding."""
    x, n, h, lead = _streams(streams)
    weight, bias, gate = _parameters(weight, bias, gate, n, h)
    padded, width, width_padded = _padded(n)
    mixes = _tokens_of("mixes", mixes, lead, (width,))
    grad_u = _tokens_of("grad_u", grad_u, lead, (h,))
    grad_post = _tokens_of("grad_post", grad_post, lead, (n,))
    dres = _tokens_of("dres", dres, lead, (n, n))
    if plus is not None:
        plus = _tokens_of("plus", plus, lead, (n, h))
    tokens = x.shape[0]
    launch = _launch("pre_backward", padded)
    dx = torch.empty_like(x)
    grad_r = torch.empty((tokens, width), dtype=torch.float32, device=x.device)
    per_token = torch.empty((tokens, width + 3), dtype=torch.float32, device=x.device)
    if tokens:
        with launch_device(x.device):
            _pre_backward_kernel[(triton.cdiv(tokens, launch["BLOCK_T"]),)](
                x, _operand(weight, x), bias, gate, mixes, grad_u, grad_post, dres,
                plus if plus is not None else x, dx, grad_r, per_token, tokens, h, float(eps),
                N=n, NP=padded, M=width, MP=width_padded, PLUS=plus is not None,
                num_stages=_STAGES, **launch, **_dot_flags(x.dtype))
    # As efficient._rms_project_vjp: dW = (r dmixes)^T x, the GEMM in x's dtype.
    dweight = (grad_r.t().to(x.dtype) @ x.view(tokens, n * h)).to(weight.dtype)
    sums = per_token.sum(0)
    return (dx.view(*lead, n, h), dweight, sums[:width].to(bias.dtype),
            sums[width:].to(gate.dtype))


def update_forward(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                   res: torch.Tensor) -> torch.Tensor:
    """:func:`.efficient._stream_update_forward_body`: ``out[j] = post[j] y + sum_m res[m, j]
    X[m]`` in the streams' dtype."""
    x, n, h, lead = _streams(streams)
    y = _tokens_of("y", y, lead, (h,))
    post = _tokens_of("post", post, lead, (n,))
    res = _tokens_of("res", res, lead, (n, n))
    padded = _padded(n)[0]
    launch = _launch("update_forward", padded)
    tokens = x.shape[0]
    out = torch.empty_like(x)
    if tokens:
        grid = (triton.cdiv(tokens, launch["BLOCK_T"]), triton.cdiv(h, launch["BLOCK_H"]))
        with launch_device(x.device):
            _update_forward_kernel[grid](x, y, post, res, out, tokens, h, N=n, NP=padded,
                                         num_stages=_STAGES, **launch)
    return out.view(*lead, n, h)


def update_backward(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                    res: torch.Tensor, grad: torch.Tensor):
    """:func:`.efficient._stream_update_vjp`: ``(dstreams, dy, dpost, dres)`` in the dtypes of
    streams, y, post and res, given ``grad`` at the output."""
    x, n, h, lead = _streams(streams)
    y_shape, post_shape, res_shape = y.shape, post.shape, res.shape
    y = _tokens_of("y", y, lead, (h,))
    post = _tokens_of("post", post, lead, (n,))
    res = _tokens_of("res", res, lead, (n, n))
    grad = _tokens_of("grad", grad, lead, (n, h))
    launch = _launch("update_backward", _padded(n)[0])
    chunks = triton.cdiv(h, launch["BLOCK_H"])
    tokens = x.shape[0]
    dx, dy = torch.empty_like(x), torch.empty_like(y)
    # Per chunk of columns and token: dH_post [n] and dH_res [n, n], fp32, summed over the
    # chunks below (in a fixed order: deterministic, no atomics).
    partial = torch.empty((chunks, tokens, n + n * n), dtype=torch.float32, device=x.device)
    if tokens:
        with launch_device(x.device):
            _update_backward_kernel[(triton.cdiv(tokens, launch["BLOCK_T"]), chunks)](
                x, y, post, res, grad, dx, dy, partial, tokens, h, N=n,
                SP=triton.next_power_of_2(n + n * n), num_stages=_STAGES, **launch)
    sums = partial.sum(0)
    dpost = sums[:, :n].to(post.dtype).contiguous()
    dres = sums[:, n:].to(res.dtype).contiguous()
    return dx.view(*lead, n, h), dy.view(y_shape), dpost.view(post_shape), dres.view(res_shape)
