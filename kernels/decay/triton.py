"""Decaying linear attention in our own Triton kernels, forward and backward, by chunks of 64
tokens: the "triton" backend of ``decay_linear_attention``.

The chunkwise form is the one of chunked.py: intra-chunk attention with relative decays plus an
inter-chunk state pass, as in Sun et al., "Retentive Network: A Successor to Transformer for
Large Language Models" (2023, a constant decay per head), Qin et al., "Lightning Attention-2: A
Free Lunch for Handling Unlimited Sequence Lengths in Large Language Models" (2024, intra/inter
blocks), Dao and Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through
Structured State Space Duality" (ICML 2024, Mamba-2 SSD, a scalar decay per head and token) and
Yang, Wang, Shen, Panda and Kim, "Gated Linear Attention Transformers with Hardware-Efficient
Training" (ICML 2024, GLA, a decay per key channel, with secondary chunks).

Forward, per head, for a chunk of C = 64 tokens entered with state S_0 = h_c (tokens are rows,
G the cumulative log-decay inside the chunk, per key channel or one per head, G_C its last row):

    O       = scale * ((exp(G) * q) S_0 + P V),  P_ts = sum_c q_tc k_sc exp(G_tc - G_sc), s <= t
    S_next  = Diag(exp G_C) S_0 + (exp(G_C - G) * k)^T V

Kernels (grids in brackets; N sequences, Hv value heads, NC chunks over all sequences):
    _cumsum_kernel    [NC, Hv]          G, fp32, from g (the constant [Hv] form is read with a
                                        token stride of 0, never materialised)
    _states_kernel    [N*Hv, K/BK*V/BV] the state pass: loops over the sequence's chunks and
                                        stores each chunk's entry state h_c, and the final state
    _scores_kernel    [NC, Hv]          per-channel decay only: P, fp32, into [T, Hv, 64]
    _output_kernel    [NC, Hv, V/BV]    O from q, v, G, h_c and P (formed in place for a scalar
                                        decay or none, read for a per-channel one)
Backward, with dO and dS_N (the gradient of the final state):
    _states_kernel again (h_c is recomputed, not kept from the forward), _scores_kernel again
    _dstates_kernel   [N*Hv, K/BK*V/BV] the reverse pass: dh'_c, the gradient of the state after
                                        chunk c, dh'_{c-1} = Diag(exp G_C) dh'_c + scale (exp(G) q)^T dO;
                                        what is left at the start is the initial state's gradient;
                                        with a decay also sum_v S_C * dh'_c (below)
    _dv_kernel        [NC, Hv, V/BV]    dV = scale P^T dO + (exp(G_C - G) k) dh'_c
    _dscores_kernel   [NC, Hv]          per-channel decay only: dP = scale dO V^T, masked, fp32,
                                        over P's buffer
    _dqk_kernel       [NC, Hv, K/BK]    dQ = scale (dO h_c^T) * exp(G) + (dP o D) K,
                                        dK = (V dh'_c^T) * exp(G_C - G) + (dP o D)^T Q,
                                        D_ts = exp(G_t - G_s), and dg (below)
The chunks are those of kernels/chunks.py (ChunkLayout, C = CHUNK = 64, BT in the kernels): the
[NC, ...] kernels find their chunk's tokens in its ``chunks`` table (chunk_rows), the two state
passes walk a sequence's tokens from ``cu`` and take its first chunk's index from ``seq_chunks``.

The decay's gradient, chunk by chunk. Inside chunk c the loss depends on the chunk-local G
only through factors exp(G_t) next to q_t (the inter-chunk read), exp(G_t - G_s) between q_t and
k_s (P), exp(G_C - G_s) next to k_s and exp(G_C) on S_0 in S_C, the state after the chunk
(S_C = Diag(exp G_C) S_0 + sum_s Diag(exp(G_C - G_s)) k_s v_s^T; later chunks see G only
through S_C). Since d/dG of (q exp(G)) is q times d/dq, per key channel

    dL/dG_t = q_t * dq_t - k_t * dk_t + [t = C] sum_v (S_C * dh'_c)[:, v],

with dq, dk the full gradients of this v head's q and k (before grouped heads are summed; dk
includes the path through S_C) and the last term the one exp(G_C) left unpaired with k. g_t enters
G_u for the u >= t of its chunk, so dg_t = sum_{u >= t in the chunk} dL/dG_u: a reverse cumulative
sum inside the chunk, started from the state term. For a scalar decay per token the channels are
summed; the constant form g [Hv] enters every token of every sequence, so its gradient is the sum
of the per-token ones over all tokens. Everything here is fp32 (dq and dk before they are rounded
to the inputs' dtype), and a sum never runs past a chunk, so rounding does not build up over long
sequences (checked in fp16 at T = 1024: the same error as at T = 65).

Numerics: every exponent is a causal sum of log-decays, G_t - G_s with t >= s, G_t, or
G_C - G_s, so it is <= 0 when g <= 0 and nothing overflows however strong the decay. With a
scalar decay D factors out of the sum over channels and P = (q k^T) o D is one matmul of the
whole chunk. With a per-channel decay it does not; the chunk is cut into sub-chunks of BC = 16
tokens and each block of P (and of dP's products) with its key sub-chunk before its query
sub-chunk is a plain matmul through a reference token r between them:

    exp(G_t - G_s) = exp(G_t - G_r) * exp(G_r - G_s),    s <= r <= t,

both exponents <= 0 (r: the first token of the query sub-chunk for P and dQ, the last token of
the key sub-chunk for dK). The 16 x 16 blocks on the diagonal, with no such r, are summed
exactly, one key (or query) token at a time. No [C, C, K] tensor is ever formed. Tokens past the
end of a sequence inside its last chunk read q = k = v = 0 and the G of the last token, so they
change nothing and decay nothing. Accumulation is fp32; tl.dot takes the inputs' dtype (the
chunk states h_c and dh'_c are stored in it), with input_precision "ieee" for fp32 inputs, so
that fp32 runs are not TF32-rounded. The exception: with a decay, the two state passes keep the
decayed k (and q) tiles in fp32, which for bf16 and fp16 inputs tl.dot rounds to TF32 (10
mantissa bits, bf16 has 7). The running state carries the rounding of these tiles into every
later chunk, and the decay's gradient, a small difference of large sums, magnifies it: rounded to
bf16 they would make a relative error of 2.3e-2 in the gradient of a constant g (the
strong-decay bf16 case of tests/ops/test_triton_decay.py, T = 200, with the GPU's bf16 and TF32
roundings emulated on the interpreter), against 7.5e-3 in TF32.

Memory: nothing beyond the inputs is saved for the backward (h_c and P are recomputed).
Temporaries: h_c in the forward, h_c and dh'_c in the backward, NC * Hv * K * V values each in
the inputs' dtype (for bf16, T = 32768, Hv = 16, K = V = 128: 256 MiB each); P, then dP in the
same buffer, T * Hv * 64 fp32 (per-channel decay only: 128 MiB there); G, T * Hv (* K) fp32; the
state terms, NC * Hv * K * V/32 fp32; and fp32 dq, dk per v head when Hk < Hv.

Launch configuration: every kernel runs with num_warps = 4 and num_stages = 2 (``LAUNCH``), the
two state passes with 3 stages (``STATE_LAUNCH``), the only configurations tested, on blocks of
BK = min(K, 64) key channels and BV = min(V, 64) value channels (min(V, 32) in the two state
passes, for more programs when there are few sequences). Supported: K and V powers of two from
16 to 256 (on a GPU in bf16/fp16, K >= 64 unless the decay is per channel), q, k, v in fp32,
bf16 or fp16, CUDA tensors (or CPU tensors with TRITON_INTERPRET=1, Triton's CPU interpreter):
the rule of this backend in the backend registry (kernels.backends.decay_triton_unsupported),
which refuses the rest with kernels.registry.BackendUnavailable ("<op>: backend 'triton' cannot
run ...").
Hopper note: no kernel transposes a tl.dot result (tl.trans); transposed operands are loaded
through strides, to stay clear of the wrong results seen with transposed MMA results in gated
backward kernels on Hopper with Triton 3.4 to 3.7.0 (fla-core issue #640).
"""
import contextlib
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import registry
from ..chunks import ChunkLayout, chunk_layout, chunk_rows
from ..common import sequence_bounds
from ..group_sum import group_sum
from .reference import OP, check_inputs

