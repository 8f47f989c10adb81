"""Five selection kernels: the top-k block choice of MoBA and NSA (``reference.chosen_blocks``),
MoBA's whole selection from q and the block means of k (:func:`moba_chosen`), the bitmap of
DSA's and CSA's per-token key selection (:func:`selection_words`) and the same selection as an
attention bias (:func:`selection_bias`), and NSA's block importance, the scores that choice
ranks (:func:`nsa_importance`).

``chosen_blocks(scores [..., n], top_k)`` marks, per row, the ``top_k`` highest-scoring blocks,
``-inf`` marking a block that cannot be chosen and ``+inf`` one that must be. In PyTorch that is
a top-k (radix selection per row), a zero tensor and a scatter, the top-k a costly part of
NSA's fwd+bwd (256 blocks, k = 16). Here one program holds BLOCK_R rows of scores in registers
and takes the row's largest score k times (the first column holding it, then set to -inf),
marking it chosen unless it is -inf; it writes the bool rows once.

The chosen set equals torch.topk's wherever a row's scores are distinct (and every +inf is
chosen while there are at most k of them). Where equal finite scores compete for the last
places, this takes the lowest column; torch.topk does not say which it takes. Rows of up to
MAX_BLOCKS blocks (n is padded to a power of two in registers); CUDA tensors, or CPU tensors
under Triton's interpreter (tests/ops/test_triton_interpret_select.py).

:func:`moba_chosen` makes MoBA's gates ``q . mean(K_block)`` in the same program that chooses
from them, masked as ``layout.moba_chosen`` masks them. The products run on tensor cores as
three TF32 products (``tf32x3``: the operands split into a TF32 high part and the rest, the
product of the two rests dropped): as accurate as fp32 to about 2^-22 of each product, not
bitwise, so where two blocks' gates tie to that precision the choice may differ from PyTorch's
fp32 GEMM. It replaces PyTorch's form (per chunk of 4096 queries an fp32 copy of q, a GEMM, two
masks, the choice) and runs after a first-use check against it (:func:`moba_checked`, a row of
``megatron-ext doctor``).

:func:`selection_words` sets bit ``s % 32`` of word ``s // 32`` of row t for each key s listed in
row t of ``selected [B, T, K]``, one program per row and an atomic OR per listed key: the same
words as ``layout.selection_words_reference`` (a bool ``[B, c, S]`` per chunk of rows, packed),
without the bool chunks.

:func:`selection_bias` writes the same selection as an additive bias (0 on the listed keys,
-inf elsewhere), the mask cuDNN's fused attention takes (flash.py's
:func:`~.flash.causal_selection_attention`).

:func:`nsa_importance` is layout.nsa_importance in one kernel per chunk of queries: per tile of
64 queries and key/value head, pass 1 takes each query head's log-sum-exp over the compressed
blocks it sees, pass 2 the probabilities of the compressed blocks overlapping each 16 selection
blocks, times their token shares (a tl.dot in fp32), summed over the group's heads, masked and
stored once (a group of more than ``_IMPORTANCE_HEADS`` heads is split over programs whose sums
are then added). layout.nsa_importance makes a ``[B, Hq, chunk, N]`` fp32 score matrix with an
fp32 (SIMT) GEMM, its softmax, a second GEMM with the shares and the masks; this kernel makes no
such matrix. It runs after a first-use check against layout.nsa_importance
(:func:`importance_checked`, a row of ``megatron-ext doctor``).
"""
from __future__ import annotations

import functools
import logging
import math

import torch
import triton
import triton.language as tl

from ..first_use import passes_first_use_check, relative_error

__all__ = ["chosen_blocks", "moba_chosen", "check_moba", "moba_checked", "selection_words",
           "selection_bias",
           "nsa_importance", "check_importance", "importance_checked", "MOBA_CHECK_TOLERANCE",
           "IMPORTANCE_TOLERANCE", "MAX_BLOCKS"]

_log = logging.getLogger(__name__)

MAX_BLOCKS = 1024
ROW_ELEMENTS = 4096  # rows per program x n rounded up to a power of two


