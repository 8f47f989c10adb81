"""Triton kernels of the layer pieces in ``reference.py``: one kernel per pass, fp32 inside,
inputs and outputs in their own dtype and strides, so that Megatron's ``[s, b, C]`` tensors are
read and written in place (the layout change to the ops' ``[B, T, ...]`` happens in the loads and
stores, not in a copy).

Short convolution (``short_conv_forward`` / ``short_conv_backward``): a program takes ``BT``
tokens x ``BC`` channels of one batch row; with the L2 normalisation ``BC`` is one head
(``l2_norm_dim``, a power of two), so that the norm is a row sum of the tile. The backward runs
two kernels: the first recomputes the pre-activation (none is saved forward) and writes its
gradient g in x's dtype; the second reads g at each tap's shift, ``dx[t] = sum_i g[t + i]
w[K-1-i]``, as the forward reads x, and from the same pairs the weight gradient ``dw[c, K-1-i]
= sum_t g[t + i] x[t]``: a program walks ``CONV_BWD_TILES`` tiles, accumulates the products per
tap (``CONV_MAX_TAPS`` accumulators, the widths Dao's causal-conv1d takes too), row and channel,
and sums over the rows once at the end into ``[programs, C, K]`` partials (no atomics).

Gates (``gate_forward`` / ``gate_backward``): the fp32 sigmoid of a projection's slice, or the
Mamba-2 / GDN log-decay ``-exp(A_log) softplus(x + dt_bias)``, read in place; the backward's
programs each walk ``GATE_BWD_TILES`` token tiles and sum their share of the gradients of
``A_log`` and ``dt_bias`` as the short convolution's dw.

Gated RMSNorm (``gated_rms_norm_forward`` / ``_backward``): a program takes ``BT`` tokens of one
head (D channels), the gate after the norm or, ``GATE_FIRST`` (Mamba-2's), before it; the weight
gradient is summed per program as above.

RMSNorm (``rms_norm_forward`` / ``_backward``): a program normalises ``RMS_ROWS`` rows at a
time; the backward's programs each stride over many rows and sum their share of the weight
gradient, so that only ``[programs, N]`` partials are summed after it.

Cross-entropy (``cross_entropy_stats`` / ``cross_entropy_grad``): a program takes one row of
logits and walks its columns ``CE_BLOCK`` at a time, keeping a running max and sum of
exponentials per lane (rescaled when the max grows), so the logits are read once forward and
once backward, in their own dtype; nothing of size ``[N, V]`` is kept between them.

RoPE (``rope_forward``): a program takes a few consecutive tokens (``ROPE_TOKENS`` at most, about
``ROPE_TILE`` elements of each half of the head dim) with all their heads; cos and sin of the
tokens' angles are computed in the kernel. RoPE is a rotation of each channel pair ``(j, j +
D/2)``, so its gradient is the rotation by the opposite angles: the same kernel with ``INVERSE``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import L2_EPS

TOKENS_PER_PROGRAM = 32
CONV_CHANNELS = 128  # channels a short-conv program takes without the L2 norm (else one head)
CONV_BWD_CHANNELS = 64  # channels an input-gradient program takes (its K accumulators)
CONV_BWD_TILES = 8  # token tiles it walks, summing their share of dw
CONV_MAX_TAPS = 4  # filter widths the kernels take (one dw accumulator per tap), as causal-conv1d
GATE_CHANNELS = 256  # channels a gate program takes
GATE_BWD_TILES = 8  # token tiles a gate backward program walks, summing the parameters' share
ROPE_TILE = 4096  # elements of each half of the head dim a RoPE program takes (about)
ROPE_TOKENS = 64  # tokens a RoPE program takes, at most


@triton.jit
def _conv_preactivation(x_ptr, w_ptr, pos_ptr, b, rows, row_ok, cols, col_ok, sxb, sxt, sxc,
                        K: tl.constexpr, HAS_POS: tl.constexpr):
    """``sum_j w[c, K-1-j] x[b, row-j, c]`` over taps inside the row's sequence, fp32."""
    if HAS_POS:
        pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    else:
        pos = rows
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.float32)
    for j in tl.static_range(K):
        ok = row_ok & (pos >= j)
        xj = tl.load(x_ptr + b * sxb + (rows - j)[:, None] * sxt + cols[None, :] * sxc,
                     mask=ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + cols * K + (K - 1 - j), mask=col_ok, other=0.0).to(tl.float32)
        acc += xj * wj[None, :]
    return acc


@triton.jit
def _conv_tile(T, C, BT: tl.constexpr, BC: tl.constexpr):
    """This program's tile: batch row b, token rows and channels cols, with their masks."""
    b = tl.program_id(1)
    rows = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    return b, rows, cols, rows < T, cols < C


