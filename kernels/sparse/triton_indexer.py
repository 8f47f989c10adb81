"""The lightning indexer's KL loss over each query's selected keys (DSA's and CSA's sparse
stage) in our own Triton kernels, forward and backward: :func:`selected_indexer_kl`, exported
by triton.py with the selected-attention kernels and checked with them.

What it computes, per query t of the n given (DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556,
sec. 2.1): the indexer's logits over the K keys of its row of ``selected``,
``I_ts = sum_j w_tj relu(q_tj . k_s)`` (j over the HI indexer heads, one key vector per token
shared by the heads), and ``KL(p_t || softmax(I_t))`` over those keys, p the target ``m_t``
(the main attention's mass, no gradient) L1-normalised; summed over the queries. The gathered
PyTorch form (selected.py) does the same with a ``[B, c, K, DI]`` gather per chunk of queries,
whose backward scatters ``[B, c, K, DI]`` gradients into index_k chunk by chunk, slow on a GPU
at DSA's sizes (B T = 32768, K = 2048, HI = 64, DI = 128).

Forward (``_kl_forward_kernel``, one program per query): one pass over the K selected keys,
BLOCK_K at a time, each key row loaded through its index; the scores of all HI heads with the
block's keys are one ``tl.dot`` (``[HP, DP] x [DP, BLOCK_K]``: the heads are the rows, as the
query heads of a group are in triton.py, so the tile is full for HI >= 16), then relu, the
weighted sum over the heads, and an online log-sum-exp of the logits (FlashAttention's). The
target's three sums come along: ``M = sum m``, ``sum m I`` and ``sum m log m``, so that
``KL = (sum m log m) / M - log M - (sum m I) / M + lse`` needs no second pass. Stored per
query: lse and M for the backward, and its KL.

Backward (``_kl_backward_kernel``, one program per query), with g the loss's gradient:
``dI_s = g (softmax_s - p_s)`` over the valid keys (0 for a query with no target mass), then,
with ``A_js = w_j [q_j . k_s > 0] dI_s``:
``dw_j = sum_s dI_s relu(q_j . k_s)``, ``dq_j = sum_s A_js k_s`` (a ``tl.dot``), and each key's
share ``dk_s = sum_j A_js q_j`` (a ``tl.dot`` of ``A^T`` with q), added into an fp32 ``dk``
with atomic adds. A key's gradient sums over every query that selected it; triton.py's
attention backward collects those queries with a CSR so as to avoid atomics, but here each
(query, key) pair's share needs the query's whole ``[HI, DI]`` (16 KB at the paper's sizes)
where the attention's needs a few rows: gathered per pair, that is K times the reads. The
atomics cost determinism: index_k's gradient can differ in its last bits from run to run.

Memory: nothing ``[T, K, DI]``; kept for backward: the inputs, lse and M (``[B, n]`` fp32);
the backward's fp32 dk, ``[B, S, DI]``. Each block's key rows are loaded once, along their
contiguous dim (the scores' ``tl.dot`` takes their transpose); the backward's atomic adds
compile to 16-byte vector atomics (``atom.global.v4.f32``).

Precision as in triton.py: fp32 inputs run every ``tl.dot`` in full fp32 ("ieee"); 16-bit ones
on tensor cores with fp32 accumulation, ``A`` rounded to the inputs' dtype before its two
products. Logits, softmax statistics and the target's sums are fp32. Indexer head dims up to
256 and up to 128 heads (padded to powers of two, at least 16).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import indexer_kl, lightning_index_scores

__all__ = ["selected_indexer_kl", "reference_indexer_kl", "index_scores", "MAX_HEADS",
           "MAX_DIM"]

MAX_HEADS = 128
MAX_DIM = 256
_BLOCK_K = 64
_SCORE_TILE = (64, 64)  # queries x keys of index_scores's programs
_MIN_DOT = 16  # the smallest tile side tl.dot takes
_FLOOR = tl.constexpr(-1e30)  # as in triton.py: a running maximum that never meets exp(-inf + inf)


@triton.jit
def _query_tiles(q_ptr, w_ptr, query, heads, DI: tl.constexpr, HP: tl.constexpr,
                 DP: tl.constexpr):
    """``query``'s ``[HP, DP]`` tile of index_q (zero past HI and DI) and its fp32 weights
    ``[HP]`` (zero past HI)."""
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)
    q = tl.load(q_ptr + (query * heads + h[:, None]) * DI + d[None, :],
                mask=(h < heads)[:, None] & (d < DI)[None, :], other=0.0)
    w = tl.load(w_ptr + query * heads + h, mask=h < heads, other=0.0).to(tl.float32)
    return q, w


@triton.jit
def _block_scores(q, keys, sel_ptr, query, start, top_k, DI: tl.constexpr, DP: tl.constexpr,
                  BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """Slots ``start ..`` of ``query``'s selection: the key indices (int32), which are real,
    the key rows ``[BLOCK_K, DP]`` (each loaded along its contiguous dim) and the heads' scores
    ``q_j . k_s``, ``[HP, BLOCK_K]`` fp32."""
    j = start + tl.arange(0, BLOCK_K)
    index = tl.load(sel_ptr + query * top_k + j, mask=j < top_k, other=-1).to(tl.int32)
    valid = index >= 0
    d = tl.arange(0, DP)
    k = tl.load(keys + index[:, None] * DI + d[None, :],
                mask=valid[:, None] & (d < DI)[None, :], other=0.0)
    return index, valid, k, tl.dot(q, tl.trans(k), input_precision=PRECISION)


@triton.jit(do_not_specialize=["queries", "key_len", "heads", "top_k"])
def _kl_forward_kernel(q_ptr, k_ptr, w_ptr, sel_ptr, target_ptr, lse_ptr, mass_ptr, kl_ptr,
                       queries, key_len, heads, top_k, DI: tl.constexpr, HP: tl.constexpr,
                       DP: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One query's KL, lse and target mass M, grid [B n]."""
    query = tl.program_id(0).to(tl.int64)
    keys = k_ptr + (query // queries) * key_len * DI
    q, w = _query_tiles(q_ptr, w_ptr, query, heads, DI, HP, DP)
    top = tl.full([], _FLOOR, tl.float32)
    total = tl.zeros([], tl.float32)  # sum of exp(I - top) over the valid keys
    mass = tl.zeros([], tl.float32)  # M
    mass_logit = tl.zeros([], tl.float32)  # sum m I
    mass_log_mass = tl.zeros([], tl.float32)  # sum m log m
    for start in range(0, top_k, BLOCK_K):
        _, valid, _, scores = _block_scores(q, keys, sel_ptr, query, start, top_k, DI, DP,
                                            BLOCK_K, PRECISION)
        logits = tl.sum(tl.maximum(scores, 0.0) * w[:, None], 0)
        logits = tl.where(valid, logits, float("-inf"))
        new_top = tl.maximum(top, tl.max(logits, 0))
        total = total * tl.exp(top - new_top) + tl.sum(tl.exp(logits - new_top), 0)
        top = new_top
        j = start + tl.arange(0, BLOCK_K)
        m = tl.load(target_ptr + query * top_k + j, mask=valid, other=0.0)
        mass += tl.sum(m, 0)
        mass_logit += tl.sum(m * tl.where(valid, logits, 0.0), 0)
        mass_log_mass += tl.sum(m * tl.log(tl.where(m > 0, m, 1.0)), 0)
    lse = top + tl.log(total)
    has_mass = mass > 0
    safe = tl.where(has_mass, mass, 1.0)
    kl = tl.where(has_mass, (mass_log_mass - mass_logit) / safe - tl.log(safe) + lse, 0.0)
    tl.store(lse_ptr + query, lse)
    tl.store(mass_ptr + query, mass)
    tl.store(kl_ptr + query, kl)


@triton.jit(do_not_specialize=["queries", "key_len", "heads", "top_k"])
def _kl_backward_kernel(q_ptr, k_ptr, w_ptr, sel_ptr, target_ptr, lse_ptr, mass_ptr, grad_ptr,
                        dq_ptr, dk_ptr, dw_ptr, queries, key_len, heads, top_k,
                        DI: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                        BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """One query's dq and dw, and its keys' shares of dk (atomic adds), grid [B n]."""
    query = tl.program_id(0).to(tl.int64)
    row = (query // queries) * key_len * DI
    keys = k_ptr + row
    q, w = _query_tiles(q_ptr, w_ptr, query, heads, DI, HP, DP)
    lse = tl.load(lse_ptr + query)
    mass = tl.load(mass_ptr + query)
    has_mass = mass > 0
    grad = tl.where(has_mass, tl.load(grad_ptr), 0.0)
    inverse = 1.0 / tl.where(has_mass, mass, 1.0)
    d = tl.arange(0, DP)
    in_dim = d < DI
    dq = tl.zeros([HP, DP], dtype=tl.float32)
    dw = tl.zeros([HP], dtype=tl.float32)
    for start in range(0, top_k, BLOCK_K):
        index, valid, k, scores = _block_scores(q, keys, sel_ptr, query, start, top_k, DI, DP,
                                                BLOCK_K, PRECISION)
        relu = tl.maximum(scores, 0.0)
        logits = tl.sum(relu * w[:, None], 0)
        j = start + tl.arange(0, BLOCK_K)
        m = tl.load(target_ptr + query * top_k + j, mask=valid, other=0.0)
        d_logits = tl.where(valid, grad * (tl.exp(logits - lse) - m * inverse), 0.0)
        dw += tl.sum(relu * d_logits[None, :], 1)
        a = tl.where(scores > 0, w[:, None] * d_logits[None, :], 0.0).to(q.dtype)
        dq += tl.dot(a, k, input_precision=PRECISION)
        dk = tl.dot(tl.trans(a), q, input_precision=PRECISION)  # [BLOCK_K, DP]
        tl.atomic_add(dk_ptr + row + index[:, None] * DI + d[None, :], dk,
                      mask=valid[:, None] & in_dim[None, :], sem="relaxed")
    h = tl.arange(0, HP)
    real = h < heads
    tl.store(dq_ptr + (query * heads + h[:, None]) * DI + d[None, :],
             dq.to(dq_ptr.dtype.element_ty), mask=real[:, None] & in_dim[None, :])
    tl.store(dw_ptr + query * heads + h, dw.to(dw_ptr.dtype.element_ty), mask=real)


@triton.jit(do_not_specialize=["queries", "key_len", "heads"])
def _scores_kernel(q_ptr, k_ptr, w_ptr, out_ptr, queries, key_len, heads, DI: tl.constexpr,
                   DP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                   PRECISION: tl.constexpr):
    """The ``[BLOCK_T, BLOCK_S]`` tile of one batch row's scores, grid [T tiles, S tiles, B]."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    batch = tl.program_id(2).to(tl.int64)
    d = tl.arange(0, DP)
    row_ok, col_ok, in_dim = rows < queries, cols < key_len, d < DI
    k_t = tl.load(k_ptr + (batch * key_len + cols[None, :]) * DI + d[:, None],
                  mask=col_ok[None, :] & in_dim[:, None], other=0.0)  # [DP, BLOCK_S]
    query = batch * queries + rows  # [BLOCK_T]
    acc = tl.zeros([BLOCK_T, BLOCK_S], dtype=tl.float32)
    for j in range(heads):
        q = tl.load(q_ptr + (query[:, None] * heads + j) * DI + d[None, :],
                    mask=row_ok[:, None] & in_dim[None, :], other=0.0)
        w = tl.load(w_ptr + query * heads + j, mask=row_ok, other=0.0).to(tl.float32)
        acc += tl.maximum(tl.dot(q, k_t, input_precision=PRECISION), 0.0) * w[:, None]
    tl.store(out_ptr + query[:, None] * key_len + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def index_scores(index_q, index_k, index_weights) -> torch.Tensor:
    """``lightning_index_scores`` (``I[t, s] = sum_j w_tj relu(q_tj . k_s)``, ``[B, T, S]``
    fp32) for index_k ``[B, S, DI]``, in one kernel: each program holds a tile of the keys and
    adds every head's ``relu(q_j k^T) w_j`` into one fp32 tile (a ``tl.dot`` per head), so
    that neither the ``[B, T, HI, S]`` products nor their ReLU is ever stored. Precision as the
    loss's kernels (16-bit inputs on tensor cores with exact products and fp32 sums; fp32
    inputs in full fp32); the sum's order differs from PyTorch's, by fp32 rounding. All three
    in index_q's dtype; call only where ``routing.indexer_kernels_refusal`` allows."""
    index_k, index_weights = index_k.to(index_q.dtype), index_weights.to(index_q.dtype)
    batch, queries, heads, dim = index_q.shape
    key_len = index_k.shape[1]
    out = torch.empty(batch, queries, key_len, dtype=torch.float32, device=index_q.device)
    if out.numel():
        sizes = _sizes(index_q)
        grid = (triton.cdiv(queries, _SCORE_TILE[0]), triton.cdiv(key_len, _SCORE_TILE[1]),
                batch)
        _scores_kernel[grid](index_q.contiguous(), index_k.contiguous(),
                             index_weights.contiguous(), out, queries, key_len, heads,
                             DI=dim, DP=sizes["DP"], BLOCK_T=_SCORE_TILE[0],
                             BLOCK_S=_SCORE_TILE[1], PRECISION=sizes["PRECISION"],
                             num_warps=4, num_stages=2)
    return out


def _sizes(index_q: torch.Tensor) -> dict:
    heads, dim = index_q.shape[2:]
    return dict(DI=dim, HP=max(_MIN_DOT, triton.next_power_of_2(heads)),
                DP=max(_MIN_DOT, triton.next_power_of_2(dim)), BLOCK_K=_BLOCK_K,
                PRECISION="ieee" if index_q.dtype == torch.float32 else "tf32")


def _warps(sizes: dict) -> int:
    """4 warps, 8 for tiles of 64 x 128 and more (the backward holds dq, ``[HP, DP]`` fp32,
    besides the scores)."""
    return 8 if sizes["HP"] * sizes["DP"] >= 64 * 128 else 4


class _SelectedIndexerKL(torch.autograd.Function):
    """target ``[B, n, K]`` fp32, index_q ``[B, n, HI, DI]``, index_k ``[B, S, DI]``,
    index_weights ``[B, n, HI]`` (contiguous; these three of one dtype), selected
    ``[B, n, K]`` -> the summed KL, fp32 scalar."""

    @staticmethod
    def forward(ctx, target, index_q, index_k, index_weights, selected):
        batch, queries, heads, _ = index_q.shape
        shape = (queries, index_k.shape[1], heads, selected.shape[-1])
        sizes = _sizes(index_q)
        lse, mass, kl = (torch.zeros(batch, queries, dtype=torch.float32, device=index_q.device)
                         for _ in range(3))
        if kl.numel() and shape[-1]:
            _kl_forward_kernel[(batch * queries,)](
                index_q, index_k, index_weights, selected, target, lse, mass, kl, *shape,
                num_warps=_warps(sizes), num_stages=2, **sizes)
        ctx.save_for_backward(target, index_q, index_k, index_weights, selected, lse, mass)
        ctx.shape, ctx.sizes = shape, sizes
        return kl.sum()

    @staticmethod
    def backward(ctx, grad):
        target, index_q, index_k, index_weights, selected, lse, mass = ctx.saved_tensors
        dq, dw = torch.zeros_like(index_q), torch.zeros_like(index_weights)
        dk = torch.zeros(index_k.shape, dtype=torch.float32, device=index_k.device)
        if lse.numel() and ctx.shape[-1]:
            _kl_backward_kernel[(lse.numel(),)](
                index_q, index_k, index_weights, selected, target, lse, mass,
                grad.float().contiguous(), dq, dk, dw, *ctx.shape,
                num_warps=_warps(ctx.sizes), num_stages=2, **ctx.sizes)
        return None, dq, dk.to(index_k.dtype), dw, None


def selected_indexer_kl(target, index_q, index_k, index_weights, selected) -> torch.Tensor:
    """``sum_t KL(p_t || softmax(I_t))`` over each query's selected keys, fp32 scalar, with
    gradients to index_q, index_k and index_weights: :func:`reference_indexer_kl`'s value, on
    the kernels. ``target [B, n, K]``: the main attention's mass at each slot of
    ``selected [B, n, K]`` (no gradient; normalised here); index_q ``[B, n, HI, DI]``,
    index_weights ``[B, n, HI]``: the n queries'; index_k ``[B, S, DI]``: every key (both cast
    to index_q's dtype). Call only where ``routing.indexer_kernels_refusal`` and
    ``routing.selected_kernels_refusal`` allow."""
    index_k, index_weights = index_k.to(index_q.dtype), index_weights.to(index_q.dtype)
    tensors = (target.detach().float(), index_q, index_k, index_weights, selected)
    return _SelectedIndexerKL.apply(*(x.contiguous() for x in tensors))


def reference_indexer_kl(target, index_q, index_k, index_weights, selected) -> torch.Tensor:
    """:func:`selected_indexer_kl` in PyTorch, in fp32, with the keys gathered (for the checks)."""
    rows = torch.arange(index_k.shape[0], device=index_k.device).view(-1, 1, 1)
    keys = index_k.float()[rows, selected.clamp(min=0).long()]  # [B, n, K, DI]
    logits = lightning_index_scores(index_q.float(), keys, index_weights.float())
    return indexer_kl(target.float(), logits, selected >= 0)