@triton.jit
def _top_k(x, top_k, NP: tl.constexpr):
    """The ``top_k`` largest of each row of ``x [R, NP]`` (the first column of a tie first, never
    a -inf), as a bool ``[R, NP]``."""
    j = tl.arange(0, NP)
    picked = tl.zeros(x.shape, dtype=tl.int1)
    for _ in range(0, top_k):
        best = tl.max(x, 1)
        first = tl.min(tl.where(x == best[:, None], j[None, :], NP), 1)
        hit = j[None, :] == first[:, None]
        picked = picked | (hit & (best > float("-inf"))[:, None])
        x = tl.where(hit, float("-inf"), x)
    return picked


@triton.jit
def _choose_kernel(scores, chosen, rows, n, top_k, BLOCK_R: tl.constexpr, NP: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, NP)
    live = (r < rows)[:, None] & (j < n)[None, :]
    at = r.to(tl.int64)[:, None] * n + j[None, :]
    x = tl.load(scores + at, mask=live, other=float("-inf"))
    tl.store(chosen + at, _top_k(x, top_k, NP).to(tl.int8), mask=live)


def chosen_blocks(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``reference.chosen_blocks`` for fp32 ``scores [..., n]`` (n <= MAX_BLOCKS)."""
    if scores.dtype != torch.float32 or not 0 < scores.shape[-1] <= MAX_BLOCKS:
        raise ValueError(f"triton select: needs fp32 scores of 1 to {MAX_BLOCKS} blocks, got "
                         f"{scores.dtype} {tuple(scores.shape)}")
    n = scores.shape[-1]
    flat = scores.reshape(-1, n).contiguous()
    chosen = torch.empty(flat.shape, dtype=torch.bool, device=scores.device)
    padded = triton.next_power_of_2(n)
    block = max(1, ROW_ELEMENTS // padded)
    if flat.shape[0]:
        _choose_kernel[(triton.cdiv(flat.shape[0], block),)](
            flat, chosen.view(torch.int8), flat.shape[0], n, min(top_k, n), BLOCK_R=block,
            NP=padded, num_warps=4)
    return chosen.view(scores.shape)


@triton.jit(do_not_specialize=["seq_len", "n", "top_k", "block_size"])
def _moba_kernel(q_ptr, means_ptr, chosen_ptr, seq_len, n, top_k, block_size, q_batch, q_token,
                 HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                 NP: tl.constexpr, BLOCK_T: tl.constexpr):
    """:func:`moba_chosen` for BLOCK_T queries of one (batch, head), grid [cdiv(T, BLOCK_T),
    B Hq]: the gates (q's values as read times the fp32 means, summed over D in chunks of
    BLOCK_D, in three TF32 products each), masked, then their top-k."""
    b = tl.program_id(1) // HQ
    h = tl.program_id(1) % HQ
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    live_t = t < seq_len
    means = means_ptr + (b * HKV + h // (HQ // HKV)).to(tl.int64) * n * D
    queries = q_ptr + b.to(tl.int64) * q_batch + t.to(tl.int64)[:, None] * q_token + h * D
    gate = tl.zeros([BLOCK_T, NP], dtype=tl.float32)
    for start in tl.static_range(0, D, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        rows = tl.load(queries + d[None, :], mask=live_t[:, None] & (d < D)[None, :], other=0.0)
        block_means = tl.load(means + j[None, :] * D + d[:, None],
                              mask=(j < n)[None, :] & (d < D)[:, None], other=0.0)
        gate += tl.dot(rows.to(tl.float32), block_means, input_precision="tf32x3")
    own = (t // block_size)[:, None]
    gate = tl.where(j[None, :] == own, float("inf"), gate)
    gate = tl.where((j[None, :] > own) | (j >= n)[None, :], float("-inf"), gate)
    at = ((b * HQ + h).to(tl.int64) * seq_len + t.to(tl.int64))[:, None] * n + j[None, :]
    tl.store(chosen_ptr + at, _top_k(gate, top_k, NP).to(tl.int8),
             mask=live_t[:, None] & (j < n)[None, :])


def moba_chosen(q: torch.Tensor, means: torch.Tensor, block_size: int,
                top_k: int) -> torch.Tensor:
    """``layout.moba_chosen`` from q ``[B, T, Hq, D]`` (its rows contiguous) and the fp32 block
    means of k ``[B, Hkv, n, D]`` (n <= MAX_BLOCKS): ``[B, Hq, T, n]`` bool."""
    batch, seq_len, heads, dim = q.shape
    kv_heads, n = means.shape[1], means.shape[2]
    if q.stride(-1) != 1 or q.stride(-2) != dim or not 0 < n <= MAX_BLOCKS:
        raise ValueError(f"triton select: MoBA needs q's rows contiguous and 1 to {MAX_BLOCKS} "
                         f"blocks, got strides {q.stride()} and {n} blocks")
    chosen = torch.empty(batch, heads, seq_len, n, dtype=torch.bool, device=q.device)
    padded = max(16, triton.next_power_of_2(n))
    # 64 x 32 tiles at 32 blocks
    block_t = max(16, min(64, ROW_ELEMENTS // padded))
    if chosen.numel():
        _moba_kernel[(triton.cdiv(seq_len, block_t), batch * heads)](
            q, means.float().contiguous(), chosen.view(torch.int8), seq_len, n, min(top_k, n),
            block_size, q.stride(0), q.stride(1), HQ=heads, HKV=kv_heads, D=dim,
            BLOCK_D=max(16, min(32, 8192 // padded)), NP=padded, BLOCK_T=block_t,
            num_warps=8 if padded >= 512 else 4)
    return chosen


# The share of rows (query, head) whose chosen blocks may differ from the PyTorch form's in the
# first-use check: tf32x3 may break a tie at its precision otherwise (module docstring); a wrong
# kernel (a mask or an index off) changes most rows of the check.
MOBA_CHECK_TOLERANCE = 0.01


def check_moba(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The first-use check of :func:`moba_chosen`: the share of rows whose chosen blocks differ
    from layout.moba_chosen_pytorch's in fp32 on the CPU, on the same values rounded to
    ``dtype``: 2 x 300 tokens, 4 query heads on 2 key/value heads, D = 64, blocks of 32 (the
    last partial), top 4."""
    from . import layout

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 300, 4, 64, generator=generator).to(dtype)
    k = (torch.randn(2, 300, 2, 64, generator=generator) + 0.5).to(dtype)
    got = moba_chosen(q.to(device), layout.block_means(k.to(device), 32), 32, 4).cpu()
    want = layout.moba_chosen_pytorch(q.float(), layout.block_means(k.float(), 32), 32, 4)
    return {"chosen_rows": (got != want).any(-1).float().mean().item()}