@triton.jit
def _short_conv_fwd_kernel(x_ptr, w_ptr, pos_ptr, y_ptr, T, C, sxb, sxt, sxc,
                           K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                           HAS_POS: tl.constexpr, L2: tl.constexpr, EPS: tl.constexpr):
    b, rows, cols, row_ok, col_ok = _conv_tile(T, C, BT, BC)
    acc = _conv_preactivation(x_ptr, w_ptr, pos_ptr, b, rows, row_ok, cols, col_ok,
                              sxb, sxt, sxc, K, HAS_POS)
    y = acc * tl.sigmoid(acc)
    if L2:
        y = y / tl.maximum(tl.sqrt(tl.sum(y * y, axis=1)), EPS)[:, None]
    tl.store(y_ptr + (b * T + rows[:, None]) * C + cols[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _conv_preactivation_grad(x_ptr, w_ptr, pos_ptr, dy_ptr, b, rows, cols, col_ok, T, C,
                             sxb, sxt, sxc, K: tl.constexpr, HAS_POS: tl.constexpr,
                             L2: tl.constexpr, EPS: tl.constexpr):
    """The gradient of the pre-activation at token ``rows`` (zero past T), fp32, and the
    pre-activation's inputs recomputed on the way (no activation is saved forward)."""
    row_ok = rows < T
    acc = _conv_preactivation(x_ptr, w_ptr, pos_ptr, b, rows, row_ok, cols, col_ok,
                              sxb, sxt, sxc, K, HAS_POS)
    sig = tl.sigmoid(acc)
    dy = tl.load(dy_ptr + (b * T + rows[:, None]) * C + cols[None, :],
                 mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    if L2:
        u = acc * sig
        norm = tl.maximum(tl.sqrt(tl.sum(u * u, axis=1)), EPS)
        y = u / norm[:, None]
        dy = (dy - y * tl.sum(dy * y, axis=1)[:, None]) / norm[:, None]
    return dy * sig * (1.0 + acc * (1.0 - sig))


@triton.jit
def _short_conv_bwd_preact_kernel(x_ptr, w_ptr, pos_ptr, dy_ptr, g_ptr, T, C, sxb, sxt, sxc,
                                  K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                                  HAS_POS: tl.constexpr, L2: tl.constexpr, EPS: tl.constexpr):
    """The pre-activation's gradient g ``[B, T, C]`` (fp32 inside, stored in g's dtype)."""
    b, rows, cols, row_ok, col_ok = _conv_tile(T, C, BT, BC)
    g = _conv_preactivation_grad(x_ptr, w_ptr, pos_ptr, dy_ptr, b, rows, cols, col_ok, T, C,
                                 sxb, sxt, sxc, K, HAS_POS, L2, EPS)
    tl.store(g_ptr + (b * T + rows[:, None]) * C + cols[None, :], g.to(g_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _tap_sum(dw_ptr, program, cols, col_ok, acc, C, K: tl.constexpr, tap: tl.constexpr):
    """Store the row sum of ``acc`` as this program's partial of ``dw[:, tap]``."""
    tl.store(dw_ptr + (program * C + cols) * K + tap, tl.sum(acc, axis=0), mask=col_ok)


@triton.jit
def _short_conv_bwd_input_kernel(g_ptr, x_ptr, w_ptr, pos_ptr, dx_ptr, dw_ptr, T, C,
                                 sxb, sxt, sxc, sdb, sdt, sdc, K: tl.constexpr,
                                 BT: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr,
                                 HAS_POS: tl.constexpr):
    """``dx[t] = sum_i g[t + i] w[K-1-i]`` over the tokens t + i of t's sequence, for ``TILES``
    token tiles, and their share of the weight gradient ``dw[c, K-1-i] = sum_t g[t + i] x[t]``
    (same pairs) in ``[programs, C, K]`` partials: one accumulator of products per tap (K <=
    CONV_MAX_TAPS), summed over its rows once at the end."""
    b = tl.program_id(1)
    cols = tl.program_id(2) * BC + tl.arange(0, BC)
    col_ok = cols < C
    acc0 = tl.zeros([BT, BC], dtype=tl.float32)
    acc1 = tl.zeros([BT, BC], dtype=tl.float32)
    acc2 = tl.zeros([BT, BC], dtype=tl.float32)
    acc3 = tl.zeros([BT, BC], dtype=tl.float32)
    for tile in range(TILES):
        rows = (tl.program_id(0) * TILES + tile) * BT + tl.arange(0, BT)
        row_ok = rows < T
        x = tl.load(x_ptr + b * sxb + rows[:, None] * sxt + cols[None, :] * sxc,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        dx = tl.zeros([BT, BC], dtype=tl.float32)
        for i in tl.static_range(K):
            later = rows + i
            if HAS_POS:
                later_pos = tl.load(pos_ptr + later, mask=later < T, other=0)
            else:
                later_pos = later
            same = (later < T) & (later_pos >= i)
            gi = tl.load(g_ptr + (b * T + later[:, None]) * C + cols[None, :],
                         mask=same[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            wi = tl.load(w_ptr + cols * K + (K - 1 - i), mask=col_ok, other=0.0).to(tl.float32)
            dx += gi * wi[None, :]
            if i == 0:
                acc0 += gi * x
            elif i == 1:
                acc1 += gi * x
            elif i == 2:
                acc2 += gi * x
            else:
                acc3 += gi * x
        tl.store(dx_ptr + b * sdb + rows[:, None] * sdt + cols[None, :] * sdc,
                 dx.to(dx_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
    program = b * tl.num_programs(0) + tl.program_id(0)
    _tap_sum(dw_ptr, program, cols, col_ok, acc0, C, K, K - 1)
    if K > 1:
        _tap_sum(dw_ptr, program, cols, col_ok, acc1, C, K, K - 2)
    if K > 2:
        _tap_sum(dw_ptr, program, cols, col_ok, acc2, C, K, K - 3)
    if K > 3:
        _tap_sum(dw_ptr, program, cols, col_ok, acc3, C, K, K - 4)


def empty_in_order_of(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s shape, dense, with its first two dims in ``t``'s memory order:
    the gradient of a view of Megatron's ``[s, b, C]`` (a transposed view, or a slice of a fused
    projection's output) comes back sequence-first, as the projection's backward wants it."""
    if t.dim() >= 2 and t.stride(0) < t.stride(1):
        return torch.empty(t.shape[1], t.shape[0], *t.shape[2:], device=t.device,
                           dtype=t.dtype).transpose(0, 1)
    return torch.empty(t.shape, device=t.device, dtype=t.dtype)


def _checked_out(out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A given output tensor for the gradient of ``like``: its shape, dtype and device."""
    if (out.shape, out.dtype, out.device) != (like.shape, like.dtype, like.device):
        raise ValueError(f"the gradient's output {tuple(out.shape)} {out.dtype} {out.device} "
                         f"does not match its input {tuple(like.shape)} {like.dtype} "
                         f"{like.device}")
    return out


def _channel_block(channels: int, l2_norm_dim: int | None) -> int:
    if l2_norm_dim is not None:
        if l2_norm_dim & (l2_norm_dim - 1) or channels % l2_norm_dim:
            raise ValueError(f"short_conv: the L2-normalised group ({l2_norm_dim} channels) must "
                             f"be a power of two dividing the {channels} channels")
        return l2_norm_dim
    return min(CONV_CHANNELS, triton.next_power_of_2(channels))


def short_conv_forward(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None,
                       l2_norm_dim: int | None) -> torch.Tensor:
    """``x [B, T, C]`` (any strides) -> ``y [B, T, C]`` contiguous, ``x.dtype``; ``weight [C,
    K]`` with K <= ``CONV_MAX_TAPS``."""
    if weight.shape[1] > CONV_MAX_TAPS:
        raise ValueError(f"short_conv: the Triton kernels take filters of at most {CONV_MAX_TAPS} "
                         f"taps, not {weight.shape[1]}; use backend='reference'")
    batch, length, channels = x.shape
    block = _channel_block(channels, l2_norm_dim)
    y = torch.empty(batch, length, channels, device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(length, TOKENS_PER_PROGRAM), batch, triton.cdiv(channels, block))
    _short_conv_fwd_kernel[grid](
        x, weight, positions if positions is not None else x, y, length, channels, *x.stride(),
        K=weight.shape[1], BT=TOKENS_PER_PROGRAM, BC=block, HAS_POS=positions is not None,
        L2=l2_norm_dim is not None, EPS=L2_EPS)
    return y


def short_conv_backward(x, weight, positions, l2_norm_dim, dy, dx=None):
    """Gradients of :func:`short_conv_forward`: ``dx`` (written into ``dx`` where given, else a
    new tensor in ``x``'s strides) in ``x``'s dtype, ``dw`` ``[C, K]`` in ``weight``'s dtype."""
    batch, length, channels = x.shape
    kernel = weight.shape[1]
    dy = dy.contiguous()
    dx = empty_in_order_of(x) if dx is None else _checked_out(dx, x)
    pos = positions if positions is not None else x
    block = _channel_block(channels, l2_norm_dim)
    g = torch.empty(batch, length, channels, device=x.device, dtype=x.dtype)
    _short_conv_bwd_preact_kernel[(triton.cdiv(length, TOKENS_PER_PROGRAM), batch,
                                   triton.cdiv(channels, block))](
        x, weight, pos, dy, g, length, channels, *x.stride(), K=kernel, BT=TOKENS_PER_PROGRAM,
        BC=block, HAS_POS=positions is not None, L2=l2_norm_dim is not None, EPS=L2_EPS)
    input_block = min(CONV_BWD_CHANNELS, triton.next_power_of_2(channels))
    tiles = triton.cdiv(length, TOKENS_PER_PROGRAM)
    grid = (triton.cdiv(tiles, CONV_BWD_TILES), batch, triton.cdiv(channels, input_block))
    dw = torch.empty(grid[0] * batch, channels, kernel, device=x.device, dtype=torch.float32)
    _short_conv_bwd_input_kernel[grid](
        g, x, weight, pos, dx, dw, length, channels, *x.stride(), *dx.stride(), K=kernel,
        BT=TOKENS_PER_PROGRAM, BC=input_block, TILES=CONV_BWD_TILES,
        HAS_POS=positions is not None)
    return dx, dw.sum(0).to(weight.dtype)


@triton.jit
def _at(b, rows, h, cols, sb, st, sh):
    """Offsets of a [rows, D] tile of head h of batch row b in a [B, T, H, D] tensor."""
    return b * sb + rows[:, None] * st + h * sh + cols[None, :]


@triton.jit
def _gated_norm_inputs(o_ptr, g_ptr, w_ptr, T, sob, sot, soh, sgb, sgt, sgh,
                       W_PER_HEAD: tl.constexpr, D: tl.constexpr, BT: tl.constexpr,
                       EPS: tl.constexpr, GATE_FIRST: tl.constexpr):
    """This program's tile (batch row b, token rows, head h, channels cols, row mask ok), its o,
    gate and weight in fp32, silu(gate), and each row's 1 / rms of what is normalised (o, or
    with GATE_FIRST o * silu(gate))."""
    t_block, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = t_block * BT + tl.arange(0, BT)
    cols = tl.arange(0, D)
    ok = (rows < T)[:, None]
    o = tl.load(o_ptr + _at(b, rows, h, cols, sob, sot, soh), mask=ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + _at(b, rows, h, cols, sgb, sgt, sgh), mask=ok, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + W_PER_HEAD * h * D + cols).to(tl.float32)
    gate = g * tl.sigmoid(g)
    u = o * gate if GATE_FIRST else o
    r = 1.0 / tl.sqrt(tl.sum(u * u, axis=1) / D + EPS)
    return b, rows, h, cols, ok, o, g, w, gate, r


@triton.jit
def _gated_norm_fwd_kernel(o_ptr, g_ptr, w_ptr, y_ptr, T, H, sob, sot, soh, sgb, sgt, sgh,
                           syb, syt, syh, W_PER_HEAD: tl.constexpr, D: tl.constexpr,
                           BT: tl.constexpr, EPS: tl.constexpr, GATE_FIRST: tl.constexpr):
    b, rows, h, cols, ok, o, g, w, gate, r = _gated_norm_inputs(
        o_ptr, g_ptr, w_ptr, T, sob, sot, soh, sgb, sgt, sgh, W_PER_HEAD, D, BT, EPS,
        GATE_FIRST)
    y = o * r[:, None] * w[None, :] * gate
    tl.store(y_ptr + _at(b, rows, h, cols, syb, syt, syh), y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gated_norm_bwd_kernel(o_ptr, g_ptr, w_ptr, dy_ptr, do_ptr, dg_ptr, dw_ptr, T, H,
                           sob, sot, soh, sgb, sgt, sgh, syb, syt, syh, sdob, sdot, sdoh,
                           sdgb, sdgt, sdgh, W_PER_HEAD: tl.constexpr, D: tl.constexpr,
                           BT: tl.constexpr, EPS: tl.constexpr, GATE_FIRST: tl.constexpr):
    """With u the normalised tensor (o, or o * silu(g)) and uhat = u / rms(u):
    du = (dyhat - uhat mean(dyhat uhat)) / rms(u), where dyhat = dy w (times silu(g) when the
    gate comes after the norm); the gate's gradient takes the rest through silu' ."""
    b, rows, h, cols, ok, o, g, w, gate, r = _gated_norm_inputs(
        o_ptr, g_ptr, w_ptr, T, sob, sot, soh, sgb, sgt, sgh, W_PER_HEAD, D, BT, EPS,
        GATE_FIRST)
    dy = tl.load(dy_ptr + _at(b, rows, h, cols, syb, syt, syh), mask=ok,
                 other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    dsilu = sig * (1.0 + g * (1.0 - sig))
    if GATE_FIRST:
        uhat = o * gate * r[:, None]
        dyhat = dy * w[None, :]
        du = r[:, None] * (dyhat - uhat * (tl.sum(dyhat * uhat, axis=1) / D)[:, None])
        do = du * gate
        dg = du * o * dsilu
        dw = tl.sum(dy * uhat, axis=0)
    else:
        xhat = o * r[:, None]
        dxhat = dy * w[None, :] * gate
        do = r[:, None] * (dxhat - xhat * (tl.sum(dxhat * xhat, axis=1) / D)[:, None])
        dg = dy * xhat * w[None, :] * dsilu
        dw = tl.sum(dy * xhat * gate, axis=0)
    tl.store(do_ptr + _at(b, rows, h, cols, sdob, sdot, sdoh), do.to(do_ptr.dtype.element_ty),
             mask=ok)
    tl.store(dg_ptr + _at(b, rows, h, cols, sdgb, sdgt, sdgh), dg.to(dg_ptr.dtype.element_ty),
             mask=ok)
    program = b * tl.num_programs(0) + tl.program_id(0)
    tl.store(dw_ptr + (program * H + h) * D + cols, dw)


def _heads(t: torch.Tensor) -> tuple[int, int, int]:
    """Strides (batch, token, head) of a ``[B, T, H, D]`` tensor whose last dim is dense."""
    assert t.stride(-1) == 1, "the channel dim must be contiguous"
    return t.stride(0), t.stride(1), t.stride(2)


def _check_head_dim(dim: int) -> None:
    if dim & (dim - 1):
        raise ValueError(f"gated_rms_norm: the head dim ({dim}) must be a power of two")


def gated_rms_norm_forward(o, weight, gate, eps, out, gate_first=False):
    """Writes ``rmsnorm(o) * weight * silu(gate)`` (``gate_first``: ``rmsnorm(o * silu(gate)) *
    weight``) into ``out`` (all ``[B, T, H, D]`` views)."""
    batch, length, heads, dim = o.shape
    _check_head_dim(dim)
    grid = (triton.cdiv(length, TOKENS_PER_PROGRAM), batch, heads)
    _gated_norm_fwd_kernel[grid](o, gate, weight, out, length, heads, *_heads(o), *_heads(gate),
                                 *_heads(out), W_PER_HEAD=int(weight.dim() == 2), D=dim,
                                 BT=TOKENS_PER_PROGRAM, EPS=eps, GATE_FIRST=gate_first)
    return out


def gated_rms_norm_backward(o, weight, gate, eps, dy, dgate=None, gate_first=False):
    """Gradients of :func:`gated_rms_norm_forward`: ``do`` and ``dgate`` in the strides of ``o``
    and ``gate`` (``dgate`` written into ``dgate`` where given, whose last dim is dense),
    ``dweight`` in ``weight``'s shape and dtype."""
    batch, length, heads, dim = o.shape
    do = empty_in_order_of(o)
    dgate = empty_in_order_of(gate) if dgate is None else _checked_out(dgate, gate)
    grid = (triton.cdiv(length, TOKENS_PER_PROGRAM), batch, heads)
    dw = torch.empty(grid[0] * batch, heads, dim, device=o.device, dtype=torch.float32)
    _gated_norm_bwd_kernel[grid](o, gate, weight, dy, do, dgate, dw, length, heads, *_heads(o),
                                 *_heads(gate), *_heads(dy), *_heads(do), *_heads(dgate),
                                 W_PER_HEAD=int(weight.dim() == 2), D=dim, BT=TOKENS_PER_PROGRAM,
                                 EPS=eps, GATE_FIRST=gate_first)
    dw = dw.sum(0)
    return do, dgate, (dw if weight.dim() == 2 else dw.sum(0)).to(weight.dtype)


@triton.jit
def _softplus(u):
    """log(1 + exp(u)) in fp32, as torch's (u itself above 20), without losing exp(u) << 1."""
    z = tl.exp(-tl.abs(u))
    return tl.where(u > 20.0, u, tl.maximum(u, 0.0) + tl.where(z < 1e-4, z - 0.5 * z * z,
                                                               tl.log(1.0 + z)))


@triton.jit
def _gate_fwd_kernel(x_ptr, a_ptr, dt_ptr, y_ptr, T, N, sxb, sxt, C: tl.constexpr,
                     BT: tl.constexpr, BN: tl.constexpr, DECAY: tl.constexpr):
    """y = sigmoid(x), or with DECAY ``-exp(A_log[n // C]) * softplus(x + dt_bias[n])``; fp32
    ``[B, T, N]``."""
    b, rows, cols, row_ok, col_ok = _conv_tile(T, N, BT, BN)
    ok = row_ok[:, None] & col_ok[None, :]
    x = tl.load(x_ptr + b * sxb + rows[:, None] * sxt + cols[None, :], mask=ok,
                other=0.0).to(tl.float32)
    if DECAY:
        dt = tl.load(dt_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        a = -tl.exp(tl.load(a_ptr + cols // C, mask=col_ok, other=0.0).to(tl.float32))
        y = a[None, :] * _softplus(x + dt[None, :])
    else:
        y = tl.sigmoid(x)
    tl.store(y_ptr + (b * T + rows[:, None]) * N + cols[None, :], y, mask=ok)


@triton.jit
def _gate_bwd_kernel(x_ptr, a_ptr, dt_ptr, dy_ptr, dx_ptr, part_ptr, T, N, sxb, sxt, sdb, sdt,
                     C: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, TILES: tl.constexpr,
                     DECAY: tl.constexpr):
    """dx of :func:`_gate_fwd_kernel` for ``TILES`` token tiles (in dx's dtype and strides) and,
    with DECAY, their share of the parameters' gradients in ``[programs, 2, N]`` fp32 partials:
    ``d dt_bias[n] = sum dx[n]`` and ``d A_log`` per channel, ``sum dy * y``."""
    b = tl.program_id(1)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    col_ok = cols < N
    d_dt = tl.zeros([BN], dtype=tl.float32)
    d_a = tl.zeros([BN], dtype=tl.float32)
    if DECAY:
        dt = tl.load(dt_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        a = -tl.exp(tl.load(a_ptr + cols // C, mask=col_ok, other=0.0).to(tl.float32))
    for tile in range(TILES):
        rows = (tl.program_id(0) * TILES + tile) * BT + tl.arange(0, BT)
        ok = (rows < T)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + b * sxb + rows[:, None] * sxt + cols[None, :], mask=ok,
                    other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + (b * T + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0)
        if DECAY:
            u = x + dt[None, :]
            dx = dy * a[None, :] * tl.sigmoid(u)
            d_dt += tl.sum(dx, axis=0)
            d_a += tl.sum(dy * a[None, :] * _softplus(u), axis=0)
        else:
            sig = tl.sigmoid(x)
            dx = dy * sig * (1.0 - sig)
        tl.store(dx_ptr + b * sdb + rows[:, None] * sdt + cols[None, :],
                 dx.to(dx_ptr.dtype.element_ty), mask=ok)
    if DECAY:
        program = b * tl.num_programs(0) + tl.program_id(0)
        tl.store(part_ptr + program * 2 * N + cols, d_dt, mask=col_ok)
        tl.store(part_ptr + (program * 2 + 1) * N + cols, d_a, mask=col_ok)


def _gate_launch(x: torch.Tensor, A_log, dt_bias):
    """Sizes, channel block and the decay's arguments of a gate kernel's launch (x stands in for
    the absent parameters of the sigmoid, which DECAY keeps the kernel from reading)."""
    batch, length, width = x.shape
    if x.stride(-1) != 1:
        raise ValueError("gate: the channel dim must be contiguous")
    block = min(GATE_CHANNELS, triton.next_power_of_2(width))
    decay = A_log is not None
    params = (A_log, dt_bias) if decay else (x, x)
    options = dict(C=width // A_log.numel() if decay else 1, BT=TOKENS_PER_PROGRAM, BN=block,
                   DECAY=decay)
    return batch, length, width, triton.cdiv(width, block), params, options


def gate_forward(x, A_log=None, dt_bias=None) -> torch.Tensor:
    """``x [B, T, N]`` (any batch and token strides) -> fp32 ``[B, T, N]``: ``sigmoid(x)``, or
    with ``A_log [N / C]`` and ``dt_bias [N]`` the log-decay ``-exp(A_log) softplus(x +
    dt_bias)`` (C channels a head)."""
    batch, length, width, blocks, params, options = _gate_launch(x, A_log, dt_bias)
    y = torch.empty(batch, length, width, device=x.device, dtype=torch.float32)
    _gate_fwd_kernel[(triton.cdiv(length, TOKENS_PER_PROGRAM), batch, blocks)](
        x, *params, y, length, width, x.stride(0), x.stride(1), **options)
    return y


def gate_backward(x, A_log, dt_bias, dy, dx=None):
    """Gradients of :func:`gate_forward`: ``dx`` in x's dtype (written into ``dx`` where given,
    else in x's strides), and with a decay ``dA_log``, ``ddt_bias`` in their own dtypes."""
    batch, length, width, blocks, params, options = _gate_launch(x, A_log, dt_bias)
    dx = empty_in_order_of(x) if dx is None else _checked_out(dx, x)
    decay = options["DECAY"]
    grid = (triton.cdiv(triton.cdiv(length, TOKENS_PER_PROGRAM), GATE_BWD_TILES), batch, blocks)
    part = torch.empty(grid[0] * batch, 2, width, device=x.device,
                       dtype=torch.float32) if decay else x
    _gate_bwd_kernel[grid](
        x, *params, dy.contiguous(), dx, part, length, width, x.stride(0), x.stride(1),
        dx.stride(0), dx.stride(1), TILES=GATE_BWD_TILES, **options)
    if not decay:
        return dx, None, None
    d_dt, d_a = part.sum(0)
    return (dx, d_a.view(A_log.numel(), -1).sum(1).to(A_log.dtype),
            d_dt.view(dt_bias.shape).to(dt_bias.dtype))


@triton.jit
def _rope_kernel(t_ptr, f_ptr, y_ptr, N, B, H, sts, stb, sth, sfs,
                 HALF: tl.constexpr, BH: tl.constexpr, TOKENS: tl.constexpr, INVERSE: tl.constexpr):
    """``TOKENS`` consecutive tokens of the ``N = s * b`` (b fastest) x all H heads: a
    ``[TOKENS, BH, HALF]`` tile of each half of the head dim."""
    token = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    token_ok = token < N
    s, b = (token // B).to(tl.int64), (token % B).to(tl.int64)
    heads, j = tl.arange(0, BH), tl.arange(0, HALF)
    ok = token_ok[:, None, None] & (heads < H)[None, :, None]
    src = t_ptr + (s * sts + b * stb)[:, None, None] + heads[None, :, None] * sth + j[None, None, :]
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    angles = f_ptr + s[:, None] * sfs + j[None, :]
    f1 = tl.load(angles, mask=token_ok[:, None], other=0.0).to(tl.float32)
    f2 = tl.load(angles + HALF, mask=token_ok[:, None], other=0.0).to(tl.float32)
    c1, s1 = tl.cos(f1)[:, None, :], tl.sin(f1)[:, None, :]
    c2, s2 = tl.cos(f2)[:, None, :], tl.sin(f2)[:, None, :]
    if INVERSE:  # the transpose: y1 = x1 c1 + x2 s2, y2 = x2 c2 - x1 s1
        y1, y2 = x1 * c1 + x2 * s2, x2 * c2 - x1 * s1
    else:
        y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    dst = y_ptr + (token.to(tl.int64)[:, None, None] * H + heads[None, :, None]) * (2 * HALF) + j[None, None, :]
    tl.store(dst, y1.to(y_ptr.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, y2.to(y_ptr.dtype.element_ty), mask=ok)


def rope_forward(t: torch.Tensor, freqs: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``t [s, b, H, D]`` (any strides over s, b, H; D dense, D/2 a power of two), ``freqs
    [s, 1, 1, D]`` -> ``[s, b, H, D]`` contiguous in ``t.dtype``; ``inverse``: rotate by -f (the
    gradient)."""
    length, batch, heads, dim = t.shape
    y = torch.empty(length, batch, heads, dim, device=t.device, dtype=t.dtype)
    head_block = triton.next_power_of_2(heads)
    tokens = max(1, min(ROPE_TOKENS, ROPE_TILE // (head_block * dim // 2)))
    _rope_kernel[(triton.cdiv(length * batch, tokens),)](
        t, freqs, y, length * batch, batch, heads, t.stride(0), t.stride(1), t.stride(2), freqs.stride(0),
        HALF=dim // 2, BH=head_block, TOKENS=tokens, INVERSE=inverse)
    return y


RMS_ROWS = 4  # rows a program normalises at a time
RMS_BWD_PROGRAMS = 512  # at most; each sums its rows' share of the weight gradient


@triton.jit
def _rms_rows(x_ptr, tile, M, N, ROWS: tl.constexpr, BN: tl.constexpr):
    """Row indices, columns, mask and the rows of ``x`` (fp32) of a tile of ROWS rows."""
    rows = tile * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BN)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    return rows, cols, ok, offsets, x


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, M, N, eps,
                         ROWS: tl.constexpr, BN: tl.constexpr):
    rows, cols, ok, offsets, x = _rms_rows(x_ptr, tl.program_id(0), M, N, ROWS, BN)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(y_ptr + offsets, (x * rstd[:, None] * w[None, :]).to(y_ptr.dtype.element_ty),
             mask=ok)
    tl.store(rstd_ptr + rows, rstd, mask=rows < M)


@triton.jit
def _rms_norm_bwd_kernel(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_ptr, M, N,
                         ROWS: tl.constexpr, BN: tl.constexpr):
    program, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BN)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    dw = tl.zeros([BN], dtype=tl.float32)
    for tile in range(program, tl.cdiv(M, ROWS), programs):
        rows, cols, ok, offsets, x = _rms_rows(x_ptr, tile, M, N, ROWS, BN)
        dy = tl.load(dy_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        dx = (wdy - xhat * (tl.sum(xhat * wdy, axis=1) / N)[:, None]) * rstd[:, None]
        tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty), mask=ok)
        dw += tl.sum(dy * xhat, axis=0)
    tl.store(dw_ptr + program * N + cols, dw, mask=cols < N)


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float):
    """``x [M, N]`` (contiguous) -> (``y [M, N]`` in ``x.dtype``, ``rstd [M]`` fp32)."""
    rows, width = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    _rms_norm_fwd_kernel[(triton.cdiv(rows, RMS_ROWS),)](
        x, weight, y, rstd, rows, width, eps, ROWS=RMS_ROWS, BN=triton.next_power_of_2(width))
    return y, rstd


def rms_norm_backward(x, weight, rstd, dy):
    """Gradients of :func:`rms_norm_forward`: ``dx [M, N]`` in ``x.dtype``, ``dw [N]`` in
    ``weight.dtype``."""
    rows, width = x.shape
    dx = torch.empty_like(x)
    programs = min(triton.cdiv(rows, RMS_ROWS), RMS_BWD_PROGRAMS)
    dw = torch.empty(programs, width, device=x.device, dtype=torch.float32)
    _rms_norm_bwd_kernel[(programs,)](
        x, weight, rstd, dy.contiguous(), dx, dw, rows, width, ROWS=RMS_ROWS,
        BN=triton.next_power_of_2(width))
    return dx, dw.sum(0).to(weight.dtype)


CE_BLOCK, CE_WARPS = 2048, 8  # columns a program loads at a time, and its warps
CE_FLOOR = -3.0e38  # below every logit: the running max's start and masked columns' value


@triton.jit
def _ce_row(target_ptr, vocab_start, BV: tl.constexpr):
    """This program's row, its column offsets within a block, and its target's column here."""
    row = tl.program_id(0).to(tl.int64)
    return row, tl.arange(0, BV), tl.load(target_ptr + row).to(tl.int64) - vocab_start


@triton.jit
def _ce_stats_kernel(x_ptr, target_ptr, stats_ptr, V, vocab_start, BV: tl.constexpr,
                     FLOOR: tl.constexpr):
    row, cols, local = _ce_row(target_ptr, vocab_start, BV)
    peak = tl.full([BV], FLOOR, dtype=tl.float32)
    total = tl.zeros([BV], dtype=tl.float32)
    picked = tl.zeros([BV], dtype=tl.float32)
    for first in range(0, V, BV):
        c = first + cols
        ok = c < V
        x = tl.load(x_ptr + row * V + c, mask=ok, other=FLOOR).to(tl.float32)
        grown = tl.maximum(peak, x)
        total = total * tl.exp(peak - grown) + tl.where(ok, tl.exp(x - grown), 0.0)
        peak = grown
        picked += tl.where(ok & (c == local), x, 0.0)
    row_peak = tl.max(peak, axis=0)
    tl.store(stats_ptr + row * 3, row_peak)
    tl.store(stats_ptr + row * 3 + 1, tl.sum(total * tl.exp(peak - row_peak), axis=0))
    tl.store(stats_ptr + row * 3 + 2, tl.sum(picked, axis=0))


@triton.jit
def _ce_grad_kernel(x_ptr, target_ptr, lse_ptr, dloss_ptr, dx_ptr, V, vocab_start,
                    BV: tl.constexpr):
    row, cols, local = _ce_row(target_ptr, vocab_start, BV)
    lse = tl.load(lse_ptr + row)
    scale = tl.load(dloss_ptr + row)
    for first in range(0, V, BV):
        c = first + cols
        ok = c < V
        x = tl.load(x_ptr + row * V + c, mask=ok, other=0.0).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(ok & (c == local), 1.0, 0.0)) * scale
        tl.store(dx_ptr + row * V + c, d.to(dx_ptr.dtype.element_ty), mask=ok)


def _ce_block(columns: int) -> int:
    return min(CE_BLOCK, triton.next_power_of_2(columns))


def cross_entropy_stats(rows: torch.Tensor, target: torch.Tensor, vocab_start: int):
    """``rows [N, V]`` (contiguous), ``target [N]`` -> fp32 ``[N, 3]``, as
    :func:`.reference.cross_entropy_stats`."""
    count, columns = rows.shape
    stats = torch.empty(count, 3, device=rows.device, dtype=torch.float32)
    _ce_stats_kernel[(count,)](rows, target, stats, columns, vocab_start,
                               BV=_ce_block(columns), FLOOR=CE_FLOOR, num_warps=CE_WARPS)
    return stats


def cross_entropy_grad(rows, target, lse, dloss, vocab_start: int) -> torch.Tensor:
    """As :func:`.reference.cross_entropy_grad`: ``[N, V]`` in ``rows.dtype``."""
    count, columns = rows.shape
    grad = torch.empty_like(rows)
    _ce_grad_kernel[(count,)](rows, target, lse, dloss, grad, columns, vocab_start,
                              BV=_ce_block(columns), num_warps=CE_WARPS)
    return grad
