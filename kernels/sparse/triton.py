"""DSA's and CSA's per-token selected attention in our own Triton kernels, forward and backward
(backend "triton" of ``dsa_attention`` and ``csa_attention``; "auto" on CUDA once the first-use
check has passed, beyond the keys FlexAttention's bitmap path takes: ``SELECTED_FLEX_MAX_KEYS``
in ``__init__.py``). The indexer loss's target (:func:`selected_mass`) runs here under "auto".

What it computes: :func:`selected_attention`, the contract of ``dsa_attention_reference``. Each
query t attends to exactly the keys listed in its row of ``selected [B, T, K]`` (positions into
the S keys, shared by every head; -1: no key), with one softmax in fp32 per query head whose
denominator also holds ``exp(sink_h)`` when a sink is given. That is DSA's sparse attention
(DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556, sec. 2.1: each query attends to the top-k keys
its lightning indexer picked) and CSA's (DeepSeek-V4: the keys are the raw tokens of a sliding
window followed by the compressed entries, ``window_and_selected`` over ``with_entries``).

Layout: q ``[B, T, Hq, D]``, k and v ``[B, S, Hkv, D]``, made contiguous; query head h reads
key/value head ``h // G``, G = Hq / Hkv. Every kernel handles the G query heads of one key/value
head together, as the rows of its tiles: they share the keys (the selection is per token), so
each gathered key and value row is loaded once for the G heads.

Forward (``_forward_kernel``, one program per token and key/value head): a loop over the token's
K selected keys, BLOCK_K = 64 at a time, each key and value row loaded through its index (a
pointer gather; -1 and the lanes past K load nothing), an online softmax over the
``[rows, BLOCK_K]`` scores (FlashAttention's), accumulating in fp32. The rows are the G heads
padded to at least 16, the smallest tile ``tl.dot`` takes: the padding rows cost tensor-core
work that is free here, where the gathered loads bound the time (MHA, G = 1, still uses the
tensor cores). It stores o and each row's log-sum-exp L (natural log, the sink included).

Backward, with ``delta = rowsum(dO * o)`` per token and query head and ``p = exp(s - L)``:
``dv_s = sum_t p_ts dO_t``, ``dp_ts = dO_t . v_s``, ``ds_ts = p_ts (dp_ts - delta_t)``,
``dq_t = scale sum_s ds_ts k_s``, ``dk_s = scale sum_t ds_ts q_t``.

- ``_dq_kernel`` (as the forward, one program per token and key/value head): delta from the
  program's rows of dO and o (stored for the next kernel), then the loop over the selected keys
  recomputing p from L, and dq.
- ``_dkdv_kernel``, one program per key and key/value head. A key's gradient sums over the
  queries that selected it, which ``selected`` lists the other way round. Scattering each
  (query, key) pair's share with atomics (T K pairs, each a D-wide add per head, into the same
  hot keys: the first tokens, which every early query selects) would serialise on those keys,
  and atomics make the sums depend on the order. So the backward first transposes the
  selection in PyTorch into a CSR (:func:`_queries_by_key`: the valid pairs sorted by key with
  one stable sort, counts by ``bincount``, offsets by ``cumsum``), and each program loops over
  its key's queries, BLOCK_ROWS (query, head) rows at a time, gathering their q, dO, L and
  delta, accumulating dk and dv in fp32 and writing them once: no atomics, a deterministic
  result. The rows of one key meet a single key, so its products are matrix-vector ones
  (broadcast multiply and ``tl.sum``), not ``tl.dot``. Programs run keys in order, all heads of
  a key next to each other, so the keys selected most (in DSA, the early ones) start first.
- The sink's gradient, ``d sink_h = -sum_t exp(sink_h - L_th) delta_th`` (flash.py's), in
  PyTorch from L and delta.

The indexer loss's target (``_mass_kernel``, :func:`selected_mass`, no gradient; the loss over
it is triton_indexer.py's :func:`selected_indexer_kl`, exported here and checked with these): the
probabilities of this attention summed over the query heads, ``[B, T, K]`` fp32, which DSA's and
CSA's indexer losses fit in their sparse stage. It works on tiles of 64 queries by 64 keys, as
FlashAttention does, not on gathered rows: the selection becomes a bitmap (one bit per query and
key, ``triton_select.selection_words``), a tile whose queries list none of its keys is skipped,
and each key row is loaded once for the tile's 64 queries. One program per tile of queries makes
two passes over its key tiles: the log-sum-exp L of each query head (and its sink), then, per key
tile, ``exp(s - L)`` summed over the heads, written to the slot of each listed key. A row's slots
sorted by key (one ``argsort`` of the selection) give each key's slot from its rank among the
row's bits, counted along the tiles. Each row's bitmap words are loaded once a tile
(:func:`_selected_bits`).

Memory: kept for backward are q, k, v, o, ``selected`` and L (``[B, T, Hq]`` fp32): O(T K) ints
and O(T H D) activations, no ``[T, K, H, D]`` gather. The backward adds delta (as L) and, while
it runs, the CSR: an int32 query per slot of ``selected`` and B S + 1 offsets, built by a sort
that briefly holds about 16 bytes per slot (the int32 keys, their sorted copy and the int64
order) besides its scratch: some 1.1 GB at B T = 32768 and K = 2048, freed on return.

Semantics at the edges, the gathered path's (selected.py): a query with no valid key and no
sink (or a sink of -inf) outputs 0 and gets, and gives, zero gradients; its stored L is +inf,
so that every probability recomputed from it, ``exp(s - L)``, is 0. A key listed twice in a
row counts twice, as in the gathered path (the reference's mask counts it once); DSA's top-k
and CSA's window-and-entries rows list each key at most once, so that they agree. The mass
kernel needs that: it fills one slot per listed key.

Precision: fp32 inputs run every ``tl.dot`` in full fp32 ("ieee", not TF32); bf16 and fp16 on
tensor cores with fp32 accumulation, the probabilities (and ds) rounded to the inputs' dtype
before their products with v (and k), as FlashAttention does. Softmax statistics, L, delta and
every accumulator are fp32. Head dims up to 256, padded to a power of two (at least 16) with
masked loads.

Launch configuration (fixed): 4 warps, 2 stages for every kernel; BLOCK_K = 64 keys per step
(forward and dq), BLOCK_ROWS = 32 (query, head) rows per step of dk/dv (two fp32 tiles of
``[32, D]`` per step). Compiled for sm_90 without a GPU (Triton 3.6 and its ptxas), in bf16 at D =
128 and G <= 16: forward 192 registers, dq 255, dk/dv 230 to 235, none spilled (int64 offsets in
the gathers would spill 152 bytes in the forward and 484 in dq); at D = 256 they spill 0.1 to 0.75
KB per thread; the fp32 path (dots on FMA units) spills 0.5 KB and more at D = 128: it is there to
check the algebra, not for speed. On an H200 (Triton 3.6) they pass
tests/ops/test_sparse_triton.py; not tuned. Their loads bound them: each pass gathers
``B T K Hkv D`` keys (and values), 0.5 TB at B T = 32768, top-2048 and 16 MHA heads of 128 in
bf16; with fewer key/value heads (GQA, MQA) that shrinks by the group size. So FlexAttention over
the selection's bitmap is the faster fwd+bwd up to long sequences, and "auto" runs it up to
``SELECTED_FLEX_MAX_KEYS`` keys (dsa.py; benchmarks/dsa_stages.py)."""
from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

