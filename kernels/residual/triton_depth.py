"""Depth attention of Attention Residuals in Triton, forward and backward, in one launch each
for all the source groups of a call.

Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031): a sublayer's
input is a softmax over depth, ``h = sum_k alpha_k v_k``, ``alpha = softmax_k(z)``, ``z_k = r_k
(v_k . q)``, ``r_k = rsqrt(mean(v_k^2) + eps)``, over K sources ``v_k [T, h]`` and a pseudo-query
``q [h]`` (definition in :mod:`.reference`). The sources come in up to ``MAX_GROUPS`` = 4 groups
``[..., k_i, h]`` (views into the packed state between layers, and the layer's own outputs);
each group is read in place through its own pointer, token stride and slot stride, so a view
needs no copy, and the group sizes are kernel arguments. A group may also be given as
``(tensor [..., S, h], k)``: its first k slots are the sources, and its gradient is returned for
the whole tensor, zeros in slots k..S-1 written by the kernel (what autograd's backward of the
slice ``tensor[..., :k, :]`` would otherwise materialise: a zero tensor, a copy and an add).

The kernels compute exactly efficient._DepthAttention's PyTorch path (to fp32 rounding), one
program per block of ``BLOCK_T`` tokens, the sources read in their own dtype, h in chunks of
``BLOCK_H`` columns:

    forward    pass 1 over the sources: r_k and z_k (fp32, per source); the softmax over the K
               sources of a token in registers ([BLOCK_T, KP] tiles); z, r, alpha written
               ([T, K] fp32, kept for backward); pass 2 over the sources: out = sum_k alpha_k
               v_k, accumulated in fp32 and written in the sources' dtype.
               Reads every source twice, writes out.
    backward   pass 1 over the sources and g: dalpha_k = <g, v_k>; dz = alpha (dalpha - sum_k
               alpha_k dalpha_k) in registers; pass 2 over the sources and g: dv_k = alpha_k g +
               dz_k r_k q - (dz_k z_k r_k / h) v_k written into one gradient tensor per group
               (in the group's dtype), and the per-block partial sums over tokens of
               dq = sum_k dz_k r_k v_k ([cdiv(T, BLOCK_T), h] fp32) reduced outside by one
               torch sum. Reads every source twice and g K + 1 times (g's block is reused from
               cache), writes every dv_k.

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
masked: z = -inf in the softmax, loads 0, stores skipped); a source's column is picked out of a
tile with a masked sum (an exact selection), once per source in the passes that loop over
sources outermost (forward pass 1, backward pass 1) and once per source and chunk in those that
loop over columns outermost (forward and backward pass 2, which accumulate over the sources).
Launch configuration (fixed, not tuned on a GPU): BLOCK_T = 16, BLOCK_H = 128, 4 warps; one
compiled kernel per (number of groups, KP, dtypes); T, the group sizes and strides are not
specialised on.

Constraints: 1 <= number of groups <= 4, 1 <= K <= 64 sources in all, h a multiple of 16, the
groups in one dtype among fp32, bf16 and fp16 with the same leading (token) dimensions, the
query ``[h]``; a group whose leading dimensions cannot be viewed as one token dimension, or
whose columns are strided, is copied. Anything else raises a ValueError naming the constraint
(:func:`unsupported_reason`); efficient.py then runs the PyTorch path. CUDA tensors, or CPU
tensors under Triton's interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .triton_common import block_tokens, divide, launch_device

__all__ = ["forward", "backward", "unsupported_reason", "MAX_GROUPS", "MAX_SOURCES",
           "H_MULTIPLE", "padded_sources"]

MAX_GROUPS = 4
MAX_SOURCES = 64
H_MULTIPLE = 16
BLOCK_T = 16
BLOCK_H = 128
_LAUNCH = dict(num_warps=4)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_RUNTIME = ["T", "K"] + [f"{name}{i}" for i in range(MAX_GROUPS) for name in ("t", "s", "k", "n")]


# ---------------------------------------------------------------------------------------------
# Helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _column(tile, ks, index):
    """Column ``index`` of a [BLOCK_T, KP] tile as [BLOCK_T] (an exact selection)."""
    return tl.sum(tl.where(ks[None, :] == index, tile, 0.0), 1)


@triton.jit
def _group_logits(v_ptr, t_stride, s_stride, count, offset, q_ptr, tok, live, ks, z, r, H, eps,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """z and r ([BLOCK_T, KP]) with the columns offset .. offset + count - 1 of one group set."""
    hs = tl.arange(0, BLOCK_H)
    rows = v_ptr + tok[:, None] * t_stride
    for k in range(0, count):
        sumsq = tl.zeros([BLOCK_T], dtype=tl.float32)
        dot = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c0 in range(0, H, BLOCK_H):
            c = c0 + hs
            in_h = c < H
            v = tl.load(rows + k * s_stride + c[None, :], mask=live[:, None] & in_h[None, :],
                        other=0.0).to(tl.float32)
            q = tl.load(q_ptr + c, mask=in_h, other=0.0).to(tl.float32)
            sumsq += tl.sum(v * v, 1)
            dot += tl.sum(v * q[None, :], 1)
        rk = tl.math.rsqrt(divide(sumsq, H.to(tl.float32)) + eps)
        pick = ks[None, :] == offset + k
        z = tl.where(pick, (dot * rk)[:, None], z)
        r = tl.where(pick, rk[:, None], r)
    return z, r


@triton.jit
def _group_sum(v_ptr, t_stride, s_stride, count, offset, alpha, acc, tok, live, ks, c, in_h):
    """acc + sum_k alpha_k v_k over one group, on the columns c."""
    rows = v_ptr + tok[:, None] * t_stride
    for k in range(0, count):
        v = tl.load(rows + k * s_stride + c[None, :], mask=live[:, None] & in_h[None, :],
                    other=0.0).to(tl.float32)
        acc += _column(alpha, ks, offset + k)[:, None] * v
    return acc


@triton.jit
def _group_dalpha(v_ptr, t_stride, s_stride, count, offset, g_ptr, tok, live, ks, dalpha, H,
                  BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """dalpha ([BLOCK_T, KP]) with <g, v_k> set in one group's columns."""
    hs = tl.arange(0, BLOCK_H)
    rows = v_ptr + tok[:, None] * t_stride
    for k in range(0, count):
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for c0 in range(0, H, BLOCK_H):
            c = c0 + hs
            live_h = live[:, None] & (c < H)[None, :]
            v = tl.load(rows + k * s_stride + c[None, :], mask=live_h, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + tok[:, None] * H + c[None, :], mask=live_h,
                        other=0.0).to(tl.float32)
            acc += tl.sum(v * g, 1)
        dalpha = tl.where(ks[None, :] == offset + k, acc[:, None], dalpha)
    return dalpha


