"""Depth attention of Attention Residuals in Triton, forward and backward, in one launch each
for all the source groups of a call; and block AttnRes's exit, :func:`add_into_last_slot` (the
FFN's output added to the packed state's last slot in place; vectorised, where PyTorch's
addition into a strided slot is not).

Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031): a sublayer's
input is a softmax over depth, ``h = sum_k alpha_k v_k``, ``alpha = softmax_k(z)``, ``z_k = r_k
(v_k . q)``, ``r_k = rsqrt(mean(v_k^2) + eps)``, over K sources ``v_k [T, h]`` and a pseudo-query
``q [h]`` (definition in :mod:`.reference`). The sources come in up to ``MAX_GROUPS`` = 4 groups
``[..., k_i, h]`` (views into the packed state between layers, and the layer's own outputs);
each group is read in place through its own pointer, token stride and slot stride, so a view
needs no copy, and the group sizes are kernel arguments. Two options serve block AttnRes's
packed state (efficient.py says why), and a third the forward's pass 2:

- ``last_plus [..., h]``: the first group's last source is that slot plus ``last_plus``, the sum
  made where it is read (rounded to the group's dtype, as PyTorch's addition would); backward
  also writes that source's gradient as the gradient of ``last_plus``;
- ``first_grad`` (backward, the first group's shape, any strides): a gradient the first group
  already has, added to its dv before it is written (in fp32 after rounding dv to the dtype, as
  autograd's addition of the two would);
- ``first_out`` (forward): the first group as read, ``last_plus`` included, written out as it is
  read in pass 2 (block AttnRes's FFN passes the packed state on with the mixer's output added:
  one write of the state in a pass that reads it anyway, where a separate exit op would read it
  once more). Its gradient is the backward's ``first_grad``. It makes the forward kernels write
  more, and spares the block AttnRes step the exit's kernel and a number of autograd's
  additions, for less GPU time a step in all (``benchmarks/residual_step.py``).

The kernels compute exactly efficient._DepthAttention's PyTorch path (to fp32 rounding), one
program per block of ``BLOCK_T`` tokens, the sources read in their own dtype, h in chunks of
``BLOCK_H`` columns:

    forward    pass 1 over the sources: r_k and z_k (fp32, per source); the softmax over the K
               sources of a token in registers ([BLOCK_T, KP] tiles); z, r, alpha written
               ([T, K] fp32, kept for backward); pass 2 over the sources: out = sum_k alpha_k
               v_k, accumulated in fp32 and written in the sources' dtype.
               Reads every source twice, writes out.
    backward   pass 1 over the sources and g, a chunk of columns at a time (g's chunk loaded
               once for all sources): dalpha_k = <g, v_k>; dz = alpha (dalpha - sum_k
               alpha_k dalpha_k) in registers; pass 2 over the sources and g, backwards (the
               last chunk of columns and the last source first): dv_k = alpha_k g +
               dz_k r_k q - (dz_k z_k r_k / h) v_k written into one gradient tensor per group
               (in the group's dtype; plus first_grad for the first group), and the per-block
               partial sums over tokens of dq = sum_k dz_k r_k v_k ([cdiv(T, BLOCK_T), h] fp32)
               reduced outside by one torch sum. Reads every source and g twice, writes every
               dv_k.

dquery goes through per-block partial sums rather than atomics: the result is deterministic
(run to run, as the PyTorch path), and the partials are small (T / 16 rows of h fp32: 2 MB at
T = 8192, h = 1024) next to the sources (K T h values).

Numerics, as the PyTorch bodies: every sum and product in fp32 after reading its operands in
their dtype (r_k = rsqrt(sum(v^2) / h + eps), the division rounded to nearest as PyTorch's
mean; the softmax with its maximum subtracted); results written in the dtype of the tensor they
are the value or gradient of (out in the first group's dtype, dv_k in its group's, dquery in the
query's; z, r, alpha fp32). Sums run in another order than PyTorch's (per chunk of columns, then
over chunks; dquery per block of tokens, then over blocks), and on a GPU exp and rsqrt are
approximate and multiply-adds may fuse, so results equal the PyTorch path to fp32 rounding, not
bitwise.

Per-source scalars live in [BLOCK_T, KP] tiles (KP = K rounded up to a power of two, the padding
masked: z = -inf in the softmax, loads 0, stores skipped). A source's column is set with a masked
update (``tl.where`` on the column index) and read with a masked sum (an exact selection): the
forward's pass 1 sets z and r once per source, the backward's pass 1 adds each source's sum over
a chunk into its column of dalpha, and both passes 2 read a source's columns once per source and
chunk.

Launch configuration (fixed): BLOCK_H = 128, 16 tokens a program; 4 warps forward and 2 backward
(``_FORWARD_LAUNCH``, ``_BACKWARD_LAUNCH``), chosen with ``benchmarks/residual_ops.py
--depth-sweep`` (bf16, h = 1024, 5 sources) and checked in the block AttnRes training step
(``benchmarks/residual_step.py``); their current speed is in
benchmarks/results/residual_ops_h200.json.

Loads in flight: the loops that stream the sources (forward pass 1 over a source's columns,
forward pass 2 and both backward passes over a group's sources) are ``tl.range`` loops with
``num_stages = _LOOP_STAGES``, so Triton software-pipelines their loads (cp.async on sm_90)
instead of issuing each iteration's loads and waiting on them, which matters because the
kernels are bound by the latency of their loads.

One compiled kernel per (number of groups, KP, dtypes, options); the token count and the numbers
of sources are not specialised on. The strides are, and the launchers make every one of them a
multiple of 16 elements (copying a group whose strides are not): knowing it, Triton loads a row's
columns in 16-byte vectors (with the strides unspecialised every load would be one element wide).

Constraints: 1 <= number of groups <= 4, 1 <= K <= 64 sources in all, h a multiple of 16, the
groups (and last_plus) in one dtype among fp32, bf16 and fp16 with the same leading (token)
dimensions, the query ``[h]``; a group whose leading dimensions cannot be viewed as one token
dimension, or whose columns are strided, is copied. Anything else raises a ValueError naming the
constraint (:func:`unsupported_reason`); efficient.py then runs the PyTorch path. CUDA tensors,
or CPU tensors under Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .. import registry
from .triton_common import block_tokens, divide, launch_device

__all__ = ["forward", "backward", "add_into_last_slot", "MAX_GROUPS", "MAX_SOURCES", "H_MULTIPLE",
           "padded_sources"]

MAX_GROUPS = 4
MAX_SOURCES = 64
H_MULTIPLE = 16
BLOCK_H = 128
# Tokens a program and warps, each direction (module docstring, "Launch configuration"); read at
# each launch: ``benchmarks/residual_ops.py --depth-sweep`` times other values by setting them.
_FORWARD_LAUNCH = dict(BLOCK_T=16, num_warps=4)
_BACKWARD_LAUNCH = dict(BLOCK_T=16, num_warps=2)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Not specialised on: the token count and the numbers of sources. The strides are: Triton then
# knows that they are multiples of 16 (the launchers make them so, see _tokens_view) and loads a
# row's columns in 16-byte vectors; unspecialised, it would load them one element at a time.
_RUNTIME = ["T", "K"] + [f"k{i}" for i in range(MAX_GROUPS)]
_STRIDE_MULTIPLE = 16
# Software-pipelining depth of the loops that stream the sources (module docstring, "Loads in
# flight"): with a plain ``range`` each iteration issues its loads and waits on them.
_LOOP_STAGES = tl.constexpr(3)


# ---------------------------------------------------------------------------------------------
# Helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _column(tile, ks, index):
    """Column ``index`` of a [BLOCK_T, KP] tile as [BLOCK_T] (an exact selection)."""
    return tl.sum(tl.where(ks[None, :] == index, tile, 0.0), 1)


@triton.jit
def _source(rows, k, s_stride, c, mask, plus_rows, last, PLUS: tl.constexpr):
    """Source k of a group on the columns c, in fp32: its slot, plus ``plus_rows`` where PLUS and
    k == last (the sum rounded to the group's dtype first, as PyTorch's addition of the two)."""
    v = tl.load(rows + k * s_stride + c[None, :], mask=mask, other=0.0)
    if PLUS:
        p = tl.load(plus_rows + c[None, :], mask=mask & (k == last), other=0.0)
        v = (v.to(tl.float32) + p.to(tl.float32)).to(v.dtype)
    return v.to(tl.float32)


@triton.jit
def _group_logits(v_ptr, t_stride, s_stride, count, offset, plus_rows, q_ptr, tok, live, ks, z,
                  r, H, eps, PLUS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """z and r ([BLOCK_T, KP]) with the columns offset .. offset + count - 1 of one group set."""
    hs = tl.arange(0, BLOCK_H)
    rows = v_ptr + tok[:, None] * t_stride
    for k in range(0, count):
        sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
        dot = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c0 in tl.range(0, H, BLOCK_H, num_stages=_LOOP_STAGES):
            c = c0 + hs
            in_h = c < H
            v = _source(rows, k, s_stride, c, live[:, None] & in_h[None, :], plus_rows,
                        count - 1, PLUS)
            q = tl.load(q_ptr + c, mask=in_h, other=0.0).to(tl.float32)
            sumsq += tl.sum(v * v, 1)
            dot += tl.sum(v * q[None, :], 1)
        rk = tl.math.rsqrt(divide(sumsq, H.to(tl.float32)) + eps)
        pick = ks[None, :] == offset + k
        z = tl.where(pick, (dot * rk)[:, None], z)
        r = tl.where(pick, rk[:, None], r)
    return z, r


@triton.jit
def _group_sum(v_ptr, t_stride, s_stride, count, offset, plus_rows, copy_rows, alpha, acc, tok,
               live, ks, c, in_h, H, PLUS: tl.constexpr, COPY: tl.constexpr):
    """acc + sum_k alpha_k v_k over one group, on the columns c; where COPY, each source (with
    its plus) also stored into copy_rows ([count, H] a token, in the group's dtype)."""
    rows = v_ptr + tok[:, None] * t_stride
    mask = live[:, None] & in_h[None, :]
    for k in tl.range(0, count, num_stages=_LOOP_STAGES):
        v = _source(rows, k, s_stride, c, mask, plus_rows, count - 1, PLUS)
        if COPY:  # v holds a value of the dtype (the sum rounded in _source): stored exactly
            tl.store(copy_rows + k * H + c[None, :], v.to(copy_rows.dtype.element_ty), mask=mask)
        acc += _column(alpha, ks, offset + k)[:, None] * v
    return acc


@triton.jit
def _chunk_dalpha(v_ptr, t_stride, s_stride, count, offset, plus_rows, g, tok, ks, dalpha, c,
                  live_h, PLUS: tl.constexpr):
    """dalpha ([BLOCK_T, KP]) plus <g, v_k> on the columns c, for the sources of one group."""
    rows = v_ptr + tok[:, None] * t_stride
    for k in tl.range(0, count, num_stages=_LOOP_STAGES):
        v = _source(rows, k, s_stride, c, live_h, plus_rows, count - 1, PLUS)
        dalpha = tl.where(ks[None, :] == offset + k, dalpha + tl.sum(v * g, 1)[:, None], dalpha)
    return dalpha


@triton.jit
def _group_vjp(v_ptr, t_stride, s_stride, count, d_ptr, offset, plus_rows, dplus_rows, a_rows,
               a_slot, g, q, alpha, along, coef, dq, tok, live, ks, c, in_h, H,
               PLUS: tl.constexpr, ACC: tl.constexpr):
    """dv_k of one group on the columns c, written into d_ptr [T, count, H] (where ACC, plus the
    incoming gradient at a_rows; where PLUS, the last source's also into dplus_rows), and
    dq + sum_k along_k v_k. The sources in reverse order (the backward's pass 2 runs backwards)."""
    rows = v_ptr + tok[:, None] * t_stride
    d_rows = d_ptr + tok[:, None] * count * H
    live_h = live[:, None] & in_h[None, :]
    for j in tl.range(0, count, num_stages=_LOOP_STAGES):
        k = count - 1 - j
        v = _source(rows, k, s_stride, c, live_h, plus_rows, count - 1, PLUS)
        along_k = _column(along, ks, offset + k)[:, None]
        dv = (_column(alpha, ks, offset + k)[:, None] * g + along_k * q[None, :]
              - _column(coef, ks, offset + k)[:, None] * v).to(d_ptr.dtype.element_ty)
        if ACC:
            a = tl.load(a_rows + k * a_slot + c[None, :], mask=live_h, other=0.0)
            dv = (dv.to(tl.float32) + a.to(tl.float32)).to(d_ptr.dtype.element_ty)
        if PLUS:
            tl.store(dplus_rows + c[None, :], dv, mask=live_h & (k == count - 1))
        tl.store(d_rows + k * H + c[None, :], dv, mask=live_h)
        dq += along_k * v
    return dq


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_RUNTIME)
def _forward_kernel(q_ptr, out_ptr, z_ptr, r_ptr, alpha_ptr, p_ptr, pt, copy_ptr,
                    v0, t0, s0, k0, v1, t1, s1, k1, v2, t2, s2, k2, v3, t3, s3, k3,
                    T, K, H, eps, NG: tl.constexpr, KP: tl.constexpr, PLUS: tl.constexpr,
                    COPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out, z, r, alpha of BLOCK_T tokens over the NG groups (vi [T, ki, H] at token stride ti,
    slot stride si); where PLUS, group 0's last source plus p [T, H] (token stride pt); where
    COPY, group 0's sources as read (with the plus) also into copy [T, k0, H] (contiguous)."""
    tok, live = block_tokens(T, BLOCK_T)
    ks = tl.arange(0, KP)
    in_k = ks < K
    p_rows = p_ptr + tok[:, None] * pt
    copy_rows = copy_ptr + tok[:, None] * k0 * H

    # Pass 1: r_k and z_k of every source.
    z = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    r = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    z, r = _group_logits(v0, t0, s0, k0, 0, p_rows, q_ptr, tok, live, ks, z, r, H, eps, PLUS,
                         BLOCK_T, BLOCK_H)
    if NG > 1:
        z, r = _group_logits(v1, t1, s1, k1, k0, p_rows, q_ptr, tok, live, ks, z, r, H, eps,
                             False, BLOCK_T, BLOCK_H)
    if NG > 2:
        z, r = _group_logits(v2, t2, s2, k2, k0 + k1, p_rows, q_ptr, tok, live, ks, z, r, H, eps,
                             False, BLOCK_T, BLOCK_H)
    if NG > 3:
        z, r = _group_logits(v3, t3, s3, k3, k0 + k1 + k2, p_rows, q_ptr, tok, live, ks, z, r, H,
                             eps, False, BLOCK_T, BLOCK_H)

    # The softmax over the K sources.
    masked = tl.where(in_k[None, :], z, float("-inf"))
    e = tl.exp(masked - tl.max(masked, 1)[:, None])
    alpha = divide(e, tl.sum(e, 1)[:, None])
    live_k = live[:, None] & in_k[None, :]
    at = tok[:, None] * K + ks[None, :]
    tl.store(z_ptr + at, z, mask=live_k)
    tl.store(r_ptr + at, r, mask=live_k)
    tl.store(alpha_ptr + at, alpha, mask=live_k)

    # Pass 2: out = sum_k alpha_k v_k.
    hs = tl.arange(0, BLOCK_H)
    for c0 in range(0, H, BLOCK_H):
        c = c0 + hs
        in_h = c < H
        acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        acc = _group_sum(v0, t0, s0, k0, 0, p_rows, copy_rows, alpha, acc, tok, live, ks, c,
                         in_h, H, PLUS, COPY)
        if NG > 1:
            acc = _group_sum(v1, t1, s1, k1, k0, p_rows, copy_rows, alpha, acc, tok, live, ks, c,
                             in_h, H, False, False)
        if NG > 2:
            acc = _group_sum(v2, t2, s2, k2, k0 + k1, p_rows, copy_rows, alpha, acc, tok, live,
                             ks, c, in_h, H, False, False)
        if NG > 3:
            acc = _group_sum(v3, t3, s3, k3, k0 + k1 + k2, p_rows, copy_rows, alpha, acc, tok,
                             live, ks, c, in_h, H, False, False)
        tl.store(out_ptr + tok[:, None] * H + c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & in_h[None, :])


@triton.jit(do_not_specialize=_RUNTIME)
def _backward_kernel(q_ptr, g_ptr, gt, z_ptr, r_ptr, alpha_ptr, dq_ptr, p_ptr, pt, dp_ptr,
                     a_ptr, at_, as_, v0, t0, s0, k0, d0, v1, t1, s1, k1, d1, v2, t2, s2, k2, d2,
                     v3, t3, s3, k3, d3, T, K, H, NG: tl.constexpr, KP: tl.constexpr,
                     PLUS: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    """dv of every source of BLOCK_T tokens into di [T, ki, H] (contiguous), and this block's
    partial sum of dq (dq_ptr [cdiv(T, BLOCK_T), H]), given g = dout [T, H] (token stride gt).
    Where PLUS (group 0's last source plus p), that source's dv also into dp [T, H]; where ACC,
    d0 is dv plus a [T, k0, H] (token stride at_, slot stride as_)."""
    tok, live = block_tokens(T, BLOCK_T)
    ks = tl.arange(0, KP)
    live_k = live[:, None] & (ks < K)[None, :]
    at = tok[:, None] * K + ks[None, :]
    z = tl.load(z_ptr + at, mask=live_k, other=0.0)
    r = tl.load(r_ptr + at, mask=live_k, other=0.0)
    alpha = tl.load(alpha_ptr + at, mask=live_k, other=0.0)
    g_rows = g_ptr + tok[:, None] * gt
    p_rows = p_ptr + tok[:, None] * pt
    dp_rows = dp_ptr + tok[:, None] * H
    a_rows = a_ptr + tok[:, None] * at_

    # Pass 1: dalpha_k = <g, v_k>, chunk by chunk of columns (g's chunk loaded once), then dz.
    hs = tl.arange(0, BLOCK_H)
    dalpha = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    for c0 in range(0, H, BLOCK_H):
        c = c0 + hs
        live_h = live[:, None] & (c < H)[None, :]
        g = tl.load(g_rows + c[None, :], mask=live_h, other=0.0).to(tl.float32)
        dalpha = _chunk_dalpha(v0, t0, s0, k0, 0, p_rows, g, tok, ks, dalpha, c, live_h, PLUS)
        if NG > 1:
            dalpha = _chunk_dalpha(v1, t1, s1, k1, k0, p_rows, g, tok, ks, dalpha, c, live_h,
                                   False)
        if NG > 2:
            dalpha = _chunk_dalpha(v2, t2, s2, k2, k0 + k1, p_rows, g, tok, ks, dalpha, c,
                                   live_h, False)
        if NG > 3:
            dalpha = _chunk_dalpha(v3, t3, s3, k3, k0 + k1 + k2, p_rows, g, tok, ks, dalpha, c,
                                   live_h, False)
    dz = alpha * (dalpha - tl.sum(alpha * dalpha, 1)[:, None])
    along = dz * r
    coef = divide(along * z * r, H.to(tl.float32))

    # Pass 2: dv_k and dq, backwards (the last chunk and the last source first: what pass 1 read
    # last is the likeliest to be still in L2).
    chunks = tl.cdiv(H, BLOCK_H)
    for i in range(0, chunks):
        c = (chunks - 1 - i) * BLOCK_H + hs
        in_h = c < H
        g = tl.load(g_rows + c[None, :], mask=live[:, None] & in_h[None, :],
                    other=0.0).to(tl.float32)
        q = tl.load(q_ptr + c, mask=in_h, other=0.0).to(tl.float32)
        dq = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        if NG > 3:
            dq = _group_vjp(v3, t3, s3, k3, d3, k0 + k1 + k2, p_rows, dp_rows, a_rows, as_, g, q,
                            alpha, along, coef, dq, tok, live, ks, c, in_h, H, False, False)
        if NG > 2:
            dq = _group_vjp(v2, t2, s2, k2, d2, k0 + k1, p_rows, dp_rows, a_rows, as_, g, q,
                            alpha, along, coef, dq, tok, live, ks, c, in_h, H, False, False)
        if NG > 1:
            dq = _group_vjp(v1, t1, s1, k1, d1, k0, p_rows, dp_rows, a_rows, as_, g, q, alpha,
                            along, coef, dq, tok, live, ks, c, in_h, H, False, False)
        dq = _group_vjp(v0, t0, s0, k0, d0, 0, p_rows, dp_rows, a_rows, as_, g, q, alpha, along,
                        coef, dq, tok, live, ks, c, in_h, H, PLUS, ACC)
        tl.store(dq_ptr + tl.program_id(0) * H + c, tl.sum(dq, 0), mask=in_h)


@triton.jit(do_not_specialize=["T"])
def _add_into_last_kernel(packed_ptr, addend_ptr, T, W, H, BLOCK_T: tl.constexpr,
                          BLOCK_H: tl.constexpr):
    """packed [T, W]'s last H columns += addend [T, H] in place (the sum rounded to the dtype),
    on BLOCK_T tokens and BLOCK_H columns of the last slot."""
    tok, live = block_tokens(T, BLOCK_T)
    col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = live[:, None] & (col < H)[None, :]
    at = packed_ptr + tok[:, None] * W + (W - H) + col[None, :]
    v = tl.load(at, mask=mask, other=0.0)
    a = tl.load(addend_ptr + tok[:, None] * H + col[None, :], mask=mask, other=0.0)
    tl.store(at, (v.to(tl.float32) + a.to(tl.float32)).to(v.dtype), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def padded_sources(count: int) -> int:
    """KP: the number of sources K rounded up to a power of two (what the kernels compile for)."""
    return triton.next_power_of_2(max(1, count))


def _tokens_view(tensor: torch.Tensor, *inner: int) -> torch.Tensor:
    """``tensor [..., *inner]`` as ``[T, *inner]`` with unit column stride and the other strides
    multiples of 16 (:func:`_stride`'s): a view where the leading dimensions merge into one and
    the strides allow it, a copy otherwise. So every call runs the one compiled kernel that the
    first-use check in efficient.py ran."""
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    try:
        view = tensor.view(-1, *inner)
    except RuntimeError:
        view = tensor.reshape(-1, *inner)
    if (view.data_ptr() % 16  # Triton specialises pointers on 16-byte alignment
            or any(_stride(view, dim) % _STRIDE_MULTIPLE for dim in range(view.dim() - 1))):
        # A new tensor (contiguous() would return a misaligned contiguous one as it is); h is a
        # multiple of 16, so then are its strides.
        view = view.clone(memory_format=torch.contiguous_format)
    return view


def _stride(tensor: torch.Tensor, dim: int) -> int:
    """The stride the kernels take for ``dim``: 0 where it has one element (never stepped)."""
    return tensor.stride(dim) if tensor.shape[dim] > 1 else 0


def _prepare(query, groups, last_plus):
    registry.require("depth_attention", "triton", query, groups, last_plus=last_plus)
    h = groups[0].shape[-1]
    views = [_tokens_view(tensor, tensor.shape[-2], h) for tensor in groups]
    plus = None if last_plus is None else _tokens_view(last_plus, h)
    return query.contiguous(), views, plus, sum(v.shape[1] for v in views)


def _group_arguments(views, grads=None):
    """The kernels' per-group arguments, padded to MAX_GROUPS with empty groups."""
    arguments = []
    for i in range(MAX_GROUPS):
        v = views[min(i, len(views) - 1)]
        arguments += [v, _stride(v, 0), _stride(v, 1), v.shape[1] if i < len(views) else 0]
        if grads is not None:
            arguments.append(grads[min(i, len(views) - 1)])
    return arguments


def forward(query: torch.Tensor, groups: Sequence[torch.Tensor], eps: float,
            last_plus: torch.Tensor | None = None, first_out: torch.Tensor | None = None):
    """efficient._DepthAttention's forward: ``(out [..., h] in the groups' dtype, z, r, alpha
    [..., K] fp32)``; with ``last_plus``, the first group's last source is that slot plus
    ``last_plus``. ``first_out`` (contiguous, the first group's shape and dtype): also written
    with the first group as read, its last source plus ``last_plus`` (block AttnRes's packed
    state with the mixer's output added, made in the pass that reads it)."""
    query, views, plus, total = _prepare(query, groups, last_plus)
    first, shape = views[0], groups[0].shape
    tokens, h = first.shape[0], shape[-1]
    lead = shape[:-2]
    if first_out is not None and (first_out.shape != shape or first_out.dtype != first.dtype
                                  or not first_out.is_contiguous()):
        raise ValueError(f"triton depth: first_out must be a contiguous {first.dtype} "
                         f"{tuple(shape)}, got {first_out.dtype} {tuple(first_out.shape)}")
    out = torch.empty((tokens, h), dtype=first.dtype, device=first.device)
    z, r, alpha = (torch.empty((tokens, total), dtype=torch.float32, device=first.device)
                   for _ in range(3))
    if tokens:
        with launch_device(first.device):
            _forward_kernel[(triton.cdiv(tokens, _FORWARD_LAUNCH["BLOCK_T"]),)](
                query, out, z, r, alpha, first if plus is None else plus,
                0 if plus is None else _stride(plus, 0), out if first_out is None else first_out,
                *_group_arguments(views), tokens, total, h, float(eps), NG=len(views),
                KP=padded_sources(total), PLUS=plus is not None, COPY=first_out is not None,
                BLOCK_H=BLOCK_H, **_FORWARD_LAUNCH)
    return (out.view(*lead, h), z.view(*lead, total), r.view(*lead, total),
            alpha.view(*lead, total))


def backward(query: torch.Tensor, groups: Sequence[torch.Tensor], grad: torch.Tensor,
             z: torch.Tensor, r: torch.Tensor, alpha: torch.Tensor, eps: float,
             last_plus: torch.Tensor | None = None, first_grad: torch.Tensor | None = None):
    """efficient._DepthAttention's backward given ``grad`` at the output and the forward's z, r,
    alpha: ``(dquery in the query's dtype, [dv of each group in its dtype and shape], the first
    group's last gradient where last_plus is given, else None)``. With ``first_grad`` (the first
    group's shape), the first group's gradient is its dv plus first_grad; the gradient of
    ``last_plus`` is then the last source's dv plus first_grad's last slot too (first_grad is the
    gradient of the first group as read, last_plus included: what ``first_out`` passes on).
    (``eps`` is not needed: r is the forward's.)"""
    del eps
    query, views, plus, total = _prepare(query, groups, last_plus)
    first, shape = views[0], groups[0].shape
    tokens, h = first.shape[0], shape[-1]
    lead = shape[:-2]
    if tuple(grad.shape) != (*lead, h):
        raise ValueError(f"triton depth: grad must have shape {(*lead, h)}, got {tuple(grad.shape)}")
    if first_grad is not None and first_grad.shape != shape:
        raise ValueError(f"triton depth: first_grad must have shape {tuple(shape)}, got "
                         f"{tuple(first_grad.shape)}")
    for name, tensor in (("z", z), ("r", r), ("alpha", alpha)):
        if tuple(tensor.shape) != (*lead, total) or tensor.dtype != torch.float32:
            raise ValueError(f"triton depth: {name} must be fp32 {(*lead, total)}")
    grad = _tokens_view(grad, h)
    z, r, alpha = (x.reshape(tokens, total).contiguous() for x in (z, r, alpha))
    grads = [torch.empty((tokens, v.shape[1], h), dtype=v.dtype, device=v.device) for v in views]
    dplus = None if plus is None else torch.empty((tokens, h), dtype=plus.dtype,
                                                  device=plus.device)
    acc = None if first_grad is None else _tokens_view(first_grad, shape[-2], h)
    blocks = triton.cdiv(tokens, _BACKWARD_LAUNCH["BLOCK_T"])
    partial = torch.empty((blocks, h), dtype=torch.float32, device=first.device)
    if tokens:
        with launch_device(first.device):
            _backward_kernel[(blocks,)](
                query, grad, _stride(grad, 0), z, r, alpha, partial,
                first if plus is None else plus, 0 if plus is None else _stride(plus, 0),
                first if dplus is None else dplus, first if acc is None else acc,
                0 if acc is None else _stride(acc, 0), 0 if acc is None else _stride(acc, 1),
                *_group_arguments(views, grads), tokens, total, h, NG=len(views),
                KP=padded_sources(total), PLUS=plus is not None, ACC=acc is not None,
                BLOCK_H=BLOCK_H, **_BACKWARD_LAUNCH)
    dquery = partial.sum(0).to(query.dtype)
    return (dquery, [d.view(g.shape) for d, g in zip(grads, groups)],
            None if dplus is None else dplus.view(*lead, h))


_ADD_LAUNCH = dict(BLOCK_T=16, BLOCK_H=256, num_warps=4)


def add_into_last_slot(slots: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
    """``slots [..., S, h]``'s last slot plus ``addend [..., h]``, in place (the sum rounded to
    the dtype, as PyTorch's in-place addition): block AttnRes's exit, the partial sum plus the
    FFN's output. Returns ``slots``."""
    registry.require("add_into_last_slot", "triton", slots, addend)
    h = slots.shape[-1]
    tokens = slots.numel() // (slots.shape[-2] * h) if slots.numel() else 0
    if tokens:
        grid = (triton.cdiv(tokens, _ADD_LAUNCH["BLOCK_T"]), triton.cdiv(h, _ADD_LAUNCH["BLOCK_H"]))
        with launch_device(slots.device):
            _add_into_last_kernel[grid](slots, addend.reshape(-1, h).contiguous(), tokens,
                                        slots.shape[-2] * h, h, **_ADD_LAUNCH)
    return slots