@functools.cache
def moba_checked(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`moba_chosen` passed :func:`check_moba` on ``device`` in ``dtype``; run
    once, a failure logged once."""
    return passes_first_use_check(check_moba, device, dtype, MOBA_CHECK_TOLERANCE,
                                  "MoBA's selection kernel", "PyTorch chooses the blocks", _log)


@triton.jit
def _words_kernel(selected, words, seq_len, top_k, rows, width, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over B T
    target = words + ((row // seq_len) * rows + row % seq_len) * width
    for start in range(0, top_k, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        key = tl.load(selected + row * top_k + j, mask=j < top_k, other=-1).to(tl.int32)
        tl.atomic_or(target + (key >> 5), (1 << (key & 31)), mask=key >= 0, sem="relaxed")


def selection_words(selected: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """int32 ``[B, rows, width]`` (rows >= T, 32 width >= every listed key): bit ``s % 32`` of
    word ``s // 32`` of row t set where row t of ``selected [B, T, K]`` lists key s (-1: none)."""
    batch, seq_len, top_k = selected.shape
    words = torch.zeros(batch, rows, width, dtype=torch.int32, device=selected.device)
    if selected.numel():
        _words_kernel[(batch * seq_len,)](selected.contiguous(), words, seq_len, top_k, rows,
                                          width, BLOCK_K=256, num_warps=4)
    return words


@triton.jit
def _bias_kernel(selected, bias, top_k, key_len, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over B T
    for start in range(0, top_k, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        key = tl.load(selected + row * top_k + j, mask=j < top_k, other=-1).to(tl.int64)
        tl.store(bias + row * key_len + key, tl.zeros([BLOCK_K], bias.dtype.element_ty),
                 mask=(key >= 0) & (key < key_len))


def selection_bias(selected: torch.Tensor, key_len: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, key_len]`` in ``dtype``: 0 where row t of ``selected [B, T, K]`` lists key s,
    -inf elsewhere (an additive attention bias: the selection's mask, 16 bits a pair)."""
    batch, seq_len, top_k = selected.shape
    bias = torch.full((batch, seq_len, key_len), float("-inf"), dtype=dtype,
                      device=selected.device)
    if selected.numel() and key_len:
        _bias_kernel[(batch * seq_len,)](selected.contiguous(), bias, top_k, key_len,
                                         BLOCK_K=256, num_warps=4)
    return bias


# ---------------------------------------------------------------------------------------------
# NSA's block importance
# ---------------------------------------------------------------------------------------------

@triton.jit
def _scores(q, k_ptr, key_rows, key_stride, i, num_compressed, d, in_d, t, scale,
            CB: tl.constexpr, STRIDE: tl.constexpr, IEEE: tl.constexpr):
    """``[BLOCK_T, BLOCK_N]``: the scaled scores of the queries ``q [BLOCK_T, DP]`` (positions
    t) against the compressed blocks i, -inf where a query does not see a block (the block ends
    after t) or i is past the last one."""
    real = i < num_compressed
    kt = tl.load(k_ptr + (key_rows + i[None, :]) * key_stride + d[:, None],
                 mask=real[None, :] & in_d[:, None], other=0.0)  # [DP, BLOCK_N]
    if IEEE:
        s = tl.dot(q.to(tl.float32), kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    sees = real[None, :] & (i[None, :] * STRIDE + CB - 1 <= t[:, None])
    return tl.where(sees, s * scale, float("-inf"))


@triton.jit(do_not_specialize=["seq_len", "num_compressed", "num_select", "first", "count"])
def _importance_kernel(q_ptr, k_ptr, out_ptr, seq_len, num_compressed, num_select, first, count,
                       scale, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       DP: tl.constexpr, GS: tl.constexpr, GP: tl.constexpr, CB: tl.constexpr,
                       STRIDE: tl.constexpr, SB: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, IEEE: tl.constexpr):
    """:func:`nsa_importance` for BLOCK_T queries and GS query heads of one key/value head (GP:
    GS rounded up to a power of two), grid [cdiv(count, BLOCK_T), B Hkv, G / GS]. Pass 1, per
    head: the log-sum-exp of its scores over the compressed blocks it sees (online, BLOCK_N
    blocks a step). Pass 2, per BLOCK_J selection blocks: the probabilities of the compressed
    blocks that overlap them, times their shares (a tl.dot in fp32), summed over the GS heads;
    the masks; one store into the slice ``program_id(2)`` of the output, which the launcher
    sums over where the group spans several programs."""
    G: tl.constexpr = HQ // HKV
    b = (tl.program_id(1) // HKV).to(tl.int64)
    kv_head = tl.program_id(1) % HKV
    part = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = rows < count
    t = first + rows.to(tl.int64)
    d = tl.arange(0, DP)
    in_d = d < D
    heads = tl.arange(0, GP)
    blocks = tl.arange(0, BLOCK_N)
    key_rows = b * num_compressed
    key_stride = HKV * D
    k_head = k_ptr + kv_head * D
    q_rows = q_ptr + ((b * seq_len + t) * HQ + kv_head * G + part * GS) * D
    # The compressed blocks that the tile's last query sees: i STRIDE + CB - 1 <= t.
    last = first + tl.minimum((tl.program_id(0) + 1) * BLOCK_T, count) - 1
    seen = tl.minimum(tl.where(last >= CB - 1, (last - CB + 1) // STRIDE + 1, 0), num_compressed)

    # Pass 1: each head's maximum and sum of exp over the blocks its queries see.
    top = tl.full([BLOCK_T, GP], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_T, GP], dtype=tl.float32)
    for g in tl.static_range(GS):
        q = tl.load(q_rows[:, None] + g * D + d[None, :], mask=live[:, None] & in_d[None, :],
                    other=0.0)
        m = tl.full([BLOCK_T], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_T], dtype=tl.float32)
        for n0 in range(0, seen, BLOCK_N):
            s = _scores(q, k_head, key_rows, key_stride, n0 + blocks, num_compressed, d, in_d, t,
                        scale, CB, STRIDE, IEEE)
            new = tl.maximum(m, tl.max(s, 1))
            shift = tl.where(new == float("-inf"), 0.0, new)
            l = l * tl.exp(m - shift) + tl.sum(tl.exp(s - shift[:, None]), 1)
            m = new
        top = tl.where(heads[None, :] == g, m[:, None], top)
        total = tl.where(heads[None, :] == g, l[:, None], total)

    # Pass 2: importance[t, j] = sum over heads and compressed blocks i of p(t, i) share(i, j).
    own = t // SB
    js = tl.arange(0, BLOCK_J)
    out_rows = out_ptr + ((part.to(tl.int64) * tl.num_programs(1) + tl.program_id(1)) * count
                          + rows.to(tl.int64)) * num_select
    for j0 in range(0, num_select, BLOCK_J):
        j = j0 + js
        importance = tl.zeros([BLOCK_T, BLOCK_J], dtype=tl.float32)
        # The compressed blocks that overlap selection blocks j0 .. j0 + BLOCK_J - 1.
        low = tl.maximum(j0 * SB - CB + 1, 0)
        low = (low + STRIDE - 1) // STRIDE
        high = tl.minimum(((j0 + BLOCK_J) * SB - 1) // STRIDE + 1, seen)
        for g in tl.static_range(GS):
            if low < high:
                q = tl.load(q_rows[:, None] + g * D + d[None, :],
                            mask=live[:, None] & in_d[None, :], other=0.0)
                m = tl.sum(tl.where(heads[None, :] == g, top, 0.0), 1)
                l = tl.sum(tl.where(heads[None, :] == g, total, 0.0), 1)
                shift = tl.where(m == float("-inf"), 0.0, m)
                scale_p = tl.where(l > 0, 1.0 / tl.where(l > 0, l, 1.0), 0.0)
                for n0 in range(low, high, BLOCK_N):
                    i = n0 + blocks
                    s = _scores(q, k_head, key_rows, key_stride, i, num_compressed, d, in_d, t,
                                scale, CB, STRIDE, IEEE)
                    p = tl.exp(s - shift[:, None]) * scale_p[:, None]
                    start = i * STRIDE
                    share = (tl.minimum(start[:, None] + CB, (j[None, :] + 1) * SB)
                             - tl.maximum(start[:, None], j[None, :] * SB))
                    share = tl.maximum(share, 0).to(tl.float32) / CB  # [BLOCK_N, BLOCK_J]
                    importance = tl.dot(p, share, importance, input_precision="ieee")
        importance = tl.where(j[None, :] > own[:, None], float("-inf"), importance)
        must = (j[None, :] == 0) | (j[None, :] == own[:, None]) | (j[None, :] == own[:, None] - 1)
        importance = tl.where(must & (j[None, :] <= own[:, None]), float("inf"), importance)
        tl.store(out_rows[:, None] + j[None, :], importance,
                 mask=live[:, None] & (j < num_select)[None, :])


_IMPORTANCE_LAUNCH = dict(BLOCK_T=64, BLOCK_N=64, BLOCK_J=16, num_warps=4)
# The most query heads of a group one program takes; larger groups are split over programs
# (a divisor of the group each) and their sums added, so that a large group does not make fewer,
# longer programs (``benchmarks/sparse_attention.py --ops nsa/flash``).
_IMPORTANCE_HEADS = 4


def nsa_importance(q: torch.Tensor, compressed_k: torch.Tensor, first: int, count: int, *,
                   compress_block: int, compress_stride: int, select_block: int,
                   num_select: int, scale: float) -> torch.Tensor:
    """``[B, Hkv, count, n]`` fp32: NSA's importance of the n selection blocks for the queries
    ``first .. first + count - 1`` of ``q [B, T, Hq, D]``, as layout.nsa_chosen computes it in
    PyTorch (``reference.nsa_attention_reference``'s rule): the compressed branch's attention
    probabilities (no sink) over ``compressed_k [B, N, Hkv, D]``, spread over each compressed
    block's tokens and summed per selection block and over the query heads of a key/value
    group; then -inf for blocks after a query's own and +inf for the first, the own and the
    previous block. The scores run on tensor cores with fp32 sums (exact products of 16-bit
    inputs; fp32 inputs in full fp32), so they equal PyTorch's fp32 ones to fp32 rounding."""
    batch, seq_len, q_heads, dim = q.shape
    num_compressed, kv_heads = compressed_k.shape[1], compressed_k.shape[2]
    if (compressed_k.dtype != q.dtype or q.dtype not in (torch.float32, torch.bfloat16,
                                                         torch.float16)
            or compressed_k.shape[0] != batch or compressed_k.shape[3] != dim
            or q_heads % kv_heads or not 0 <= first <= first + count <= seq_len):
        raise ValueError(f"triton select: nsa_importance needs q [B, T, Hq, D] and compressed_k "
                         f"[B, N, Hkv, D] of one 16- or 32-bit float dtype, Hkv dividing Hq, "
                         f"queries within T; got {q.dtype} {tuple(q.shape)}, "
                         f"{compressed_k.dtype} {tuple(compressed_k.shape)}, queries "
                         f"{first} .. {first + count - 1}")
    per_program = math.gcd(q_heads // kv_heads, _IMPORTANCE_HEADS)
    parts = q_heads // kv_heads // per_program
    out = torch.empty(parts, batch, kv_heads, count, num_select, dtype=torch.float32,
                      device=q.device)
    if out.numel():
        grid = (triton.cdiv(count, _IMPORTANCE_LAUNCH["BLOCK_T"]), batch * kv_heads, parts)
        _importance_kernel[grid](
            q.contiguous(), compressed_k.contiguous(), out, seq_len, num_compressed, num_select,
            first, count, float(scale), HQ=q_heads, HKV=kv_heads, D=dim,
            DP=max(16, triton.next_power_of_2(dim)), GS=per_program,
            GP=triton.next_power_of_2(per_program), CB=compress_block,
            STRIDE=compress_stride, SB=select_block, IEEE=q.dtype == torch.float32,
            **_IMPORTANCE_LAUNCH)
    return out[0] if parts == 1 else out.sum(0)


IMPORTANCE_TOLERANCE = 1e-4


def check_importance(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The first-use check of :func:`nsa_importance`: its relative error (Frobenius norm, over
    the finite entries; inf where the -inf / +inf masks differ) against layout.nsa_importance
    in fp32 on the CPU, on the same values rounded to ``dtype``: 2 x 150 tokens, 8 query heads
    on 1 key/value head (a group split over two programs), D = 64, compressed blocks of 32
    every 16 tokens, selection blocks of 32, the queries in two chunks (0 .. 99, 100 .. 149)."""
    from . import layout

    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 150, 8, 64, generator=generator).to(dtype)
    compressed_k = torch.randn(2, 8, 1, 64, generator=generator).to(dtype)
    sizes = dict(compress_block=32, compress_stride=16, select_block=32, num_select=5,
                 scale=0.125)
    errors = {}
    for first, count in ((0, 100), (100, 50)):
        got = nsa_importance(q.to(device), compressed_k.to(device), first, count, **sizes).cpu()
        want = layout.nsa_importance(q.float(), compressed_k.float(), first, count, **sizes)
        finite = torch.isfinite(want)
        same_masks = torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite],
                                                                               want[~finite])
        errors[f"importance_{first}"] = (relative_error(got[finite], want[finite]) if same_masks
                                         else float("inf"))
    return errors


@functools.cache
def importance_checked(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`nsa_importance` passed :func:`check_importance` on ``device`` in
    ``dtype``; run once, a failure logged once."""
    return passes_first_use_check(check_importance, device, dtype, IMPORTANCE_TOLERANCE,
                                  "NSA's block-importance kernel", "PyTorch computes it", _log)