@triton.jit
def _group_vjp(v_ptr, t_stride, s_stride, count, slots, d_ptr, offset, g, q, alpha, along, coef,
               dq, tok, live, ks, c, in_h, H):
    """dv_k of one group on the columns c, written (zeros in its slots count .. slots - 1), and
    dq + sum_k along_k v_k."""
    rows = v_ptr + tok[:, None] * t_stride
    d_rows = d_ptr + tok[:, None] * slots * H
    live_h = live[:, None] & in_h[None, :]
    for k in range(0, count):
        v = tl.load(rows + k * s_stride + c[None, :], mask=live_h, other=0.0).to(tl.float32)
        along_k = _column(along, ks, offset + k)[:, None]
        dv = (_column(alpha, ks, offset + k)[:, None] * g + along_k * q[None, :]
              - _column(coef, ks, offset + k)[:, None] * v)
        tl.store(d_rows + k * H + c[None, :], dv.to(d_ptr.dtype.element_ty), mask=live_h)
        dq += along_k * v
    for k in range(count, slots):
        tl.store(d_rows + k * H + c[None, :], tl.zeros_like(g).to(d_ptr.dtype.element_ty),
                 mask=live_h)
    return dq


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_RUNTIME)
def _forward_kernel(q_ptr, out_ptr, z_ptr, r_ptr, alpha_ptr,
                    v0, t0, s0, k0, n0, v1, t1, s1, k1, n1, v2, t2, s2, k2, n2,
                    v3, t3, s3, k3, n3, T, K, H, eps, NG: tl.constexpr, KP: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """out, z, r, alpha of BLOCK_T tokens over the NG groups (vi [T, ki, H] at token stride ti,
    slot stride si; ni, the slots of a group's gradient, unused here)."""
    tok, live = block_tokens(T, BLOCK_T)
    ks = tl.arange(0, KP)
    in_k = ks < K

    # Pass 1: r_k and z_k of every source.
    z = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    r = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    z, r = _group_logits(v0, t0, s0, k0, 0, q_ptr, tok, live, ks, z, r, H, eps, BLOCK_T, BLOCK_H)
    if NG > 1:
        z, r = _group_logits(v1, t1, s1, k1, k0, q_ptr, tok, live, ks, z, r, H, eps, BLOCK_T,
                             BLOCK_H)
    if NG > 2:
        z, r = _group_logits(v2, t2, s2, k2, k0 + k1, q_ptr, tok, live, ks, z, r, H, eps,
                             BLOCK_T, BLOCK_H)
    if NG > 3:
        z, r = _group_logits(v3, t3, s3, k3, k0 + k1 + k2, q_ptr, tok, live, ks, z, r, H, eps,
                             BLOCK_T, BLOCK_H)

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
        acc = _group_sum(v0, t0, s0, k0, 0, alpha, acc, tok, live, ks, c, in_h)
        if NG > 1:
            acc = _group_sum(v1, t1, s1, k1, k0, alpha, acc, tok, live, ks, c, in_h)
        if NG > 2:
            acc = _group_sum(v2, t2, s2, k2, k0 + k1, alpha, acc, tok, live, ks, c, in_h)
        if NG > 3:
            acc = _group_sum(v3, t3, s3, k3, k0 + k1 + k2, alpha, acc, tok, live, ks, c, in_h)
        tl.store(out_ptr + tok[:, None] * H + c[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=live[:, None] & in_h[None, :])


@triton.jit(do_not_specialize=_RUNTIME)
def _backward_kernel(q_ptr, g_ptr, z_ptr, r_ptr, alpha_ptr, dq_ptr,
                     v0, t0, s0, k0, n0, d0, v1, t1, s1, k1, n1, d1, v2, t2, s2, k2, n2, d2,
                     v3, t3, s3, k3, n3, d3, T, K, H, NG: tl.constexpr, KP: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """dv of every source of BLOCK_T tokens into di [T, ni, H] (contiguous), and this block's
    partial sum of dq (dq_ptr [cdiv(T, BLOCK_T), H]), given g = dout [T, H]."""
    tok, live = block_tokens(T, BLOCK_T)
    ks = tl.arange(0, KP)
    live_k = live[:, None] & (ks < K)[None, :]
    at = tok[:, None] * K + ks[None, :]
    z = tl.load(z_ptr + at, mask=live_k, other=0.0)
    r = tl.load(r_ptr + at, mask=live_k, other=0.0)
    alpha = tl.load(alpha_ptr + at, mask=live_k, other=0.0)

    # Pass 1: dalpha_k = <g, v_k>, then dz.
    dalpha = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
    dalpha = _group_dalpha(v0, t0, s0, k0, 0, g_ptr, tok, live, ks, dalpha, H, BLOCK_T, BLOCK_H)
    if NG > 1:
        dalpha = _group_dalpha(v1, t1, s1, k1, k0, g_ptr, tok, live, ks, dalpha, H, BLOCK_T,
                               BLOCK_H)
    if NG > 2:
        dalpha = _group_dalpha(v2, t2, s2, k2, k0 + k1, g_ptr, tok, live, ks, dalpha, H,
                               BLOCK_T, BLOCK_H)
    if NG > 3:
        dalpha = _group_dalpha(v3, t3, s3, k3, k0 + k1 + k2, g_ptr, tok, live, ks, dalpha, H,
                               BLOCK_T, BLOCK_H)
    dz = alpha * (dalpha - tl.sum(alpha * dalpha, 1)[:, None])
    along = dz * r
    coef = divide(along * z * r, H.to(tl.float32))

    # Pass 2: dv_k and dq.
    hs = tl.arange(0, BLOCK_H)
    for c0 in range(0, H, BLOCK_H):
        c = c0 + hs
        in_h = c < H
        g = tl.load(g_ptr + tok[:, None] * H + c[None, :], mask=live[:, None] & in_h[None, :],
                    other=0.0).to(tl.float32)
        q = tl.load(q_ptr + c, mask=in_h, other=0.0).to(tl.float32)
        dq = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
        dq = _group_vjp(v0, t0, s0, k0, n0, d0, 0, g, q, alpha, along, coef, dq, tok, live, ks,
                        c, in_h, H)
        if NG > 1:
            dq = _group_vjp(v1, t1, s1, k1, n1, d1, k0, g, q, alpha, along, coef, dq, tok, live,
                            ks, c, in_h, H)
        if NG > 2:
            dq = _group_vjp(v2, t2, s2, k2, n2, d2, k0 + k1, g, q, alpha, along, coef, dq, tok,
                            live, ks, c, in_h, H)
        if NG > 3:
            dq = _group_vjp(v3, t3, s3, k3, n3, d3, k0 + k1 + k2, g, q, alpha, along, coef, dq,
                            tok, live, ks, c, in_h, H)
        tl.store(dq_ptr + tl.program_id(0) * H + c, tl.sum(dq, 0), mask=in_h)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _as_pair(group):
    """``(tensor [..., S, h], k)`` for a group given as a tensor (k = S) or as such a pair."""
    if isinstance(group, torch.Tensor):
        return group, (group.shape[-2] if group.dim() >= 2 else 0)
    tensor, count = group
    return tensor, count


def padded_sources(count: int) -> int:
    """KP: the number of sources K rounded up to a power of two (what the kernels compile for)."""
    return triton.next_power_of_2(max(1, count))


def unsupported_reason(query: torch.Tensor, groups: Sequence) -> str | None:
    """Why the kernels cannot run ``groups`` (tensors ``[..., k_i, h]`` or ``(tensor [..., S_i,
    h], k_i)`` pairs) with ``query [h]``, or None if they can."""
    if not 1 <= len(groups) <= MAX_GROUPS:
        return f"triton depth: needs 1 to {MAX_GROUPS} source groups, got {len(groups)}"
    pairs = [_as_pair(group) for group in groups]
    first = pairs[0][0]
    if first.dim() < 2:
        return f"triton depth: needs source groups [..., k, h], got shape {tuple(first.shape)}"
    lead, h = first.shape[:-2], first.shape[-1]
    if h == 0 or h % H_MULTIPLE:
        return f"triton depth: needs a hidden size h that is a multiple of {H_MULTIPLE}, got h = {h}"
    if tuple(query.shape) != (h,):
        return f"triton depth: needs a query [h] = [{h}], got shape {tuple(query.shape)}"
    for tensor, count in pairs:
        if tensor.dim() < 2 or tensor.shape[:-2] != lead or tensor.shape[-1] != h:
            return (f"triton depth: needs source groups of one shape [..., k, h] = "
                    f"{(*lead, 'k', h)} (no broadcasting), got {tuple(tensor.shape)}")
        if tensor.dtype != first.dtype:
            return f"triton depth: needs the groups in one dtype, got {first.dtype} and {tensor.dtype}"
        if not 0 <= count <= tensor.shape[-2]:
            return f"triton depth: a group of {tensor.shape[-2]} slots cannot give {count} sources"
    if first.dtype not in _DTYPES:
        return f"triton depth: needs fp32, bf16 or fp16 sources, got {first.dtype}"
    total = sum(count for _, count in pairs)
    if not 1 <= total <= MAX_SOURCES:
        return f"triton depth: needs 1 to {MAX_SOURCES} sources in all, got {total}"
    return None


def _tokens_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor [..., S, h]`` as ``[T, S, h]`` with unit column stride: a view where the leading
    dimensions merge into one, a copy otherwise."""
    slots, h = tensor.shape[-2:]
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    try:
        return tensor.view(-1, slots, h)
    except RuntimeError:
        return tensor.reshape(-1, slots, h)


def _prepare(query, groups):
    reason = unsupported_reason(query, groups)
    if reason is not None:
        raise ValueError(reason)
    pairs = [(_tokens_view(tensor), count, tensor.shape) for tensor, count in map(_as_pair, groups)]
    return query.contiguous(), pairs, sum(count for _, count, _ in pairs)


def _group_arguments(pairs, grads=None):
    """The kernels' per-group arguments, padded to MAX_GROUPS with empty groups."""
    arguments = []
    for i in range(MAX_GROUPS):
        v, count, _ = pairs[min(i, len(pairs) - 1)]
        count = count if i < len(pairs) else 0
        arguments += [v, v.stride(0), v.stride(1), count, v.shape[1]]
        if grads is not None:
            arguments.append(grads[min(i, len(pairs) - 1)])
    return arguments


def forward(query: torch.Tensor, groups: Sequence, eps: float):
    """efficient._DepthAttention's forward: ``(out [..., h] in the groups' dtype, z, r, alpha
    [..., K] fp32)``."""
    query, pairs, total = _prepare(query, groups)
    first, _, shape = pairs[0]
    tokens, h = first.shape[0], shape[-1]
    lead = shape[:-2]
    out = torch.empty((tokens, h), dtype=first.dtype, device=first.device)
    z, r, alpha = (torch.empty((tokens, total), dtype=torch.float32, device=first.device)
                   for _ in range(3))
    if tokens:
        with launch_device(first.device):
            _forward_kernel[(triton.cdiv(tokens, BLOCK_T),)](
                query, out, z, r, alpha, *_group_arguments(pairs), tokens, total, h, float(eps),
                NG=len(pairs), KP=padded_sources(total), BLOCK_T=BLOCK_T, BLOCK_H=BLOCK_H,
                **_LAUNCH)
    return (out.view(*lead, h), z.view(*lead, total), r.view(*lead, total),
            alpha.view(*lead, total))


def backward(query: torch.Tensor, groups: Sequence, grad: torch.Tensor, z: torch.Tensor,
             r: torch.Tensor, alpha: torch.Tensor, eps: float):
    """efficient._DepthAttention's backward given ``grad`` at the output and the forward's z, r,
    alpha: ``(dquery in the query's dtype, [dv of each group in its dtype and shape, for a
    (tensor, k) pair of the whole tensor with zeros in its slots k..]``. (``eps`` is not needed:
    r is the forward's.)"""
    del eps
    query, pairs, total = _prepare(query, groups)
    first, _, shape = pairs[0]
    tokens, h = first.shape[0], shape[-1]
    lead = shape[:-2]
    if tuple(grad.shape) != (*lead, h):
        raise ValueError(f"triton depth: grad must have shape {(*lead, h)}, got {tuple(grad.shape)}")
    for name, tensor in (("z", z), ("r", r), ("alpha", alpha)):
        if tuple(tensor.shape) != (*lead, total) or tensor.dtype != torch.float32:
            raise ValueError(f"triton depth: {name} must be fp32 {(*lead, total)}")
    grad = grad.reshape(tokens, h).contiguous()
    z, r, alpha = (x.reshape(tokens, total).contiguous() for x in (z, r, alpha))
    grads = [torch.empty((tokens, v.shape[1], h), dtype=v.dtype, device=v.device)
             for v, _, _ in pairs]
    blocks = triton.cdiv(tokens, BLOCK_T)
    partial = torch.empty((blocks, h), dtype=torch.float32, device=first.device)
    if tokens:
        with launch_device(first.device):
            _backward_kernel[(blocks,)](
                query, grad, z, r, alpha, partial, *_group_arguments(pairs, grads), tokens,
                total, h, NG=len(pairs), KP=padded_sources(total), BLOCK_T=BLOCK_T,
                BLOCK_H=BLOCK_H, **_LAUNCH)
    dquery = partial.sum(0).to(query.dtype)
    return dquery, [d.view(s) for d, (_, _, s) in zip(grads, pairs)]