from ..first_use import passes_first_use_check, relative_error
from .reference import OP, _heads, _masked_probs, dsa_attention_reference, selected_mask
from .triton_indexer import reference_indexer_kl, selected_indexer_kl
from .triton_select import selection_words

__all__ = ["selected_attention", "selected_mass", "selected_indexer_kl", "check", "checked",
           "CHECK_TOLERANCE", "MAX_HEAD_DIM"]

_log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_K = 64
_BLOCK_ROWS = 32
_MASS_BLOCK = 64  # queries and keys per tile of the mass kernel
_MIN_DOT = 16  # the smallest tile side tl.dot takes
_NUM_WARPS = 4
_NUM_STAGES = 2
# The running maximum of a row starts here, not at -inf, so that a block of masked keys (scores
# of -inf) never computes exp(-inf - -inf).
_FLOOR = tl.constexpr(-1e30)
# Relative error (Frobenius norm) the first-use check allows on the output and each gradient:
# in fp32 the kernels and the reference add the same products in another order (~1e-6); in 16
# bits q, k, v and o are rounded anyway and the kernels also round p and ds (a few 1e-3).
CHECK_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


# ---------------------------------------------------------------------------------------------
# Helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _group_rows(ptr, token, kv_head, q_heads, group, D: tl.constexpr, DP: tl.constexpr,
                ROWS: tl.constexpr):
    """The ``[ROWS, DP]`` tile of ``token``'s query heads ``kv_head * group + r`` (r < group;
    zero elsewhere and in the columns from D) of a contiguous ``[tokens, Hq, D]`` tensor, in its
    dtype, with the rows' flat (token, head) indices and which of them are real."""
    r = tl.arange(0, ROWS)
    d = tl.arange(0, DP)
    rows = token * q_heads + kv_head * group + r
    real = r < group
    tile = tl.load(ptr + rows[:, None] * D + d[None, :], mask=real[:, None] & (d < D)[None, :],
                   other=0.0)
    return tile, rows, real


@triton.jit
def _kv_base(ptr, batch, key_len, kv_heads, kv_head, D: tl.constexpr):
    """Pointer to key 0 of batch row ``batch`` (int64) and ``kv_head`` in a contiguous
    ``[B, S, Hkv, D]`` tensor; key s of the row is ``s Hkv D`` further, an int32 offset (the
    host keeps S Hkv D below 2^31), which keeps the gathers' address arithmetic 32-bit (with
    int64 offsets, ptxas spilled in the forward and dq kernels at D = 128)."""
    return ptr + (batch * key_len * kv_heads + kv_head) * D