__all__ = ["decay_linear_attention_triton", "LAUNCH"]

CHUNK = 64  # tokens per chunk (BT in the kernels)
SUB_CHUNK = 16  # tokens per sub-chunk of the per-channel decay (BC in the kernels)
LAUNCH = {"num_warps": 4, "num_stages": 2}
# The state passes' loop is one small dot a chunk, shorter than a load's latency: with 3 stages
# Triton's pipeliner loads the chunk after next while one is computed (with 2 it waits for each
# chunk's tiles right after issuing them).
STATE_LAUNCH = {"num_warps": 4, "num_stages": 3}
_NO_DECAY, _SCALAR_DECAY, _CHANNEL_DECAY = 0, 1, 2  # the kernels' DECAY
_RUNTIME_INTS = ["H_K", "H_V"]  # not specialised on: one compiled kernel for every head count


# ---------------------------------------------------------------------------------------------
# Helpers (inlined into the kernels)
# ---------------------------------------------------------------------------------------------

@triton.jit
def _rows(ptr, tok, valid, heads, head, D: tl.constexpr, cols):
    """ptr[tok, head, cols] of a [tokens, heads, D] tensor as a [rows, cols] tile; 0 where not
    valid."""
    return tl.load(ptr + (tok[:, None] * heads + head) * D + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _rows_t(ptr, tok, valid, heads, head, D: tl.constexpr, cols):
    """The same tile transposed, [cols, rows], read through strides (no tl.trans)."""
    return tl.load(ptr + (tok[None, :] * heads + head) * D + cols[:, None], mask=valid[None, :], other=0.0)


@triton.jit
def _row(ptr, tok, valid, heads, head, D: tl.constexpr, cols):
    """One token's row ptr[tok, head, cols]; 0 if not valid."""
    return tl.load(ptr + (tok * heads + head) * D + cols, mask=valid, other=0.0)


@triton.jit
def _clamped(start, rows, length):
    """Token indices of chunk rows, rows past the sequence's end mapped to its last token: read
    there, the cumulative log-decay G stays constant, as if the padding had g = 0."""
    return (start + tl.minimum(rows, length - 1)).to(tl.int64)


@triton.jit
def _exp_where(keep, x):
    """exp(x) where keep, else 0; x is replaced before exp, so a dropped positive x cannot
    overflow."""
    return tl.exp(tl.where(keep, x, float("-inf")))


@triton.jit
def _state_offsets(index, K: tl.constexpr, V: tl.constexpr, kk, vv):
    """Offsets of the [BK, BV] block (kk, vv) of state ``index`` in a [..., K, V] tensor."""
    return (index.to(tl.int64) * K + kk[:, None]) * V + vv[None, :]


# ---------------------------------------------------------------------------------------------
# Forward kernels (the state kernel also serves the backward)
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["H_V", "step"])
def _cumsum_kernel(g, G, step, chunks, H_V,
                   K: tl.constexpr, BT: tl.constexpr, PER_CHANNEL: tl.constexpr):
    """G = the cumulative sum of g inside each chunk, fp32: [tokens, Hv] or [tokens, Hv, K].
    g has ``step`` heads a token: Hv, or 0 where one g serves every token. (A per-channel row is
    at ``(token step + head) K``: with K a constexpr Triton loads it in vectors; given as a
    token stride that it cannot know to be a multiple of 16, it would load one element at a
    time.)"""
    c, hv = tl.program_id(0), tl.program_id(1)
    start, length, rows, valid = chunk_rows(chunks, c, BT)
    tok = (start + rows).to(tl.int64)
    if PER_CHANNEL:
        kk = tl.arange(0, K)
        x = tl.load(g + (tok[:, None] * step + hv) * K + kk[None, :], mask=valid[:, None], other=0.0)
        tl.store(G + (tok[:, None] * H_V + hv) * K + kk[None, :], tl.cumsum(x.to(tl.float32), axis=0),
                 mask=valid[:, None])
    else:
        x = tl.load(g + tok * step + hv, mask=valid, other=0.0)
        tl.store(G + tok * H_V + hv, tl.cumsum(x.to(tl.float32), axis=0), mask=valid)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _states_kernel(k, v, G, h, h0, ht, cu, seq_chunks, H_K, H_V,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One (sequence, head, K block, V block): S = h0; per chunk, store h_c = S, then
    S = Diag(exp G_C) S + (exp(G_C - G) k)^T V. Ends by storing S, fp32, in ht."""
    nh, block = tl.program_id(0), tl.program_id(1)
    n, hv = nh // H_V, nh % H_V
    hk = hv // (H_V // H_K)
    kk = (block // (V // BV)) * BK + tl.arange(0, BK)
    vv = (block % (V // BV)) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    bos, eos = tl.load(cu + n), tl.load(cu + n + 1)
    first_chunk = tl.load(seq_chunks + n)
    state = tl.load(h0 + _state_offsets(nh, K, V, kk, vv))
    for c in range(tl.cdiv(eos - bos, BT)):
        start = bos + c * BT
        length = tl.minimum(eos - start, BT)
        valid = rows < length
        tok = (start + rows).to(tl.int64)
        tl.store(h + _state_offsets((first_chunk + c) * H_V + hv, K, V, kk, vv), state.to(h.dtype.element_ty))
        keys_t = _rows_t(k, tok, valid, H_K, hk, K, kk)  # [BK, BT]
        values = _rows(v, tok, valid, H_V, hv, V, vv)  # [BT, BV]
        last = (start + length - 1).to(tl.int64)
        if DECAY == 1:
            decay = tl.load(G + _clamped(start, rows, length) * H_V + hv)  # [BT]
            decay_last = tl.load(G + last * H_V + hv)
            state = state * tl.exp(decay_last)
            keys_t = keys_t * tl.exp(decay_last - decay)[None, :]
        elif DECAY == 2:
            decay_t = tl.load(G + (_clamped(start, rows, length)[None, :] * H_V + hv) * K + kk[:, None])
            decay_last = tl.load(G + (last * H_V + hv) * K + kk)  # [BK]
            state = state * tl.exp(decay_last)[:, None]
            keys_t = keys_t * tl.exp(decay_last[:, None] - decay_t)
        # With a decay, the decayed keys stay fp32 (TF32 in the product for low-precision inputs).
        state = tl.dot(keys_t, values.to(keys_t.dtype), state, input_precision=PREC)
    tl.store(ht + _state_offsets(nh, K, V, kk, vv), state)


@triton.jit(do_not_specialize=["H_K", "H_V"])
def _scores_kernel(q, k, G, P, chunks, H_K, H_V,
                   K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """One (chunk, head) with a per-channel decay: P on and below the diagonal, fp32, into
    [tokens, Hv, BT] (above the diagonal is left unwritten). Query sub-chunk by query sub-chunk:
    keys before it through the reference token r (its first token), keys inside it exactly."""
    c, hv = tl.program_id(0), tl.program_id(1)
    hk = hv // (H_V // H_K)
    start, length, rows, valid = chunk_rows(chunks, c, BT)
    tok = (start + rows).to(tl.int64)
    sub = tl.arange(0, BC)
    dtype = q.dtype.element_ty
    for i in range(BT // BC):
        r = i * BC
        rows_i = r + sub
        valid_i = rows_i < length
        tok_i = (start + rows_i).to(tl.int64)
        before = tl.zeros([BC, BT], dtype=tl.float32)  # P for the keys before the sub-chunk
        inside = tl.zeros([BC, BC], dtype=tl.float32)  # P for the keys inside it
        for kb in range(K // BK):
            kk = kb * BK + tl.arange(0, BK)
            queries = _rows(q, tok_i, valid_i, H_K, hk, K, kk).to(tl.float32)  # [BC, BK]
            decay = tl.load(G + (_clamped(start, rows_i, length)[:, None] * H_V + hv) * K + kk[None, :])
            decay_ref = tl.load(G + (_clamped(start, r, length) * H_V + hv) * K + kk)  # [BK]
            keys_t = _rows_t(k, tok, valid, H_K, hk, K, kk).to(tl.float32)  # [BK, BT]
            decay_t = tl.load(G + (_clamped(start, rows, length)[None, :] * H_V + hv) * K + kk[:, None])
            keys_ref = keys_t * _exp_where((rows < r)[None, :], decay_ref[:, None] - decay_t)
            queries_ref = queries * tl.exp(decay - decay_ref[None, :])
            before = tl.dot(queries_ref.to(dtype), keys_ref.to(dtype), before, input_precision=PREC)
            for j in range(BC):
                s = r + j
                key = _row(k, (start + s).to(tl.int64), s < length, H_K, hk, K, kk).to(tl.float32)
                decay_s = tl.load(G + (_clamped(start, s, length) * H_V + hv) * K + kk)
                pair = _exp_where(rows_i[:, None] >= s, decay - decay_s[None, :])
                scores = tl.sum(queries * key[None, :] * pair, axis=1)  # [BC]: P[t, s]
                inside += tl.where(sub[None, :] == j, scores[:, None], 0.0)
        offsets = (tok_i[:, None] * H_V + hv) * BT
        tl.store(P + offsets + rows[None, :], before, mask=valid_i[:, None] & (rows < r)[None, :])
        tl.store(P + offsets + rows_i[None, :], inside, mask=valid_i[:, None])


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _output_kernel(q, k, v, G, h, P, o, chunks, scale, H_K, H_V,
                   K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                   BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One (chunk, head, V block): O = scale ((exp(G) q) h_c + P V). P is formed here for a
    scalar decay (or none), read from _scores_kernel's output for a per-channel decay."""
    c, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (H_V // H_K)
    start, length, rows, valid = chunk_rows(chunks, c, BT)
    tok = (start + rows).to(tl.int64)
    vv = vb * BV + tl.arange(0, BV)
    state_index = c * H_V + hv
    dtype = v.dtype.element_ty
    inter = tl.zeros([BT, BV], dtype=tl.float32)
    scores = tl.zeros([BT, BT], dtype=tl.float32)
    for kb in range(K // BK):
        kk = kb * BK + tl.arange(0, BK)
        queries = _rows(q, tok, valid, H_K, hk, K, kk)
        state = tl.load(h + _state_offsets(state_index, K, V, kk, vv))
        if DECAY == 2:
            decay = tl.load(G + (_clamped(start, rows, length)[:, None] * H_V + hv) * K + kk[None, :])
            inter = tl.dot((queries * tl.exp(decay)).to(dtype), state, inter, input_precision=PREC)
        else:
            inter = tl.dot(queries, state, inter, input_precision=PREC)
            scores = tl.dot(queries, _rows_t(k, tok, valid, H_K, hk, K, kk), scores, input_precision=PREC)
    causal = rows[:, None] >= rows[None, :]
    if DECAY == 2:
        scores = tl.load(P + (tok[:, None] * H_V + hv) * BT + rows[None, :], mask=valid[:, None] & causal,
                         other=0.0)
    elif DECAY == 1:
        decay = tl.load(G + _clamped(start, rows, length) * H_V + hv)
        inter = inter * tl.exp(decay)[:, None]
        scores = scores * _exp_where(causal, decay[:, None] - decay[None, :])
    else:
        scores = tl.where(causal, scores, 0.0)
    inter = tl.dot(scores.to(dtype), _rows(v, tok, valid, H_V, hv, V, vv), inter, input_precision=PREC)
    tl.store(o + (tok[:, None] * H_V + hv) * V + vv[None, :], (scale * inter).to(o.dtype.element_ty),
             mask=valid[:, None])


# ---------------------------------------------------------------------------------------------
# Backward kernels
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dstates_kernel(q, do, G, h, ht, dhn, dht, dh0, terms, cu, seq_chunks, scale, H_K, H_V,
                    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                    BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One (sequence, head, K block, V block), last chunk first: dS = dS_N; per chunk, store
    dh'_c = dS, then dS = Diag(exp G_C) dS + scale (exp(G) q)^T dO. Ends by storing dS, the
    initial state's gradient (fp32), in dh0. With a decay, also stores this V block's part of
    sum_v S_C * dh'_c (S_C the state after the chunk: h_{c+1}, or the final state) per key
    channel, into terms [chunks, Hv, V/BV, K]."""
    nh, block = tl.program_id(0), tl.program_id(1)
    n, hv = nh // H_V, nh % H_V
    hk = hv // (H_V // H_K)
    kk = (block // (V // BV)) * BK + tl.arange(0, BK)
    vv = (block % (V // BV)) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    bos, eos = tl.load(cu + n), tl.load(cu + n + 1)
    first_chunk = tl.load(seq_chunks + n)
    grad = tl.load(dht + _state_offsets(nh, K, V, kk, vv))
    if DECAY != 0:
        state_after = tl.load(ht + _state_offsets(nh, K, V, kk, vv))
    num_chunks = tl.cdiv(eos - bos, BT)
    for i in range(num_chunks):
        c = num_chunks - 1 - i
        start = bos + c * BT
        length = tl.minimum(eos - start, BT)
        valid = rows < length
        tok = (start + rows).to(tl.int64)
        state_index = (first_chunk + c) * H_V + hv
        tl.store(dhn + _state_offsets(state_index, K, V, kk, vv), grad.to(dhn.dtype.element_ty))
        if DECAY != 0:
            tl.store(terms + (state_index.to(tl.int64) * (V // BV) + block % (V // BV)) * K + kk,
                     tl.sum(state_after * grad, axis=1))
            state_after = tl.load(h + _state_offsets(state_index, K, V, kk, vv)).to(tl.float32)
        queries_t = _rows_t(q, tok, valid, H_K, hk, K, kk)  # [BK, BT]
        grads_o = _rows(do, tok, valid, H_V, hv, V, vv)  # [BT, BV]
        last = (start + length - 1).to(tl.int64)
        if DECAY == 1:
            decay = tl.load(G + _clamped(start, rows, length) * H_V + hv)
            grad = grad * tl.exp(tl.load(G + last * H_V + hv))
            queries_t = queries_t * tl.exp(decay)[None, :]
        elif DECAY == 2:
            decay_t = tl.load(G + (_clamped(start, rows, length)[None, :] * H_V + hv) * K + kk[:, None])
            grad = grad * tl.exp(tl.load(G + (last * H_V + hv) * K + kk))[:, None]
            queries_t = queries_t * tl.exp(decay_t)
        # With a decay, the decayed queries stay fp32, as the decayed keys in _states_kernel.
        grad += scale * tl.dot(queries_t, grads_o.to(queries_t.dtype), input_precision=PREC)
    tl.store(dh0 + _state_offsets(nh, K, V, kk, vv), grad)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dv_kernel(q, k, do, G, P, dhn, dv, chunks, scale, H_K, H_V,
               K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
               BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One (chunk, head, V block): dV = scale P^T dO + (exp(G_C - G) k) dh'_c. P^T is formed
    here for a scalar decay (or none), read transposed from _scores_kernel's output for a
    per-channel decay."""
    c, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (H_V // H_K)
    start, length, rows, valid = chunk_rows(chunks, c, BT)
    tok = (start + rows).to(tl.int64)
    vv = vb * BV + tl.arange(0, BV)
    state_index = c * H_V + hv
    last = (start + length - 1).to(tl.int64)
    dtype = do.dtype.element_ty
    scores_t = tl.zeros([BT, BT], dtype=tl.float32)  # P^T: [s, t]
    grad_v = tl.zeros([BT, BV], dtype=tl.float32)
    for kb in range(K // BK):
        kk = kb * BK + tl.arange(0, BK)
        keys = _rows(k, tok, valid, H_K, hk, K, kk)
        grad_state = tl.load(dhn + _state_offsets(state_index, K, V, kk, vv))
        if DECAY == 2:
            decay = tl.load(G + (_clamped(start, rows, length)[:, None] * H_V + hv) * K + kk[None, :])
            decay_last = tl.load(G + (last * H_V + hv) * K + kk)
            keys = (keys * tl.exp(decay_last[None, :] - decay)).to(dtype)
        else:
            scores_t = tl.dot(keys, _rows_t(q, tok, valid, H_K, hk, K, kk), scores_t, input_precision=PREC)
        grad_v = tl.dot(keys, grad_state, grad_v, input_precision=PREC)
    anticausal = rows[None, :] >= rows[:, None]
    if DECAY == 2:
        scores_t = tl.load(P + (tok[None, :] * H_V + hv) * BT + rows[:, None], mask=valid[None, :] & anticausal,
                           other=0.0)
    elif DECAY == 1:
        decay = tl.load(G + _clamped(start, rows, length) * H_V + hv)
        grad_v = grad_v * tl.exp(tl.load(G + last * H_V + hv) - decay)[:, None]
        scores_t = scores_t * _exp_where(anticausal, decay[None, :] - decay[:, None])
    else:
        scores_t = tl.where(anticausal, scores_t, 0.0)
    grad_v += scale * tl.dot(scores_t.to(dtype), _rows(do, tok, valid, H_V, hv, V, vv), input_precision=PREC)
    tl.store(dv + (tok[:, None] * H_V + hv) * V + vv[None, :], grad_v.to(dv.dtype.element_ty), mask=valid[:, None])


@triton.jit(do_not_specialize=["H_V"])
def _dscores_kernel(v, do, dp, chunks, scale, H_V,
                    V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """One (chunk, head): dP = scale dO V^T on and below the diagonal, fp32, [tokens, Hv, BT]."""
    c, hv = tl.program_id(0), tl.program_id(1)
    start, length, rows, valid = chunk_rows(chunks, c, BT)
    tok = (start + rows).to(tl.int64)
    grad = tl.zeros([BT, BT], dtype=tl.float32)
    for vb in range(V // BV):
        vv = vb * BV + tl.arange(0, BV)
        grad = tl.dot(_rows(do, tok, valid, H_V, hv, V, vv), _rows_t(v, tok, valid, H_V, hv, V, vv), grad,
                      input_precision=PREC)
    grad = tl.where(rows[:, None] >= rows[None, :], scale * grad, 0.0)
    tl.store(dp + (tok[:, None] * H_V + hv) * BT + rows[None, :], grad, mask=valid[:, None])


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dqk_kernel(q, k, v, do, G, h, dhn, dp, terms, dq, dk, dg, chunks, scale, H_K, H_V,
                K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr, PREC: tl.constexpr):
    """One (chunk, head, K block): dQ, dK of this v head and, with a decay, dg: the reverse
    cumulative sum over the chunk of q dQ - k dK plus the chunk's state term (per channel, or
    this K block's part of the sum over channels for a scalar decay)."""
    c, hv, kb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (H_V // H_K)
    start, length, rows, valid = chunk_rows(chunks, c, BT)
    tok = (start + rows).to(tl.int64)
    kk = kb * BK + tl.arange(0, BK)
    state_index = c * H_V + hv
    last = (start + length - 1).to(tl.int64)
    dtype = do.dtype.element_ty
    if DECAY == 2:
        # Sub-chunk by sub-chunk b: dq of its queries (keys before b through its first token),
        # dk of its keys (queries after b through its last token), and exactly inside b.
        sub = tl.arange(0, BC)
        decay_last = tl.load(G + (last * H_V + hv) * K + kk)
        carry = tl.load(terms + state_index.to(tl.int64) * K + kk)  # dg of the later tokens
        for i in range(BT // BC):  # last sub-chunk first, for the reverse cumulative sum
            b = BT // BC - 1 - i
            r = b * BC
            e = r + BC - 1
            rows_b = r + sub
            valid_b = rows_b < length
            tok_b = (start + rows_b).to(tl.int64)
            grad_q = tl.zeros([BC, BK], dtype=tl.float32)
            grad_k = tl.zeros([BC, BK], dtype=tl.float32)
            for vb in range(V // BV):
                vv = vb * BV + tl.arange(0, BV)
                state_t = tl.load(h + (state_index.to(tl.int64) * K + kk[None, :]) * V + vv[:, None])
                grad_state_t = tl.load(dhn + (state_index.to(tl.int64) * K + kk[None, :]) * V + vv[:, None])
                grad_q = tl.dot(_rows(do, tok_b, valid_b, H_V, hv, V, vv), state_t, grad_q, input_precision=PREC)
                grad_k = tl.dot(_rows(v, tok_b, valid_b, H_V, hv, V, vv), grad_state_t, grad_k,
                                input_precision=PREC)
            queries = _rows(q, tok_b, valid_b, H_K, hk, K, kk).to(tl.float32)
            keys = _rows(k, tok_b, valid_b, H_K, hk, K, kk).to(tl.float32)
            decay = tl.load(G + (_clamped(start, rows_b, length)[:, None] * H_V + hv) * K + kk[None, :])
            grad_q = grad_q * scale * tl.exp(decay)
            grad_k = grad_k * tl.exp(decay_last[None, :] - decay)
            decay_all = tl.load(G + (_clamped(start, rows, length)[:, None] * H_V + hv) * K + kk[None, :])

            decay_ref = tl.load(G + (_clamped(start, r, length) * H_V + hv) * K + kk)
            keys_ref = _rows(k, tok, valid, H_K, hk, K, kk).to(tl.float32) * _exp_where(
                (rows < r)[:, None], decay_ref[None, :] - decay_all)
            grad_scores = tl.load(dp + (tok_b[:, None] * H_V + hv) * BT + rows[None, :],
                                  mask=valid_b[:, None] & (rows < r)[None, :], other=0.0)  # [BC, BT]
            grad_q += tl.exp(decay - decay_ref[None, :]) * tl.dot(
                grad_scores.to(dtype), keys_ref.to(dtype), input_precision=PREC)

            decay_ref = tl.load(G + (_clamped(start, e, length) * H_V + hv) * K + kk)
            queries_ref = _rows(q, tok, valid, H_K, hk, K, kk).to(tl.float32) * _exp_where(
                (rows > e)[:, None], decay_all - decay_ref[None, :])
            grad_scores_t = tl.load(dp + (tok[None, :] * H_V + hv) * BT + rows_b[:, None],
                                    mask=valid[None, :] & (rows > e)[None, :], other=0.0)  # [BC, BT]: dP[t, s]
            grad_k += tl.exp(decay_ref[None, :] - decay) * tl.dot(
                grad_scores_t.to(dtype), queries_ref.to(dtype), input_precision=PREC)

            for u in range(BC):
                s = r + u
                tok_s = (start + s).to(tl.int64)
                valid_s = s < length
                decay_s = tl.load(G + (_clamped(start, s, length) * H_V + hv) * K + kk)
                # dq_t += dP[t, s] k_s exp(G_t - G_s) for the queries t >= s of the sub-chunk
                grad_column = tl.load(dp + (tok_b * H_V + hv) * BT + s, mask=valid_b, other=0.0)
                key = _row(k, tok_s, valid_s, H_K, hk, K, kk).to(tl.float32)
                grad_q += grad_column[:, None] * key[None, :] * _exp_where(
                    rows_b[:, None] >= s, decay - decay_s[None, :])
                # dk_x += dP[s, x] q_s exp(G_s - G_x) for the keys x <= s of the sub-chunk
                grad_row = tl.load(dp + (tok_s * H_V + hv) * BT + rows_b, mask=valid_s, other=0.0)
                query = _row(q, tok_s, valid_s, H_K, hk, K, kk).to(tl.float32)
                grad_k += grad_row[:, None] * query[None, :] * _exp_where(
                    rows_b[:, None] <= s, decay_s[None, :] - decay)
            offsets = (tok_b[:, None] * H_V + hv) * K + kk[None, :]
            tl.store(dq + offsets, grad_q.to(dq.dtype.element_ty), mask=valid_b[:, None])
            tl.store(dk + offsets, grad_k.to(dk.dtype.element_ty), mask=valid_b[:, None])
            grad_gamma = queries * grad_q - keys * grad_k
            tl.store(dg + offsets, tl.cumsum(grad_gamma, axis=0, reverse=True) + carry[None, :],
                     mask=valid_b[:, None])
            carry += tl.sum(grad_gamma, axis=0)
    else:
        grad_scores = tl.zeros([BT, BT], dtype=tl.float32)  # dP: [t, s]
        grad_scores_t = tl.zeros([BT, BT], dtype=tl.float32)  # dP^T: [s, t]
        grad_q = tl.zeros([BT, BK], dtype=tl.float32)
        grad_k = tl.zeros([BT, BK], dtype=tl.float32)
        for vb in range(V // BV):
            vv = vb * BV + tl.arange(0, BV)
            grads_o = _rows(do, tok, valid, H_V, hv, V, vv)
            values = _rows(v, tok, valid, H_V, hv, V, vv)
            grad_scores = tl.dot(grads_o, _rows_t(v, tok, valid, H_V, hv, V, vv), grad_scores,
                                 input_precision=PREC)
            grad_scores_t = tl.dot(values, _rows_t(do, tok, valid, H_V, hv, V, vv), grad_scores_t,
                                   input_precision=PREC)
            state_t = tl.load(h + (state_index.to(tl.int64) * K + kk[None, :]) * V + vv[:, None])
            grad_state_t = tl.load(dhn + (state_index.to(tl.int64) * K + kk[None, :]) * V + vv[:, None])
            grad_q = tl.dot(grads_o, state_t, grad_q, input_precision=PREC)
            grad_k = tl.dot(values, grad_state_t, grad_k, input_precision=PREC)
        queries = _rows(q, tok, valid, H_K, hk, K, kk)
        keys = _rows(k, tok, valid, H_K, hk, K, kk)
        causal = rows[:, None] >= rows[None, :]
        anticausal = rows[None, :] >= rows[:, None]
        if DECAY == 1:
            decay = tl.load(G + _clamped(start, rows, length) * H_V + hv)
            grad_q = grad_q * (scale * tl.exp(decay))[:, None]
            grad_k = grad_k * tl.exp(tl.load(G + last * H_V + hv) - decay)[:, None]
            grad_scores = scale * grad_scores * _exp_where(causal, decay[:, None] - decay[None, :])
            grad_scores_t = scale * grad_scores_t * _exp_where(anticausal, decay[None, :] - decay[:, None])
        else:
            grad_q = scale * grad_q
            grad_scores = tl.where(causal, scale * grad_scores, 0.0)
            grad_scores_t = tl.where(anticausal, scale * grad_scores_t, 0.0)
        grad_q = tl.dot(grad_scores.to(dtype), keys, grad_q, input_precision=PREC)
        grad_k = tl.dot(grad_scores_t.to(dtype), queries, grad_k, input_precision=PREC)
        offsets = (tok[:, None] * H_V + hv) * K + kk[None, :]
        tl.store(dq + offsets, grad_q.to(dq.dtype.element_ty), mask=valid[:, None])
        tl.store(dk + offsets, grad_k.to(dk.dtype.element_ty), mask=valid[:, None])
        if DECAY == 1:
            grad_gamma = tl.sum(queries.to(tl.float32) * grad_q - keys.to(tl.float32) * grad_k, axis=1)
            term = tl.sum(tl.load(terms + state_index.to(tl.int64) * K + kk), axis=0)
            tl.store(dg + (tok * H_V + hv) * (K // BK) + kb, tl.cumsum(grad_gamma, axis=0, reverse=True) + term,
                     mask=valid)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

class _Problem(NamedTuple):
    """The sizes and compile-time choices of one call."""

    batch: int
    seq_len: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype  # q, k, v, h_c and dh'_c in the kernels
    decay: int  # _NO_DECAY, _SCALAR_DECAY (g [Hv] or [B, T, Hv]) or _CHANNEL_DECAY
    layout: ChunkLayout

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def precision(self) -> str:
        """tl.dot's input_precision: exact fp32 products for fp32 inputs (no TF32); TF32 for the
        fp32 operands the state passes form from low-precision inputs."""
        return "ieee" if self.dtype == torch.float32 else "tf32"

    @property
    def key_block(self) -> int:
        return min(64, self.key_dim)

    @property
    def value_block(self) -> int:
        return min(64, self.value_dim)

    @property
    def state_value_block(self) -> int:
        """The state passes' V block: narrower than the others', so that a few long sequences
        still spread over the GPU (16 heads at K = V = 128 are 128 programs)."""
        return min(32, self.value_dim)

    @property
    def num_key_blocks(self) -> int:
        return self.key_dim // self.key_block

    @property
    def num_value_blocks(self) -> int:
        return self.value_dim // self.value_block

    @property
    def num_state_value_blocks(self) -> int:
        return self.value_dim // self.state_value_block

    def options(self, state_pass: bool = False) -> dict:
        """The compile-time arguments and launch configuration shared by most kernels."""
        value_block = self.state_value_block if state_pass else self.value_block
        return dict(K=self.key_dim, V=self.value_dim, BT=CHUNK, BK=self.key_block, BV=value_block,
                    DECAY=self.decay, PREC=self.precision, **(STATE_LAUNCH if state_pass else LAUNCH))

    def sequence_grid(self) -> tuple[int, int]:
        """The state passes': (sequences * heads, K blocks * V blocks)."""
        return self.layout.num_seqs * self.value_heads, self.num_key_blocks * self.num_state_value_blocks

    def chunk_grid(self, blocks: int = 1) -> tuple[int, int, int]:
        """The chunk-parallel kernels': (chunks, heads, blocks). An empty grid (T = 0) launches
        nothing."""
        return self.layout.num_chunks, self.value_heads, blocks


def _flat(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, D] -> contiguous [B * T, H, D] in dtype (a view where it already is)."""
    return tensor.reshape(-1, *tensor.shape[2:]).to(dtype).contiguous()


def _cumulative_decay(g, problem: _Problem) -> torch.Tensor | None:
    """G, the chunk-local cumulative log-decay, fp32: [B * T, Hv] or [B * T, Hv, K]; None for no
    decay."""
    if g is None:
        return None
    layout, heads = problem.layout, problem.value_heads
    per_channel = problem.decay == _CHANNEL_DECAY
    # g [Hv] is read with a step of 0 heads a token: the same decay at every token.
    step = 0 if g.dim() == 1 else heads
    decay = torch.empty(problem.tokens, heads, *([problem.key_dim] if per_channel else []),
                        dtype=torch.float32, device=g.device)
    _cumsum_kernel[problem.chunk_grid()](
        g.contiguous(), decay, step, layout.chunks, heads, K=problem.key_dim, BT=CHUNK,
        PER_CHANNEL=per_channel, **LAUNCH)
    return decay


def _states(k, v, decay, initial_state, problem: _Problem):
    """h_c for every chunk ([NC, Hv, K, V] in the inputs' dtype) and the final states (fp32)."""
    layout = problem.layout
    shape = (problem.value_heads, problem.key_dim, problem.value_dim)
    states = torch.empty(layout.num_chunks, *shape, dtype=problem.dtype, device=k.device)
    final_state = torch.empty(layout.num_seqs, *shape, dtype=torch.float32, device=k.device)
    _states_kernel[problem.sequence_grid()](
        k, v, k if decay is None else decay, states, initial_state, final_state, layout.cu,
        layout.seq_chunks, problem.key_heads, problem.value_heads, **problem.options(state_pass=True))
    return states, final_state


def _scores(q, k, decay, problem: _Problem) -> torch.Tensor | None:
    """P of every chunk for a per-channel decay ([B * T, Hv, CHUNK], fp32, on and below the
    diagonal); None otherwise (the kernels form P themselves)."""
    if problem.decay != _CHANNEL_DECAY:
        return None
    layout = problem.layout
    scores = torch.empty(problem.tokens, problem.value_heads, CHUNK, dtype=torch.float32, device=q.device)
    _scores_kernel[problem.chunk_grid()](
        q, k, decay, scores, layout.chunks, problem.key_heads, problem.value_heads,
        K=problem.key_dim, BT=CHUNK, BC=SUB_CHUNK, BK=problem.key_block, PREC=problem.precision, **LAUNCH)
    return scores


class _DecayLinearAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, initial_state, scale: float, problem: _Problem):
        ctx.set_materialize_grads(False)
        layout = problem.layout
        q_flat, k_flat, v_flat = (_flat(tensor, problem.dtype) for tensor in (q, k, v))
        if initial_state is None:
            state0 = torch.zeros(layout.num_seqs, problem.value_heads, problem.key_dim, problem.value_dim,
                                 dtype=torch.float32, device=q.device)
        else:
            state0 = initial_state.float().contiguous()
        decay = _cumulative_decay(g, problem)
        states, final_state = _states(k_flat, v_flat, decay, state0, problem)
        scores = _scores(q_flat, k_flat, decay, problem)
        o = torch.empty_like(v_flat)
        _output_kernel[problem.chunk_grid(problem.num_value_blocks)](
            q_flat, k_flat, v_flat, k_flat if decay is None else decay, states,
            k_flat if scores is None else scores, o, layout.chunks, scale, problem.key_heads,
            problem.value_heads, **problem.options())
        ctx.save_for_backward(q_flat, k_flat, v_flat, g, state0)
        ctx.scale, ctx.problem = scale, problem
        ctx.input_dtypes = (q.dtype, k.dtype, v.dtype, None if initial_state is None else initial_state.dtype)
        return o.view(v.shape).to(v.dtype), final_state

    @staticmethod
    def backward(ctx, grad_o, grad_final_state):
        q, k, v, g, state0 = ctx.saved_tensors
        problem, scale = ctx.problem, ctx.scale
        layout, heads, key_dim = problem.layout, problem.value_heads, problem.key_dim
        per_channel = problem.decay == _CHANNEL_DECAY
        grad_o = torch.zeros_like(v) if grad_o is None else _flat(grad_o, problem.dtype)
        if grad_final_state is None:
            grad_final_state = torch.zeros_like(state0)
        grad_final_state = grad_final_state.float().contiguous()

        decay = _cumulative_decay(g, problem)
        decay_or_any = k if decay is None else decay
        states, final_state = _states(k, v, decay, state0, problem)
        grad_states = torch.empty_like(states)  # dh'_c: the gradient of the state after chunk c
        grad_state0 = torch.empty_like(state0)
        # sum_v S_C * dh'_c per chunk and key channel, by V block of the state pass
        terms = k if decay is None else torch.empty(
            layout.num_chunks, heads, problem.num_state_value_blocks, key_dim, dtype=torch.float32, device=q.device)
        _dstates_kernel[problem.sequence_grid()](
            q, grad_o, decay_or_any, states, final_state, grad_states, grad_final_state, grad_state0, terms,
            layout.cu, layout.seq_chunks, scale, problem.key_heads, heads, **problem.options(state_pass=True))

        grad_v = torch.empty_like(v)
        grouped = problem.key_heads != heads  # dq, dk per v head in fp32, then summed over the group
        grad_q = torch.empty(q.shape[0], heads, key_dim, dtype=torch.float32 if grouped else q.dtype,
                             device=q.device)
        grad_k = torch.empty_like(grad_q)
        if decay is None:
            grad_g = k  # not written
        else:  # per channel, or per K block (summed below) for a scalar decay
            terms = terms.sum(2)
            grad_g = torch.empty(q.shape[0], heads, key_dim if per_channel else problem.num_key_blocks,
                                 dtype=torch.float32, device=q.device)
        scores = _scores(q, k, decay, problem)
        scores_or_any = k if scores is None else scores
        _dv_kernel[problem.chunk_grid(problem.num_value_blocks)](
            q, k, grad_o, decay_or_any, scores_or_any, grad_states, grad_v, layout.chunks, scale,
            problem.key_heads, heads, **problem.options())
        if per_channel:  # dP overwrites P, which is no longer needed
            _dscores_kernel[problem.chunk_grid()](
                v, grad_o, scores, layout.chunks, scale, heads,
                V=problem.value_dim, BT=CHUNK, BV=problem.value_block, PREC=problem.precision, **LAUNCH)
        _dqk_kernel[problem.chunk_grid(problem.num_key_blocks)](
            q, k, v, grad_o, decay_or_any, states, grad_states, scores_or_any, terms, grad_q, grad_k, grad_g,
            layout.chunks, scale, problem.key_heads, heads, BC=SUB_CHUNK, **problem.options())

        shape = (problem.batch, problem.seq_len, problem.key_heads, heads // problem.key_heads, key_dim)
        q_dtype, k_dtype, v_dtype, state_dtype = ctx.input_dtypes
        grad_q, grad_k = ((group_sum(grad, heads // problem.key_heads, dtype) if grouped
                           else grad.to(dtype)).view(shape[:3] + shape[4:])
                          for grad, dtype in ((grad_q, q_dtype), (grad_k, k_dtype)))
        if g is None:
            grad_g = None
        else:
            if not per_channel:
                grad_g = grad_g.sum(-1)  # over the K blocks
            # g [Hv] is the same log-decay at every token of every sequence: the sum of them all.
            grad_g = (grad_g.sum(0) if g.dim() == 1 else grad_g.view(g.shape)).to(g.dtype)
        grad_v = grad_v.view(*shape[:2], heads, problem.value_dim)  # V, not -1, which T = 0 leaves open
        return (grad_q, grad_k, grad_v.to(v_dtype), grad_g,
                None if state_dtype is None else grad_state0.to(state_dtype), None, None)


def decay_linear_attention_triton(
    q, k, v, *, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """Decaying linear attention by our Triton kernels, forward and backward (see the module
    docstring for the kernels and their limits).

    Same arguments, shapes and results as ``decay_linear_attention_reference``: q, k
    ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; g ``[Hv]``, ``[B, T, Hv]`` or ``[B, T, Hv, K]``;
    initial_state ``[N, Hv, K, V]``. Returns o ``[B, T, Hv, V]`` in v's dtype and the final state
    ``[N, Hv, K, V]`` in fp32 (or None). q, k, v, the chunk states and the other tl.dot inputs
    are in q, k and v's promoted dtype (fp32, bf16 or fp16); g, the states passed in and out and
    every accumulation in fp32. K and V must be powers of two from 16 to 256.
    """
    check_inputs(q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    registry.require(OP, "triton", q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if g is None:
        decay = _NO_DECAY
    else:
        decay = _CHANNEL_DECAY if g.dim() == 4 else _SCALAR_DECAY
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    problem = _Problem(batch, seq_len, key_heads, value_heads, key_dim, value_dim, dtype, decay,
                       chunk_layout(sequence_bounds(cu_seqlens, batch, seq_len), CHUNK, q.device))
    scale = key_dim**-0.5 if scale is None else float(scale)
    # Triton launches on the current CUDA device; the backward runs on the inputs' device anyway.
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        o, final_state = _DecayLinearAttention.apply(q, k, v, g, initial_state, scale, problem)
    return o, (final_state if output_final_state else None)