@triton.jit
def _token_program(k_ptr, v_ptr, seq_len, key_len, kv_heads, D: tl.constexpr):
    """A [B T Hkv] grid's program: its token (b T + t, int64), key/value head, and the
    :func:`_kv_base` pointers of that head's keys and values."""
    pid = tl.program_id(0).to(tl.int64)
    token, kv_head = pid // kv_heads, pid % kv_heads
    keys = _kv_base(k_ptr, token // seq_len, key_len, kv_heads, kv_head, D)
    values = _kv_base(v_ptr, token // seq_len, key_len, kv_heads, kv_head, D)
    return token, kv_head, keys, values


@triton.jit
def _softmax_start(sink_ptr, kv_head, group, real, ROWS: tl.constexpr, HAS_SINK: tl.constexpr):
    """The online softmax's start for the group's rows: the running maximum and the running sum
    of exp(score - maximum). The sink is one more logit per row with a zero value, so the
    softmax starts from it (without a sink, from nothing: a sum of 0)."""
    if HAS_SINK:
        sink = tl.load(sink_ptr + kv_head * group + tl.arange(0, ROWS), mask=real,
                       other=float("-inf"))
    else:
        sink = tl.full([ROWS], float("-inf"), tl.float32)
    top = tl.maximum(sink, _FLOOR)
    return top, tl.exp(sink - top)


@triton.jit
def _selected_keys(sel_ptr, token, start, top_k, kv_heads, BLOCK_K: tl.constexpr):
    """Keys ``start .. start + BLOCK_K - 1`` of ``token``'s selection: their rows ``s Hkv``
    (int32) from :func:`_kv_base` in rows of D, and which are real (inside K, not -1)."""
    j = start + tl.arange(0, BLOCK_K)
    index = tl.load(sel_ptr + token * top_k + j, mask=j < top_k, other=-1).to(tl.int32)
    return index * kv_heads, index >= 0


@triton.jit
def _key_tile(base, key_rows, valid, D: tl.constexpr, DP: tl.constexpr,
              TRANSPOSED: tl.constexpr):
    """The gathered rows ``key_rows`` (zero where not valid) of the ``[rows, D]`` keys or
    values at ``base``: ``[BLOCK_K, DP]``, or its transpose ``[DP, BLOCK_K]``, loaded
    transposed."""
    d = tl.arange(0, DP)
    if TRANSPOSED:
        return tl.load(base + key_rows[None, :] * D + d[:, None],
                       mask=valid[None, :] & (d < D)[:, None], other=0.0)
    else:
        return tl.load(base + key_rows[:, None] * D + d[None, :],
                       mask=valid[:, None] & (d < D)[None, :], other=0.0)


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seq_len", "key_len", "kv_heads", "group", "top_k"])
def _forward_kernel(q_ptr, k_ptr, v_ptr, sel_ptr, sink_ptr, o_ptr, lse_ptr, seq_len, key_len,
                    kv_heads, group, top_k, scale, D: tl.constexpr, DP: tl.constexpr,
                    ROWS: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SINK: tl.constexpr,
                    PRECISION: tl.constexpr):
    """o and L of one token (b T + t) and key/value head, grid [B T Hkv]."""
    token, kv_head, keys, values = _token_program(k_ptr, v_ptr, seq_len, key_len, kv_heads, D)
    q, rows, real = _group_rows(q_ptr, token, kv_head, kv_heads * group, group, D, DP, ROWS)
    top, total = _softmax_start(sink_ptr, kv_head, group, real, ROWS, HAS_SINK)
    acc = tl.zeros([ROWS, DP], dtype=tl.float32)
    for start in range(0, top_k, BLOCK_K):
        key_rows, valid = _selected_keys(sel_ptr, token, start, top_k, kv_heads, BLOCK_K)
        scores = tl.dot(q, _key_tile(keys, key_rows, valid, D, DP, True),
                        input_precision=PRECISION) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        rescale = tl.exp(top - new_top)
        p = tl.exp(scores - new_top[:, None])
        total = total * rescale + tl.sum(p, 1)
        v = _key_tile(values, key_rows, valid, D, DP, False)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        top = new_top
    has_mass = total > 0
    out = acc / tl.where(has_mass, total, 1.0)[:, None]
    d = tl.arange(0, DP)
    tl.store(o_ptr + rows[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=real[:, None] & (d < D)[None, :])
    tl.store(lse_ptr + rows, tl.where(has_mass, top + tl.log(total), float("inf")), mask=real)


@triton.jit(do_not_specialize=["seq_len", "key_len", "kv_heads", "group", "top_k"])
def _dq_kernel(q_ptr, k_ptr, v_ptr, sel_ptr, o_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
               seq_len, key_len, kv_heads, group, top_k, scale, D: tl.constexpr,
               DP: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr):
    """delta and dq of one token and key/value head, grid [B T Hkv]."""
    token, kv_head, keys, values = _token_program(k_ptr, v_ptr, seq_len, key_len, kv_heads, D)
    q_heads = kv_heads * group
    q, rows, real = _group_rows(q_ptr, token, kv_head, q_heads, group, D, DP, ROWS)
    d_out, _, _ = _group_rows(do_ptr, token, kv_head, q_heads, group, D, DP, ROWS)
    out, _, _ = _group_rows(o_ptr, token, kv_head, q_heads, group, D, DP, ROWS)
    delta = tl.sum(d_out.to(tl.float32) * out.to(tl.float32), 1)
    tl.store(delta_ptr + rows, delta, mask=real)
    lse = tl.load(lse_ptr + rows, mask=real, other=float("inf"))
    acc = tl.zeros([ROWS, DP], dtype=tl.float32)
    for start in range(0, top_k, BLOCK_K):
        key_rows, valid = _selected_keys(sel_ptr, token, start, top_k, kv_heads, BLOCK_K)
        scores = tl.dot(q, _key_tile(keys, key_rows, valid, D, DP, True),
                        input_precision=PRECISION) * scale
        p = tl.where(valid[None, :], tl.exp(scores - lse[:, None]), 0.0)
        dp = tl.dot(d_out, _key_tile(values, key_rows, valid, D, DP, True),
                    input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        k = _key_tile(keys, key_rows, valid, D, DP, False)  # the same rows, not transposed
        acc += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    d = tl.arange(0, DP)
    tl.store(dq_ptr + rows[:, None] * D + d[None, :], (acc * scale).to(dq_ptr.dtype.element_ty),
             mask=real[:, None] & (d < D)[None, :])


@triton.jit(do_not_specialize=["kv_heads", "group"])
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, offsets_ptr, queries_ptr,
                 dk_ptr, dv_ptr, kv_heads, group, scale, D: tl.constexpr, DP: tl.constexpr,
                 GP: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """dk and dv of one key (b S + s) and key/value head, grid [B S Hkv]: a loop over the
    queries that selected the key (the CSR), BLOCK_ROWS // GP queries of GP rows (their heads
    of the group, padded to a power of two) at a time."""
    pid = tl.program_id(0).to(tl.int64)
    key, kv_head = pid // kv_heads, pid % kv_heads
    q_heads = kv_heads * group
    d = tl.arange(0, DP)
    in_dim = d < D
    key_row = key * kv_heads + kv_head
    k = tl.load(k_ptr + key_row * D + d, mask=in_dim, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + key_row * D + d, mask=in_dim, other=0.0).to(tl.float32)
    first = tl.load(offsets_ptr + key)
    end = tl.load(offsets_ptr + key + 1)
    r = tl.arange(0, BLOCK_ROWS)
    pair, head = r // GP, r % GP  # row r: query `pair` of the step, head `head` of the group
    dk = tl.zeros([DP], dtype=tl.float32)
    dv = tl.zeros([DP], dtype=tl.float32)
    for start in range(first, end, BLOCK_ROWS // GP):
        valid = (start + pair < end) & (head < group)
        query = tl.load(queries_ptr + start + pair, mask=valid, other=0).to(tl.int64)
        rows = query * q_heads + kv_head * group + head
        at, tile_mask = rows[:, None] * D + d[None, :], valid[:, None] & in_dim[None, :]
        q = tl.load(q_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
        d_out = tl.load(do_ptr + at, mask=tile_mask, other=0.0).to(tl.float32)
        lse = tl.load(lse_ptr + rows, mask=valid, other=float("inf"))
        delta = tl.load(delta_ptr + rows, mask=valid, other=0.0)
        p = tl.where(valid, tl.exp(tl.sum(q * k[None, :], 1) * scale - lse), 0.0)
        dv += tl.sum(p[:, None] * d_out, 0)
        ds = p * (tl.sum(d_out * v[None, :], 1) - delta)
        dk += tl.sum(ds[:, None] * q, 0)
    tl.store(dk_ptr + key_row * D + d, (dk * scale).to(dk_ptr.dtype.element_ty), mask=in_dim)
    tl.store(dv_ptr + key_row * D + d, dv.to(dv_ptr.dtype.element_ty), mask=in_dim)


@triton.jit
def _selected_bits(words_ptr, token, width, start, real, key_len, BLOCK_S: tl.constexpr):
    """``[rows, BLOCK_S]`` bool: whether row ``token`` (int64, ``[rows]``) of the selection's
    bitmap (``triton_select.selection_words``: ``width`` int32 words a row) lists each of the
    keys ``start .. start + BLOCK_S - 1`` (``start`` and BLOCK_S multiples of 32). The rows'
    BLOCK_S / 32 words are loaded once, a ``[rows, BLOCK_S / 32]`` tile, and their bits spread
    over the keys in registers: compiled for sm_90 (Triton 3.6, the mass kernel's 64 x 64 tiles,
    4 warps) that is 2 scalar loads a thread, against 64 when loading a word for every (row, key)
    pair."""
    keys = start + tl.arange(0, BLOCK_S)
    slots = start // 32 + tl.arange(0, BLOCK_S // 32)
    word = tl.load(words_ptr + token[:, None] * width + slots[None, :],
                   mask=real[:, None] & (slots * 32 < key_len)[None, :], other=0)
    bits = (word[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    listed = tl.reshape(bits, [token.shape[0], BLOCK_S]) != 0
    return listed & (keys < key_len)[None, :]


@triton.jit(do_not_specialize=["seq_len", "key_len", "width", "kv_heads", "group", "top_k"])
def _mass_kernel(q_ptr, k_ptr, words_ptr, ends_ptr, order_ptr, sink_ptr, lse_ptr, mass_ptr,
                 seq_len, key_len, width, kv_heads, group, top_k, scale, D: tl.constexpr,
                 DP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                 HAS_SINK: tl.constexpr, HAS_LSE: tl.constexpr, PRECISION: tl.constexpr):
    """:func:`selected_mass` for BLOCK_T queries, grid [B T / BLOCK_T], the latest tiles first:
    over the ``[BLOCK_T, BLOCK_S]`` tiles of (query, key) pairs whose queries list any of the
    keys (the selection's bitmap), up to the last key any of them lists, ``ends_ptr``. Phase 1
    (unless HAS_LSE: then ``lse_ptr`` holds L already), one query head after the other: the
    head's log-sum-exp L over its rows' keys (and the sink), kept in ``lse_ptr``. Phase 2, one
    key tile after the other: ``exp(s - L)`` summed over every query head into the tile, stored
    at each listed key's slot: a row's listed keys in ascending order are its slots
    ``order_ptr[rank]`` (rank: the keys it lists before)."""
    tiles = tl.cdiv(seq_len, BLOCK_T)
    pid = tl.program_id(0)
    batch, tile = pid // tiles, tiles - 1 - pid % tiles
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    real = t < seq_len
    token = batch.to(tl.int64) * seq_len + t
    end = tl.load(ends_ptr + batch * tiles + tile)
    d = tl.arange(0, DP)
    q_heads = kv_heads * group
    q_rows = token[:, None] * q_heads * D + d[None, :]
    q_mask = real[:, None] & (d < D)[None, :]
    s_lanes = tl.arange(0, BLOCK_S)
    if not HAS_LSE:
        for h in range(q_heads):
            q = tl.load(q_ptr + q_rows + h * D, mask=q_mask, other=0.0)
            keys = _kv_base(k_ptr, batch.to(tl.int64), key_len, kv_heads, h // group, D)
            if HAS_SINK:
                sink = tl.load(sink_ptr + h + tl.zeros([BLOCK_T], tl.int32))
            else:
                sink = tl.full([BLOCK_T], float("-inf"), tl.float32)
            top = tl.maximum(sink, _FLOOR)
            total = tl.exp(sink - top)
            for start in range(0, end, BLOCK_S):
                s = start + s_lanes
                listed = _selected_bits(words_ptr, token, width, start, real, key_len, BLOCK_S)
                if tl.max(listed.to(tl.int32)) > 0:
                    scores = tl.dot(q, _key_tile(keys, s * kv_heads, s < key_len, D, DP, True),
                                    input_precision=PRECISION) * scale
                    scores = tl.where(listed, scores, float("-inf"))
                    new_top = tl.maximum(top, tl.max(scores, 1))
                    total = (total * tl.exp(top - new_top)
                             + tl.sum(tl.exp(scores - new_top[:, None]), 1))
                    top = new_top
            lse = tl.where(total > 0, top + tl.log(total), float("inf"))
            tl.store(lse_ptr + token * q_heads + h, lse, mask=real)
    before = tl.zeros([BLOCK_T], tl.int32)  # each row's keys listed in the tiles done
    for start in range(0, end, BLOCK_S):
        s = start + s_lanes
        listed = _selected_bits(words_ptr, token, width, start, real, key_len, BLOCK_S)
        count = listed.to(tl.int32)
        if tl.max(count) > 0:
            total = tl.zeros([BLOCK_T, BLOCK_S], tl.float32)
            for h in range(q_heads):
                q = tl.load(q_ptr + q_rows + h * D, mask=q_mask, other=0.0)
                keys = _kv_base(k_ptr, batch.to(tl.int64), key_len, kv_heads, h // group, D)
                scores = tl.dot(q, _key_tile(keys, s * kv_heads, s < key_len, D, DP, True),
                                input_precision=PRECISION) * scale
                lse = tl.load(lse_ptr + token * q_heads + h, mask=real, other=float("inf"))
                total += tl.where(listed, tl.exp(scores - lse[:, None]), 0.0)
            rank = before[:, None] + tl.cumsum(count, 1) - count
            slot = tl.load(order_ptr + token[:, None] * top_k + rank, mask=listed, other=0)
            tl.store(mass_ptr + token[:, None] * top_k + slot, total, mask=listed)
        before += tl.sum(count, 1)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

def _precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: full fp32 ("ieee", not TF32) for fp32 inputs; for 16-bit ones
    Triton's default, "tf32", which only concerns fp32 operands."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _queries_by_key(selected: torch.Tensor, key_len: int):
    """The selection transposed, as a CSR over the B S keys: ``offsets [B S + 1]`` (int64) and
    ``queries`` (int32), where ``queries[offsets[j]:offsets[j + 1]]`` are the flat queries
    b T + t that selected key j = b S + s, in token order (entries past ``offsets[-1]`` are the
    -1 slots, never read)."""
    batch, seq_len, top_k = selected.shape
    keys = batch * key_len  # a -1 becomes this key, after every real one
    flat = selected.int() + (torch.arange(batch, dtype=torch.int32, device=selected.device)
                             * key_len).view(-1, 1, 1)
    flat = flat.masked_fill(selected < 0, keys).flatten()
    order = torch.sort(flat, stable=True).indices  # by key, then by position: by token
    counts = torch.bincount(flat, minlength=keys + 1)[:keys]
    offsets = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    return offsets, order.div_(top_k, rounding_mode="floor").int()


class _SelectedAttention(torch.autograd.Function):
    """q ``[B, T, Hq, D]``, k, v ``[B, S, Hkv, D]`` (contiguous, one dtype), selected
    ``[B, T, K]`` (contiguous), an fp32 sink ``[Hq]`` or None -> o ``[B, T, Hq, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, selected, sink, scale):
        batch, seq_len, q_heads, dim = q.shape
        key_len, kv_heads = k.shape[1], k.shape[2]
        sizes = dict(D=dim, DP=max(_MIN_DOT, triton.next_power_of_2(dim)),
                     ROWS=max(_MIN_DOT, triton.next_power_of_2(q_heads // kv_heads)),
                     BLOCK_K=_BLOCK_K, PRECISION=_precision(q.dtype), num_warps=_NUM_WARPS,
                     num_stages=_NUM_STAGES)
        out = torch.empty_like(q, dtype=v.dtype)
        lse = torch.empty(batch, seq_len, q_heads, dtype=torch.float32, device=q.device)
        shape = (seq_len, key_len, kv_heads, q_heads // kv_heads, selected.shape[-1], scale)
        if out.numel():
            _forward_kernel[(batch * seq_len * kv_heads,)](
                q, k, v, selected, lse if sink is None else sink, out, lse, *shape,
                HAS_SINK=sink is not None, **sizes)
        ctx.save_for_backward(q, k, v, selected, sink, out, lse)
        ctx.shape, ctx.sizes = shape, sizes
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, selected, sink, out, lse = ctx.saved_tensors
        seq_len, key_len, kv_heads, group, _, scale = ctx.shape
        sizes = ctx.sizes
        d_out = d_out.contiguous()
        tokens, keys = q.shape[0] * seq_len, k.shape[0] * key_len
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        delta = torch.empty_like(lse)
        if tokens:
            _dq_kernel[(tokens * kv_heads,)](q, k, v, selected, out, d_out, lse, delta, dq,
                                             *ctx.shape, **sizes)
        if keys:
            offsets, queries = _queries_by_key(selected, key_len)
            _dkdv_kernel[(keys * kv_heads,)](
                q, k, v, d_out, lse, delta, offsets, queries, dk, dv, kv_heads, group, scale,
                D=sizes["D"], DP=sizes["DP"], GP=triton.next_power_of_2(group),
                BLOCK_ROWS=max(_BLOCK_ROWS, triton.next_power_of_2(group)),
                num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
        d_sink = None
        if sink is not None and ctx.needs_input_grad[4]:
            d_sink = -(torch.exp(sink - lse) * delta).sum((0, 1))
        return dq, dk, dv, None, d_sink, None


def selected_attention(q, k, v, selected, *, sink=None, scale=None) -> torch.Tensor:
    """Same contract as ``dsa_attention_reference`` (and selected.py's gathered
    ``selected_attention``), on the kernels. Call only where
    ``routing.selected_kernels_refusal`` allows."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v, selected = (x.contiguous() for x in (q, k, v, selected))
    wide_sink = None if sink is None else sink.float().contiguous()
    return _SelectedAttention.apply(q, k, v, selected, wide_sink, scale)


def selected_mass(q, k, selected, *, sink=None, scale=None, lse=None) -> torch.Tensor:
    """The probabilities of ``selected_attention`` summed over the query heads, without
    gradient: ``[B, T, K]`` fp32, ``mass[b, t, j] = sum_h p_h(t, selected[b, t, j])`` (0 at -1).
    DSA's indexer loss takes it as its target (arXiv 2512.02556, sec. 2.1). A row lists each
    key at most once (as DSA's top-k and CSA's selections do). ``lse`` (``[B, T, Hq]`` fp32, or
    None): that attention's log-sum-exp of each query head, the sink included (+inf for a
    query with neither a key nor a sink), where the attention has computed it; the kernel then
    skips its first phase, which computes it (``benchmarks/dsa_stages.py`` times both:
    ``loss_given_lse`` and ``loss``).
    Call only where ``routing.selected_kernels_refusal`` allows (k for v).

    On tiles of the selection's bitmap (``_mass_kernel``); besides the result it holds the
    bitmap (``B T S / 8`` bytes), each row's slots in ascending key order (int32, as
    ``selected``) and L (``[B, T, Hq]`` fp32), and while it sorts, the sort's keys and its int64
    order."""
    batch, seq_len, q_heads, dim = q.shape
    key_len, kv_heads = k.shape[1], k.shape[2]
    scale = dim ** -0.5 if scale is None else float(scale)
    if lse is not None and (tuple(lse.shape) != (batch, seq_len, q_heads)
                            or lse.dtype != torch.float32):
        raise ValueError(f"{OP}: the attention's lse must be fp32 [B, T, Hq] = "
                         f"{[batch, seq_len, q_heads]}; got {lse.dtype} {list(lse.shape)}")
    q, k, selected = (x.detach().contiguous() for x in (q, k, selected))
    wide_sink = None if sink is None else sink.detach().float().contiguous()
    top_k = selected.shape[-1]
    mass = torch.zeros(batch, seq_len, top_k, dtype=torch.float32, device=q.device)
    if not mass.numel() or not key_len:
        return mass
    width = triton.cdiv(key_len, 32)
    words = selection_words(selected, seq_len, width)
    # -1 (no key) sorts after every key, so that rank r of a row's listed keys is slot order[r]
    order = selected.masked_fill(selected < 0, key_len).argsort(-1).int()
    tiles = triton.cdiv(seq_len, _MASS_BLOCK)
    last = torch.nn.functional.pad(selected.amax(-1), (0, tiles * _MASS_BLOCK - seq_len),
                                   value=-1)
    ends = (last.view(batch, tiles, _MASS_BLOCK).amax(-1) + 1).int()
    given_lse = lse is not None
    lse = (lse.detach().contiguous() if given_lse else
           torch.empty(batch, seq_len, q_heads, dtype=torch.float32, device=q.device))
    _mass_kernel[(batch * tiles,)](
        q, k, words, ends, order, mass if wide_sink is None else wide_sink, lse, mass, seq_len,
        key_len, width, kv_heads, q_heads // kv_heads, top_k, scale, D=dim,
        DP=max(_MIN_DOT, triton.next_power_of_2(dim)), BLOCK_T=_MASS_BLOCK, BLOCK_S=_MASS_BLOCK,
        HAS_SINK=wide_sink is not None, HAS_LSE=given_lse, PRECISION=_precision(q.dtype),
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    return mass


@functools.cache
def checked(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels passed their first-use check (:func:`check`) on ``device`` in
    ``dtype``; run once, a failure logged once."""
    return passes_first_use_check(check, device, dtype, CHECK_TOLERANCE[dtype],
                                  "the selected-attention Triton kernels",
                                  "the gathered path runs instead", _log)


@torch.inference_mode(False)  # a first use under inference mode checks as any other
def check(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The first-use check: the worst relative error (Frobenius norm) of the output ("o"), of
    each gradient ("grad_q", ...), of :func:`selected_mass` ("mass"; "mass_given_lse", given
    the reference's log-sum-exp) and of
    :func:`selected_indexer_kl` ("indexer_kl", "grad_index_q", ...; :func:`_check_indexer_kl`)
    over these calls in ``dtype`` against the fp32 reference on the same rounded values, 4 query
    heads on 2 key/value heads (and, without a sink, 2 on 2), head dims 64 and 128, 2 x 24
    queries over 2 x 96 keys: query t picks 67 keys (one full block of 64 and a partial one) at
    random among the first 4 (t + 1), so that the rows of the first 16 queries are padded with
    -1 (at random places), and the rows of 2 queries are all -1."""
    generator = torch.Generator(device=device).manual_seed(0)
    batch, seq_len, key_len, top_k = 2, 24, 96, 67
    # K of each query's candidates at random (the top K of random scores), -1 past them.
    candidates = (torch.arange(key_len, device=device)[None, :]
                  < 4 * torch.arange(1, seq_len + 1, device=device)[:, None])
    scores = torch.rand(batch, seq_len, key_len, device=device, generator=generator)
    picked = scores.masked_fill(~candidates, -1.0).topk(top_k, dim=-1)
    selected = picked.indices.masked_fill(picked.values < 0, -1)
    shuffle = torch.rand(batch, seq_len, top_k, device=device, generator=generator).argsort(-1)
    selected = selected.gather(-1, shuffle).int()
    selected[:, [5, 20]] = -1
    calls = [(4, 2, 64, True), (4, 2, 128, True), (2, 2, 64, False)]
    worst = {}
    with torch.autocast(device.type, enabled=False), torch.enable_grad():
        for q_heads, kv_heads, dim, with_sink in calls:
            def randn(*shape):
                return torch.randn(*shape, device=device, generator=generator)

            leaves = {"q": randn(batch, seq_len, q_heads, dim),
                      "k": randn(batch, key_len, kv_heads, dim),
                      "v": randn(batch, key_len, kv_heads, dim)}
            leaves = {key: x.to(dtype).float() for key, x in leaves.items()}
            if with_sink:
                leaves["sink"] = randn(q_heads)
            grad = randn(batch, seq_len, q_heads, dim)
            results = []
            for run, cast in ((selected_attention, dtype),
                              (dsa_attention_reference, torch.float32)):
                inputs = {key: (x.to(cast) if key != "sink" else x).requires_grad_()
                          for key, x in leaves.items()}
                out = run(inputs["q"], inputs["k"], inputs["v"], selected, sink=inputs.get("sink"))
                grads = torch.autograd.grad(out.float(), list(inputs.values()), grad)
                results.append([out.float(), *(g.float() for g in grads)])
            names = ["o", *(f"grad_{key}" for key in leaves)]
            rounded = (leaves["q"].to(dtype), leaves["k"].to(dtype), selected)
            exact = (leaves["q"], leaves["k"], selected, leaves.get("sink"))
            results[0] += [selected_mass(*rounded, sink=leaves.get("sink")),
                           selected_mass(*rounded, sink=leaves.get("sink"),
                                         lse=reference_lse(*exact))]
            results[1] += [reference_mass(*exact)] * 2
            for name, got, want in zip(names + ["mass", "mass_given_lse"], *results):
                worst[name] = max(worst.get(name, 0.0), relative_error(got, want))
        worst.update(_check_indexer_kl(selected, dtype, generator))
    return worst


def _check_indexer_kl(selected, dtype, generator) -> dict[str, float]:
    """:func:`check`'s part for :func:`selected_indexer_kl`: its value and gradients against
    ``reference_indexer_kl`` on the same rounded values, 4 indexer heads of dim 32, a random
    target (0 at the -1 slots, so 0 for the two empty rows); the early keys, candidates of
    every query, meet in the atomic adds of index_k's gradient."""
    device = selected.device
    batch, seq_len, top_k = selected.shape
    leaves = [torch.randn(*shape, device=device, generator=generator).to(dtype).float()
              for shape in ((batch, seq_len, 4, 32), (batch, 96, 32), (batch, seq_len, 4))]
    target = torch.rand(batch, seq_len, top_k, device=device, generator=generator)
    target = target * (selected >= 0)
    results = []
    for run, cast in ((selected_indexer_kl, dtype), (reference_indexer_kl, torch.float32)):
        inputs = [x.to(cast).requires_grad_() for x in leaves]
        loss = run(target, *inputs, selected)
        results.append([loss.detach(), *(g.float() for g in torch.autograd.grad(loss, inputs))])
    names = ["indexer_kl", "grad_index_q", "grad_index_k", "grad_index_weights"]
    return {name: relative_error(got, want) for name, got, want in zip(names, *results)}


def reference_mass(q, k, selected, sink=None, scale=None) -> torch.Tensor:
    """:func:`selected_mass` by the dense fp32 definition (for the checks)."""
    allowed = selected_mask(selected, k.shape[1])[:, None]
    mass = _masked_probs(q, k, allowed, sink, scale).sum(1)  # [B, T, S]
    return mass.gather(-1, selected.clamp(min=0).long()) * (selected >= 0)


def reference_lse(q, k, selected, sink=None, scale=None) -> torch.Tensor:
    """The log-sum-exp :func:`selected_mass` takes as ``lse`` (as ``dsa_attention`` returns it),
    ``[B, T, Hq]`` fp32, by the dense fp32 definition (for the checks): each query head's
    scaled scores over its selected keys, and the sink; +inf for a query with neither."""
    heads, dim = q.shape[2:]
    scale = dim ** -0.5 if scale is None else scale
    scores = q.float().transpose(1, 2) @ _heads(k, heads).transpose(-1, -2) * scale
    scores = scores.masked_fill(~selected_mask(selected, k.shape[1])[:, None], float("-inf"))
    if sink is not None:
        column = sink.float().view(1, heads, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    lse = scores.logsumexp(-1).transpose(1, 2)
    return lse.masked_fill(lse == float("-inf"), float("inf")).contiguous()
