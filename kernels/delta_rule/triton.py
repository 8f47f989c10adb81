"""The gated delta rule in our own Triton kernels, forward and backward (backend "triton").

The chunkwise WY / UT-transform form follows Yang, Wang, Zhang, Shen and Kim, "Parallelizing
Linear Transformers with the Delta Rule over Sequence Length" (NeurIPS 2024); the scalar decay
Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR
2025); the per-channel decay Kimi Team, "Kimi Linear: An Expressive, Efficient Hybrid Linear
Attention Architecture" (2025, Kimi Delta Attention). The algebra is that of chunked.py (see its
docstring), per head and chunk of C = 64 tokens entered with state S_0, a = b * k, x = w * v, G
the cumulative log-decay inside the chunk, Gamma = exp(G), Gamma_C its value at the chunk's end:

    A = strictly lower part of (Gamma * a) (k / Gamma)^T,     T = (I + A)^-1
    P = lower part (with the diagonal) of (Gamma * q) (k / Gamma)^T
    W = T (Gamma * a),   Y = T x                               (the WY / UT factors)
    U = Y - W S_0                                              (the write residual)
    O = scale * ((Gamma * q) S_0 + P U)
    S_C = Diag(Gamma_C) S_0 + (k * Gamma_C / Gamma)^T U

Backward, with dO' = scale * dO and dS_C the gradient of the state leaving the chunk:

    dU   = P^T dO' + (k * Gamma_C / Gamma) dS_C  (+ the write residual's gradient)
    dS_0 = Diag(Gamma_C) dS_C + (Gamma * q)^T dO' - W^T dU
    dX   = T^T dU                                  (so dv = w * dX, dw = v * dX)
    dP   = lower(dO' U^T),   dA = -strictly_lower(dX U^T)    (dT = dU Z^T with U = T Z)
    d(Gamma * q) = dO' S_0^T,  d(Gamma * a) = -T^T dU S_0^T,  d(k Gamma_C / Gamma) = U dS_C^T,

and on through P and A to q, a and k. Each factor exp(+-G) multiplies a vector, so the gradient
of the log-decay is dG = q * dq + a * da - k * dk per token and channel, plus, at the chunk's
last token, Gamma_C * rowsum(S_0 * dS_C) + sum_s k_s * dk_s (over the dk of the k Gamma_C /
Gamma term only); dg is its reverse cumulative sum inside the chunk.

Numerics. No exponent is ever positive. The pairwise decays exp(G_t - G_s), s <= t, of a
per-channel decay are formed in 16-token sub-blocks: for an off-diagonal sub-block (rows t in
sub-block i, columns s in an earlier one) as (x_t exp(G_t - G_r)) (y_s exp(G_r - G_s)) with the
reference r = 16 i, the row sub-block's first token, so that both factors are <= 1 however
strong the decay; inside the diagonal sub-blocks exactly, as exp(-|G_t - G_s|), one column per
step (16 steps). Exponents are clamped at 0 (min(x, 0)) so that padding rows cannot overflow;
for g <= 0, as the op requires, the clamp never changes a value that is used. G is an fp32
cumulative sum per chunk, every tl.dot accumulates in fp32, and the unit-triangular inverse is by
forward substitution in fp32 on the four 16 x 16 diagonal blocks (all four in each step), then
block substitution with fp32 ("ieee") dots for fp32 inputs, TF32 dots for 16-bit ones (whose T is
stored in 16 bits).

Precision. With fp32 q, k, v every tl.dot runs in full fp32 ("ieee", not TF32), so that the fp32
path checks the algebra tightly; with bf16 (or fp16) q, k, v the dot operands are rounded to
that dtype (tensor cores, fp32 accumulation), and so are the stored tiles P, T, W, Y, U, the
decayed keys and queries, dU, dP, dA and the chunk states and their gradients (the decayed keys
and queries of one decay per head are rounded where they are formed, to the same values).

Kernels, in order (grids in brackets; NC chunks over all sequences, N sequences, Hv v heads):
    forward   _chunk_cumsum [NC, Hv] -> G;  _fwd_scores [NC, Hv] -> A, P;  _invert [NC * Hv]
              -> T;  _fwd_prepare [NC, Hv] -> W, Y (and, with a per-channel decay, the decayed
              keys k Gamma_C / Gamma and queries Gamma q);  _fwd_state [N, Hv, V/BV], along each
              sequence -> chunk states, U, final state;  _fwd_output [NC, Hv, V/BV] -> o
    backward  _bwd_state [N, Hv, V/BV], along each sequence in reverse -> dS_C per chunk, dU,
              the initial state's gradient;  _bwd_scores [NC, Hv] -> dP, dA, dv, dw (or beta's
              share);  _bwd_qkg [NC, Hk] (one decay per head or none; over the q/k head's group
              of v heads, a loop over blocks of BK key channels each) or [NC, Hk, K/BK]
              (per-channel decay, Hk = Hv) -> dq, dk, d erase (or beta's share), dg
Only the two sequential kernels loop over chunks (two dots per chunk each); everything else is
parallel over chunks, and so are they, in segments, where a walk per sequence would leave SMs idle
(below). Saved for the backward, per token and v head, in the dot dtype unless said:
G (fp32; K values, or 1 with one decay per head), U (V; fp32 with the write residual), T and P (64
each), W (K), with a per-channel decay the decayed keys and queries (2 K), and the chunk states
(K V / 64). For K = V = 128 in bf16: 512 + 256 + 256 + 256 + 512 + 512 = 2304 bytes with a
per-channel decay (KDA, GDN-2), 1284 with one per head (GDN), 1280 without (DeltaNet). (One decay
per head scales whole rows, so the kernels that need Gamma q and k Gamma_C / Gamma form them from
q, k and G as they load them.) The backward adds, freed on return, dS_C per chunk (as the states),
dU, dP and dA.

Grouped heads: a program of v head hv reads q/k head hv // (Hv / Hk); a _bwd_qkg program takes
a q/k head's group of v heads in turn and sums their shares of dq and dk (fp32 partial sums in a
scratch buffer, the total stored once in q's dtype). With a per-channel decay the kernels run one
v head per q/k head: gated_delta_rule_triton repeats q and k over each group first, and autograd
sums their gradients back (see "Hopper"). Varlen: the chunks are those of kernels/chunks.py (ChunkLayout, C = 64): the
chunk-parallel kernels find their chunk's tokens in its ``chunks`` table (chunk_rows), the two
sequential ones compute them from the sequence's bounds (sequence_chunk_rows on ``cu``; its
first chunk's index from ``seq_chunks``), so that their loads do not wait on a table's; loads
past a chunk's end are zero, which is exact padding (a zero token with g = 0 reads, writes and decays nothing).

Segmented walks. Both walks are affine in the state they start from: across a chunk the forward
takes S to (Diag(Gamma_C) - (k Gamma_C / Gamma)^T W) S + (k Gamma_C / Gamma)^T Y, the backward dS_C
to (Diag(Gamma_C) - W^T (k Gamma_C / Gamma)) dS_C + ((Gamma q)^T - W^T P^T) dO' (- W^T dR). Where
(sequences x v heads) walks leave SMs idle even at the narrowest value tile (B = 1 at long T) and
K <= 128, each sequence is cut into segments (``_segment_chunks``: 16 chunks, doubled while the
longest sequence keeps 16 or more: about 8 segments, at least 4; chunks.segment_layout) and a
state walk is three launches, in either direction:
    1. (WALK 1) each segment from a zero state, over its V value columns and K more "transition"
       columns that start as the identity's and take Y = 0 (dO = dR = 0): the segment's map
       S -> M S + L, stored as [L | M] per segment and v head ([segments, Hv, K, V + K], fp32);
    2. _combine_segments_kernel [N, Hv, V/BV], along each sequence's segments (in reverse for the
       backward), S <- M S + L in fp32 from the initial state (dS of the final one): the state
       entering each segment and the final state (the initial state's gradient); its BV narrows
       as a whole walk's does (``_parallel_block``), as its N x Hv programs are few;
    3. (WALK 2) each segment from its entering state, storing what a whole walk stores (the chunk
       states and U; dS_C and dU), so the kernels after it are unchanged.
Steps 1 and 3 run segments x v heads x tiles programs, each walking one segment, where a whole walk
runs sequences x v heads x tiles programs walking every chunk.

Launch configurations (fixed, no autotuning, so that the configuration the tests run is the one that
runs): num_stages 2 (3 in the state kernels for K <= 128 in 16-bit); num_warps 4 (one warpgroup) for
_chunk_cumsum, _invert, _fwd_output, _bwd_scores and _bwd_qkg (8 in those two in fp32), 8 for the
others. Tiles (each capped at K or V): BK = 32 in _fwd_scores and _bwd_qkg (16 in _bwd_qkg with a
per-channel decay), else 64; BV = 32 in _bwd_scores, min(64, 4096 / K) in _fwd_state, 64 in
_bwd_state up to K = 128 in bf16 and fp16 (else as in _fwd_state: at K = 256 and BV = 32 it would
need 244 KB of shared memory), else 64; the two state kernels' BV then halves (down to 16) while
(sequences x value heads x V / BV) programs fit on the SMs (``_parallel_block``), or, in segmented
walks, are capped at K. These are chosen so that ptxas spills nothing or little (at most ~150 bytes
per thread) for sm_90 in bf16 with K, V of 64, 128 and 256 (compiled without a GPU). The fp32 path,
whose dots run on FMA units, spills a lot (_bwd_qkg and _fwd_scores with a per-channel decay ~1 KB
per thread at 8 warps, _bwd_qkg 24 KB and _bwd_scores 8 to 15 KB at 4, hence 8; _bwd_state twice as
much at BV = 64 as at 32, hence 32; _bwd_qkg with one decay per head 0.05 to 1.5 KB, and 160 to 184
KB of shared memory): it is there to check the algebra, not for speed. Supported K and V: 16, 32,
64, 128, 256. No tl.trans anywhere: transposed operands are loaded transposed (Hopper with Triton
3.4 to 3.7.0 miscompiles tl.trans of dot results, fla-core issue #640).

Kernel structure (from ptxas/SASS for sm_90 and the GPU time per kernel of one fwd+bwd,
benchmarks/kernels.py --profile, at B*T = 32768, H = 16, K = V = 128, bf16):
    _bwd_qkg, one decay per head (GDN, DeltaNet): one program per chunk and head forms the
        [64, 64] tiles of dP and dA and their transposes once, loops over the key blocks and sums
        dg and beta's share itself (a program per key block would load, mask and decay the same
        tiles K/BK times).
    _bwd_qkg, per-channel decay (KDA, GDN-2): the 16 serial steps over the diagonal sub-blocks
        accumulate apart from the dot results' layout, with the masks folded into per-row
        scalars, so that no step converts tiles through shared memory.
    _fwd_scores, per-channel decay: the diagonal sub-blocks are formed one column per step,
        which profiles faster than all 16 columns at once.
    _invert: one loop of 15 steps does all four diagonal blocks, reading A's rows from memory
        (extracting each row from registers would take a reduction across warps a step).
    _bwd_scores: 4 warps on tensor cores (at 8 it takes 130 registers a thread, one program
        per SM).
    _bwd_state: BV = 64 for K <= 128 in 16-bit (half the programs of BV = 32, each with twice
        the columns, so fewer waves of the sequential loop).
    _fwd_state, _bwd_state: the state (its gradient) is carried transposed, [BV, K], so that each
        step's two dependent dots take the value carried from the step before as their first
        operand, which tl.dot takes from registers, and the chunk's tiles, loaded from memory, as
        their second (as the second operand it would go through shared memory twice a step).

Hopper. On an H200 (Triton 3.6.0, with its ptxas 12.8), _bwd_qkg at 8 warps, feeding the
[64, 64] tiles of dP and dA (and their transposes) to tl.dot straight from memory, returns wrong dk
and d beta in bf16 without a decay and faults (illegal memory access) with a per-channel decay;
the per-head form, which scales those tiles by the decays in registers first, is right. The fp32
path (no tensor cores) is right too, and under the interpreter every access of the bf16 path is
in bounds: code generation, not indexing. So _bwd_qkg masks dP and dA as it uses them and, on
tensor cores, runs on one warpgroup (no replicated accumulator layouts, no conversions between
them), as fla-core keeps its kernels of this shape at 2 or 4 warps on Hopper (its issues #984 and
#640 report similar failures). A form without a decay gives dk 0.46 off in bf16 even so (masking
by tl.where alone does not keep the compiler from the failing code), so without a decay _bwd_qkg
runs the per-head form on a zero decay. _bwd_scores at 4 warps and _bwd_state at BV = 64 (8
warps) also feed tiles loaded transposed (T^T, U^T in the first, k^T in the second) to tl.dot
straight from memory, the pattern of those failures; tests/ops/test_triton_delta_rule.py checks
them on a GPU. A
per-channel decay in bf16 at K = V = 64 (test_hybrid_preset_heads: Hk = 2, Hv = 8) gives NaN
gradients of q, k, beta and g on an H100 and then an illegal memory access: as a loop over the
group in _bwd_qkg, as one program per v head with a group sum, and with q and k repeated over the
group so that the kernels see Hk = Hv (the form here); the interpreter gets that case right, and
on the GPU K = 64 with V = 128 (grouped or not), K = V = 128, fp32 and one decay per head pass.
The registry's rule declines a per-channel decay below V = 128 in 16 bits on a GPU
(kernels.backends._delta_declined). Any new launch configuration must pass that file there before
use."""

import torch
import triton
import triton.language as tl

from .. import registry
from ..backends import triton_unavailable_reason
from ..chunks import chunk_layout, chunk_rows, segment_layout, sequence_chunk_rows
from ..common import sequence_bounds
from .reference import OP, check_inputs

__all__ = ["gated_delta_rule_triton", "triton_unavailable_reason"]

_C = tl.constexpr(64)    # chunk size
_SUB = tl.constexpr(16)  # sub-block of the per-channel decay and of the triangular inverse
_NUM_STAGES = 2
_SEGMENT_CHUNKS = 16  # chunks in the shortest segment of a segmented state walk
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------

@triton.jit
def _mm(a, b, DOT: tl.constexpr, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation, the operands in DOT (fp32 without TF32 where IEEE)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(DOT), b.to(DOT))


@triton.jit
def _at(ptr, start, heads, head, DIM: tl.constexpr):
    """Pointer to token ``start`` (int64) of ``head`` in a contiguous [tokens, heads, DIM] tensor;
    tiles add int32 offsets to it, which keeps their address arithmetic 32-bit."""
    return ptr + (start * heads + head) * DIM


@triton.jit
def _tile(ptr, start, r, valid, heads, head, DIM: tl.constexpr, col0, COLS: tl.constexpr,
          TRANSPOSED: tl.constexpr):
    """Tile [R, COLS] in the tensor's dtype: row i is token start + r[i] (zero where not valid),
    columns col0 + j of ``head`` in a contiguous [tokens, heads, DIM] tensor; or its transpose
    [COLS, R], loaded transposed."""
    cols = col0 + tl.arange(0, COLS)
    base = _at(ptr, start, heads, head, DIM)
    if TRANSPOSED:
        return tl.load(base + cols[:, None] + (r * (heads * DIM))[None, :], mask=valid[None, :], other=0.0)
    else:
        return tl.load(base + (r * (heads * DIM))[:, None] + cols[None, :], mask=valid[:, None], other=0.0)


@triton.jit
def _rows(ptr, start, r, valid, heads, head, DIM: tl.constexpr, col0, COLS: tl.constexpr):
    """``_tile`` in fp32."""
    return _tile(ptr, start, r, valid, heads, head, DIM, col0, COLS, False).to(tl.float32)


@triton.jit
def _cols(ptr, start, r, valid, heads, head, DIM: tl.constexpr, col0, COLS: tl.constexpr):
    """The transposed ``_tile`` in fp32: [COLS, R]."""
    return _tile(ptr, start, r, valid, heads, head, DIM, col0, COLS, True).to(tl.float32)


@triton.jit
def _vec(ptr, start, r, valid, heads, head):
    """fp32 [R]: the value of token start + r[i] of ``head`` in a contiguous [tokens, heads]
    tensor."""
    return tl.load(_at(ptr, start, heads, head, 1) + r * heads, mask=valid, other=0.0).to(tl.float32)


@triton.jit
def _put(ptr, start, t, valid, heads, head, DIM: tl.constexpr, col0, COLS: tl.constexpr, x):
    """Store x [64, COLS] at the chunk's tokens (valid rows only), columns col0.. of ``head``."""
    offsets = (t * (heads * DIM))[:, None] + (col0 + tl.arange(0, COLS))[None, :]
    tl.store(_at(ptr, start, heads, head, DIM) + offsets, x.to(ptr.dtype.element_ty), mask=valid[:, None])


@triton.jit
def _square(ptr, base, TRANSPOSED: tl.constexpr):
    """The [64, 64] tile at ``base`` of a [..., 64, 64] tensor, or its transpose."""
    r = tl.arange(0, _C)
    if TRANSPOSED:
        return tl.load(ptr + base + r[None, :] * _C + r[:, None])
    else:
        return tl.load(ptr + base + r[:, None] * _C + r[None, :])


@triton.jit
def _state_tile(ptr, base, row0, ROWS: tl.constexpr, col0, COLS: tl.constexpr, V: tl.constexpr,
                TRANSPOSED: tl.constexpr):
    """fp32 tile of a [K, V] state at ``base``: rows row0.., columns col0.. ([ROWS, COLS]), or its
    transpose ([COLS, ROWS])."""
    rows = row0 + tl.arange(0, ROWS)
    cols = col0 + tl.arange(0, COLS)
    if TRANSPOSED:
        return tl.load(ptr + base + rows[None, :] * V + cols[:, None]).to(tl.float32)
    else:
        return tl.load(ptr + base + rows[:, None] * V + cols[None, :]).to(tl.float32)


@triton.jit
def _decay_row(G_ptr, start, count, value_heads, hv, K: tl.constexpr, row, col0, COLS: tl.constexpr):
    """G of a per-channel decay at row ``row`` of the chunk (zero past its end): [COLS] key
    channels col0.."""
    return tl.load(_at(G_ptr, start, value_heads, hv, K) + row * (value_heads * K) + col0 + tl.arange(0, COLS),
                   mask=row < count, other=0.0)


@triton.jit
def _channel_decay_to_chunk_end(G_ptr, start, count, value_heads, hv, K: tl.constexpr):
    """Diag(Gamma_C) of a per-channel decay, the chunk's decay of a state's rows: [K]."""
    return tl.exp(_decay_row(G_ptr, start, count, value_heads, hv, K, count - 1, 0, K))


@triton.jit
def _head_decays(G_ptr, start, count, t, valid, value_heads, hv):
    """One log-decay per head: Gamma = exp(G) and Gamma_C / Gamma = exp(G_C - G) of the chunk's
    rows, [64] fp32 each, the row factors of the decayed queries Gamma q and keys k Gamma_C / Gamma
    (formed from q and k where they are used; a per-channel decay stores them), and Gamma_C, the
    chunk's decay of a state (a scalar)."""
    G = _vec(G_ptr, start, t, valid, value_heads, hv)
    G_end = tl.load(_at(G_ptr, start, value_heads, hv, 1) + (count - 1) * value_heads)
    return tl.exp(G), tl.exp(tl.minimum(G_end - G, 0.0)), tl.exp(G_end)


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["value_heads"])
def _chunk_cumsum_kernel(g_ptr, out_ptr, chunks_ptr, value_heads, K: tl.constexpr, BK: tl.constexpr,
                         PER_CHANNEL: tl.constexpr):
    """G = the cumulative sum of g inside each chunk, in fp32."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    start, count, t, valid = chunk_rows(chunks_ptr, c, _C)
    if PER_CHANNEL:
        for kb in range(0, K // BK):
            g = _rows(g_ptr, start, t, valid, value_heads, hv, K, kb * BK, BK)
            _put(out_ptr, start, t, valid, value_heads, hv, K, kb * BK, BK, tl.cumsum(g, 0))
    else:
        g = _vec(g_ptr, start, t, valid, value_heads, hv)
        tl.store(_at(out_ptr, start, value_heads, hv, 1) + t * value_heads, tl.cumsum(g, 0), mask=valid)


@triton.jit(do_not_specialize=["key_heads", "value_heads", "group"])
def _fwd_scores_kernel(q_ptr, k_ptr, beta_ptr, erase_ptr, G_ptr, A_ptr, P_ptr, chunks_ptr,
                       key_heads, value_heads, group,
                       K: tl.constexpr, BK: tl.constexpr, G_MODE: tl.constexpr, ERASE: tl.constexpr,
                       DOT: tl.constexpr, IEEE: tl.constexpr):
    """A (strictly lower, fp32) and P (lower with the diagonal) of one chunk and v head.
    G_MODE: 0 no decay, 1 one log-decay per head, 2 one per key channel."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // group
    start, count, t, valid = chunk_rows(chunks_ptr, c, _C)
    blk = t // _SUB
    within = t % _SUB
    scores_p = tl.zeros([_C, _C], dtype=tl.float32)
    scores_a = tl.zeros([_C, _C], dtype=tl.float32)
    if not ERASE:
        beta = _vec(beta_ptr, start, t, valid, value_heads, hv)
    for kb in range(0, K // BK):
        c0 = kb * BK
        q = _rows(q_ptr, start, t, valid, key_heads, hk, K, c0, BK)
        k = _rows(k_ptr, start, t, valid, key_heads, hk, K, c0, BK)
        if ERASE:
            a = k * _rows(erase_ptr, start, t, valid, value_heads, hv, K, c0, BK)
        else:
            a = k * beta[:, None]
        k_t = _cols(k_ptr, start, t, valid, key_heads, hk, K, c0, BK)
        if G_MODE == 2:
            G = _rows(G_ptr, start, t, valid, value_heads, hv, K, c0, BK)
            G_t = _cols(G_ptr, start, t, valid, value_heads, hv, K, c0, BK)
            # Off-diagonal sub-blocks: the rows of sub-block i against all earlier columns.
            for i in tl.static_range(1, 4):
                G_ref = _decay_row(G_ptr, start, count, value_heads, hv, K, i * _SUB, c0, BK)
                row_decay = tl.where((blk == i)[:, None], tl.exp(tl.minimum(G - G_ref[None, :], 0.0)), 0.0)
                cols_t = tl.where((t < i * _SUB)[None, :],
                                  k_t * tl.exp(tl.minimum(G_ref[:, None] - G_t, 0.0)), 0.0)
                scores_p += _mm(q * row_decay, cols_t, DOT, IEEE)
                scores_a += _mm(a * row_decay, cols_t, DOT, IEEE)
            # Diagonal sub-blocks, exactly: step j fills column 16 * blk + j of every row.
            for j in range(0, _SUB):
                col = blk * _SUB + j
                col_valid = col < count
                k_col = _rows(k_ptr, start, col, col_valid, key_heads, hk, K, c0, BK)
                G_col = _rows(G_ptr, start, col, col_valid, value_heads, hv, K, c0, BK)
                k_decayed = k_col * tl.where((within >= j)[:, None], tl.exp(-tl.abs(G - G_col)), 0.0)
                hit = t[None, :] == col[:, None]
                scores_p += tl.where(hit, tl.sum(q * k_decayed, 1)[:, None], 0.0)
                scores_a += tl.where(hit & (within > j)[:, None], tl.sum(a * k_decayed, 1)[:, None], 0.0)
        else:
            scores_p += _mm(q, k_t, DOT, IEEE)
            scores_a += _mm(a, k_t, DOT, IEEE)
    if G_MODE != 2:
        if G_MODE == 1:
            G = _vec(G_ptr, start, t, valid, value_heads, hv)
            decay = tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0))
            scores_p = scores_p * decay
            scores_a = scores_a * decay
        scores_p = tl.where(t[:, None] >= t[None, :], scores_p, 0.0)
        scores_a = tl.where(t[:, None] > t[None, :], scores_a, 0.0)
    offsets = t[:, None] * _C + t[None, :]
    base = (c * value_heads + hv) * _C * _C
    tl.store(A_ptr + base + offsets, scores_a)
    tl.store(P_ptr + base + offsets, scores_p.to(P_ptr.dtype.element_ty))


@triton.jit
def _block_t(ptr, base, i: tl.constexpr, j: tl.constexpr):
    """The transpose of 16 x 16 block (i, j) of the [64, 64] tile at ``base``, loaded transposed."""
    r = tl.arange(0, _SUB)
    return tl.load(ptr + base + (r + i * _SUB)[None, :] * _C + (r + j * _SUB)[:, None])


@triton.jit
def _put_block_t(ptr, base, i: tl.constexpr, j: tl.constexpr, x_t):
    """Store block (i, j) of the [64, 64] tile at ``base``, given its transpose x_t (stored
    transposed)."""
    r = tl.arange(0, _SUB)
    tl.store(ptr + base + (r + i * _SUB)[None, :] * _C + (r + j * _SUB)[:, None], x_t.to(ptr.dtype.element_ty))


@triton.jit
def _block_dot(a, b, IEEE: tl.constexpr):
    """a @ b of fp32 16 x 16 blocks: in full fp32 ("ieee", on FMA units) where IEEE, else TF32 on
    tensor cores (T is stored in 16 bits then)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _diagonal_block(x, b, which: tl.constexpr):
    """x[which] of a [4, 16, 16] tile whose first axis is b."""
    return tl.sum(tl.where(b == which, x, 0.0), 0)


@triton.jit
def _invert_kernel(A_ptr, T_ptr, IEEE: tl.constexpr = True):
    """T = (I + A)^-1 of one chunk and head, by 16 x 16 blocks: the four diagonal blocks T_bb
    together by forward substitution, then T_ij = -T_ii sum_{j <= m < i} A_im T_mj. Computed as
    T^T, whose blocks are the transposes T_bb^T and T_ij^T = -(sum_m T_mj^T A_im^T) T_ii^T (the
    same products), with A's blocks loaded and T's stored transposed: tij and aij below are
    T_ij^T and A_ij^T."""
    base = tl.program_id(0).to(tl.int64) * _C * _C
    b = tl.arange(0, 4)[:, None, None]
    j = tl.arange(0, _SUB)[None, :, None]
    m = tl.arange(0, _SUB)[None, None, :]
    # inverse_t[b, j, m] = T_bb[m, j]. Step i sets row i of all four blocks from their rows m < i,
    # T_bb[i, j] = delta_ij - sum_m A_bb[i, m] T_bb[m, j], reading row i of each A_bb from memory:
    # one reduction over m (the last axis, inside a warp) per step for all four blocks, and no
    # row extracted from a tile (a reduction across warps per step and block). A step's work is
    # shorter than a load's latency, so the rows come three steps ahead (num_stages=4: Triton's
    # pipeliner copies them to shared memory asynchronously), and the off-diagonal blocks are
    # loaded first.
    a10 = _block_t(A_ptr, base, 1, 0)
    a20 = _block_t(A_ptr, base, 2, 0)
    a21 = _block_t(A_ptr, base, 2, 1)
    a30 = _block_t(A_ptr, base, 3, 0)
    a31 = _block_t(A_ptr, base, 3, 1)
    a32 = _block_t(A_ptr, base, 3, 2)
    inverse_t = tl.broadcast_to((j == m).to(tl.float32), [4, _SUB, _SUB])
    rows_of_a = A_ptr + base + b * (_SUB * (_C + 1)) + j * 0 + m  # A[16 b, 16 b + m], for every j
    for i in tl.range(1, _SUB, num_stages=4):
        a_row = tl.load(rows_of_a + i * _C)
        row = (j == i).to(tl.float32) - tl.sum(a_row * inverse_t, 2, keep_dims=True)
        inverse_t = tl.where(m == i, row, inverse_t)
    t00 = _diagonal_block(inverse_t, b, 0)
    t11 = _diagonal_block(inverse_t, b, 1)
    t22 = _diagonal_block(inverse_t, b, 2)
    t33 = _diagonal_block(inverse_t, b, 3)
    t10 = -_block_dot(_block_dot(t00, a10, IEEE), t11, IEEE)
    t21 = -_block_dot(_block_dot(t11, a21, IEEE), t22, IEEE)
    t20 = -_block_dot(_block_dot(t00, a20, IEEE) + _block_dot(t10, a21, IEEE), t22, IEEE)
    t32 = -_block_dot(_block_dot(t22, a32, IEEE), t33, IEEE)
    t31 = -_block_dot(_block_dot(t11, a31, IEEE) + _block_dot(t21, a32, IEEE), t33, IEEE)
    t30 = -_block_dot(_block_dot(t00, a30, IEEE) + _block_dot(t10, a31, IEEE) + _block_dot(t20, a32, IEEE),
                      t33, IEEE)
    zero = tl.zeros([_SUB, _SUB], dtype=tl.float32)
    _put_block_t(T_ptr, base, 0, 0, t00)
    _put_block_t(T_ptr, base, 0, 1, zero)
    _put_block_t(T_ptr, base, 0, 2, zero)
    _put_block_t(T_ptr, base, 0, 3, zero)
    _put_block_t(T_ptr, base, 1, 0, t10)
    _put_block_t(T_ptr, base, 1, 1, t11)
    _put_block_t(T_ptr, base, 1, 2, zero)
    _put_block_t(T_ptr, base, 1, 3, zero)
    _put_block_t(T_ptr, base, 2, 0, t20)
    _put_block_t(T_ptr, base, 2, 1, t21)
    _put_block_t(T_ptr, base, 2, 2, t22)
    _put_block_t(T_ptr, base, 2, 3, zero)
    _put_block_t(T_ptr, base, 3, 0, t30)
    _put_block_t(T_ptr, base, 3, 1, t31)
    _put_block_t(T_ptr, base, 3, 2, t32)
    _put_block_t(T_ptr, base, 3, 3, t33)


@triton.jit(do_not_specialize=["key_heads", "value_heads", "group"])
def _fwd_prepare_kernel(q_ptr, k_ptr, v_ptr, beta_ptr, erase_ptr, write_ptr, G_ptr, T_ptr,
                        W_ptr, Y_ptr, KD_ptr, QG_ptr, chunks_ptr, key_heads, value_heads, group,
                        K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        G_MODE: tl.constexpr, ERASE: tl.constexpr, WRITE: tl.constexpr,
                        DOT: tl.constexpr, IEEE: tl.constexpr):
    """W = T (Gamma * a) and Y = T x of one chunk and v head; with a per-channel decay also the
    decayed keys k Gamma_C / Gamma and queries Gamma * q (with one decay per head or none, the
    kernels that use them form them from k and q)."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    hk = hv // group
    start, count, t, valid = chunk_rows(chunks_ptr, c, _C)
    inverse = _square(T_ptr, (c * value_heads + hv) * _C * _C, False)
    if not (ERASE and WRITE):
        beta = _vec(beta_ptr, start, t, valid, value_heads, hv)
    if G_MODE == 1:
        decay, _, _ = _head_decays(G_ptr, start, count, t, valid, value_heads, hv)
        decay = decay[:, None]
    for kb in range(0, K // BK):
        c0 = kb * BK
        k = _rows(k_ptr, start, t, valid, key_heads, hk, K, c0, BK)
        if ERASE:
            a = k * _rows(erase_ptr, start, t, valid, value_heads, hv, K, c0, BK)
        else:
            a = k * beta[:, None]
        if G_MODE == 2:
            G = _rows(G_ptr, start, t, valid, value_heads, hv, K, c0, BK)
            decay = tl.exp(G)
            decay_to_end = tl.exp(tl.minimum(
                _decay_row(G_ptr, start, count, value_heads, hv, K, count - 1, c0, BK)[None, :] - G, 0.0))
        if G_MODE != 0:
            a = a * decay
        if G_MODE == 2:
            _put(KD_ptr, start, t, valid, value_heads, hv, K, c0, BK, k * decay_to_end)
            _put(QG_ptr, start, t, valid, value_heads, hv, K, c0, BK,
                 _rows(q_ptr, start, t, valid, key_heads, hk, K, c0, BK) * decay)
        _put(W_ptr, start, t, valid, value_heads, hv, K, c0, BK, _mm(inverse, a, DOT, IEEE))
    for vb in range(0, V // BV):
        v0 = vb * BV
        x = _rows(v_ptr, start, t, valid, value_heads, hv, V, v0, BV)
        if WRITE:
            x = x * _rows(write_ptr, start, t, valid, value_heads, hv, V, v0, BV)
        else:
            x = x * beta[:, None]
        _put(Y_ptr, start, t, valid, value_heads, hv, V, v0, BV, _mm(inverse, x, DOT, IEEE))


@triton.jit
def _walk_start(init_ptr, n, value_heads, hv, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr,
                has_init, WALK: tl.constexpr):
    """The state a state walk (_fwd_state, _bwd_state) starts from, transposed: [BV, K] fp32 (row j
    is column v0 + j of the [K, V] state), and whether its columns are value columns. WALK 0 (whole
    sequences) and 2 (segments from their entering states): columns v0.. of init [n, hv]
    ([walks, Hv, K, V]), zero without it. WALK 1 (segments, local): the value columns (v0 < V)
    start from zero and the transition columns V.. V + K - 1 from the identity's (see "Segmented
    walks")."""
    rows = tl.arange(0, K)
    cols = v0 + tl.arange(0, BV)
    if WALK == 1:
        state = tl.where(cols[:, None] - V == rows[None, :], 1.0, 0.0)
    else:
        state = tl.zeros([BV, K], dtype=tl.float32)
        if has_init != 0:
            state = tl.load(init_ptr + (n * value_heads + hv) * K * V + rows[None, :] * V + cols[:, None]
                            ).to(tl.float32)
    return state, v0 < V


@triton.jit
def _walk_end(out_ptr, n, value_heads, hv, K: tl.constexpr, V: tl.constexpr, v0, BV: tl.constexpr, state,
              WALK: tl.constexpr):
    """Store the state a walk ends with (transposed, [BV, K]): WALK 0 at [n, hv] of out
    [N, Hv, K, V]; WALK 1 at columns v0.. of out [segments, Hv, K, V + K]; WALK 2 not at all (the
    combine has it)."""
    if WALK != 2:
        width = V + K if WALK == 1 else V
        rows = tl.arange(0, K)
        cols = v0 + tl.arange(0, BV)
        tl.store(out_ptr + (n * value_heads + hv) * K * width + rows[None, :] * width + cols[:, None], state)


@triton.jit
def _put_t(ptr, start, t, valid, heads, head, DIM: tl.constexpr, col0, COLS: tl.constexpr, x_t):
    """Store x_t [COLS, 64], the transpose of a [64, COLS] tile, as ``_put`` stores the tile."""
    offsets = (t * (heads * DIM))[None, :] + (col0 + tl.arange(0, COLS))[:, None]
    tl.store(_at(ptr, start, heads, head, DIM) + offsets, x_t.to(ptr.dtype.element_ty), mask=valid[None, :])


@triton.jit(do_not_specialize=["key_heads", "value_heads", "group", "has_initial"])
def _fwd_state_kernel(k_ptr, G_ptr, W_ptr, Y_ptr, KD_ptr, h_ptr, U_ptr, h0_ptr, final_ptr,
                      cu_ptr, seq_chunks_ptr, key_heads, value_heads, group, has_initial,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G_MODE: tl.constexpr,
                      WALK: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """One walk (a sequence, or a segment: see "Segmented walks"), v head and block of BV
    columns, chunk after chunk: U = Y - W S and S <- Diag(Gamma_C) S + (k Gamma_C / Gamma)^T U;
    stores the state entering each chunk, U and the final state (WALK 0), only the final state
    (WALK 1, where transition columns have Y = 0), or all but the final state (WALK 2). The walk
    carries S transposed, [BV, K], so that the chain's dots, U^T = Y^T - S^T W^T and S^T <- S^T
    Diag(Gamma_C) + U^T (k Gamma_C / Gamma), take what the step before computed as their first
    operand (registers) and tiles loaded from memory as their second."""
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // group
    in_state = tl.arange(0, K)[None, :] * V + (v0 + tl.arange(0, BV))[:, None]  # [BV, K] of a [K, V] state
    state, values = _walk_start(h0_ptr, n, value_heads, hv, K, V, v0, BV, has_initial, WALK)
    y0 = v0 % V  # a transition column's Y is zero: its load is masked off, its address in range
    first = tl.load(seq_chunks_ptr + n).to(tl.int64)
    bos, eos = tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    for j in range(0, tl.cdiv(eos - bos, _C)):
        c = first + j
        start, count, t, valid = sequence_chunk_rows(bos, eos, j, _C)
        if WALK != 1:
            tl.store(h_ptr + (c * value_heads + hv) * K * V + in_state, state.to(h_ptr.dtype.element_ty))
        w_t = _tile(W_ptr, start, t, valid, value_heads, hv, K, 0, K, True)
        U_t = (_tile(Y_ptr, start, t, valid & values, value_heads, hv, V, y0, BV, True)
               - _mm(state, w_t, DOT, IEEE))
        if WALK != 1:
            _put_t(U_ptr, start, t, valid, value_heads, hv, V, v0, BV, U_t)
        if G_MODE == 2:
            keys = _tile(KD_ptr, start, t, valid, value_heads, hv, K, 0, K, False)
        else:
            keys = _tile(k_ptr, start, t, valid, key_heads, hk, K, 0, K, False)
        if G_MODE == 1:
            _, decay_to_end, chunk_decay = _head_decays(G_ptr, start, count, t, valid, value_heads, hv)
            keys = keys.to(tl.float32) * decay_to_end[:, None]
            state = state * chunk_decay
        elif G_MODE == 2:
            state = state * _channel_decay_to_chunk_end(G_ptr, start, count, value_heads, hv, K)[None, :]
        state += _mm(U_t, keys, DOT, IEEE)
    _walk_end(final_ptr, n, value_heads, hv, K, V, v0, BV, state, WALK)


@triton.jit(do_not_specialize=["value_heads", "has_init"])
def _combine_segments_kernel(LM_ptr, init_ptr, starts_ptr, out_ptr, seq_segments_ptr, value_heads, has_init,
                             K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, REVERSE: tl.constexpr):
    """One sequence, v head and block of BV columns, segment after segment (in reverse with
    REVERSE): stores the state entering each segment in starts [segments, Hv, K, V] and moves it
    across the segment, S <- M S + L (carried transposed, as the walks carry it: S^T <- S^T M^T +
    L^T) with M and L the segment's WALK 1 result in LM
    [segments, Hv, K, V + K] (L its value columns, M its transition columns); starts from init
    [N, Hv, K, V] (zero without it) and stores the last state in out [N, Hv, K, V]. All fp32,
    the product in "tf32x3" (three TF32 products on tensor cores, about fp32's accuracy; "ieee"
    on FMA units spills kilobytes a thread at K = 64)."""
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    rows = tl.arange(0, K)
    cols = v0 + tl.arange(0, BV)
    in_state = rows[None, :] * V + cols[:, None]  # [BV, K] of a [K, V] state, as the walks carry it
    state, _ = _walk_start(init_ptr, n, value_heads, hv, K, V, v0, BV, has_init, 0)
    first = tl.load(seq_segments_ptr + n)
    segments = tl.load(seq_segments_ptr + n + 1) - first
    for i in range(0, segments):
        if REVERSE:
            s = (first + segments - 1 - i).to(tl.int64)
        else:
            s = (first + i).to(tl.int64)
        tl.store(starts_ptr + (s * value_heads + hv) * K * V + in_state, state)
        base = LM_ptr + (s * value_heads + hv) * K * (V + K) + rows[None, :] * (V + K)  # row r of L | M, as a column
        transition_t = tl.load(base + V + rows[:, None])  # M^T
        state = tl.load(base + cols[:, None]) + tl.dot(state, transition_t, input_precision="tf32x3")
    tl.store(out_ptr + (n * value_heads + hv) * K * V + in_state, state)


@triton.jit(do_not_specialize=["key_heads", "value_heads", "group"])
def _fwd_output_kernel(q_ptr, G_ptr, QG_ptr, P_ptr, h_ptr, U_ptr, o_ptr, chunks_ptr,
                       key_heads, value_heads, group, scale,
                       K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       G_MODE: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """o = scale * ((Gamma * q) S_0 + P U) for one chunk, v head and block of V columns."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // group
    start, count, t, valid = chunk_rows(chunks_ptr, c, _C)
    out = _mm(_square(P_ptr, (c * value_heads + hv) * _C * _C, False),
              _tile(U_ptr, start, t, valid, value_heads, hv, V, v0, BV, False), DOT, IEEE)
    state_base = (c * value_heads + hv) * K * V
    if G_MODE == 1:
        decay, _, _ = _head_decays(G_ptr, start, count, t, valid, value_heads, hv)
    for kb in range(0, K // BK):
        if G_MODE == 2:
            q = _tile(QG_ptr, start, t, valid, value_heads, hv, K, kb * BK, BK, False)
        else:
            q = _tile(q_ptr, start, t, valid, key_heads, hk, K, kb * BK, BK, False)
        if G_MODE == 1:
            q = q.to(tl.float32) * decay[:, None]
        out += _mm(q, _state_tile(h_ptr, state_base, kb * BK, BK, v0, BV, V, False), DOT, IEEE)
    _put(o_ptr, start, t, valid, value_heads, hv, V, v0, BV, out * scale)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["key_heads", "value_heads", "group"])
def _bwd_state_kernel(q_ptr, k_ptr, G_ptr, W_ptr, KD_ptr, QG_ptr, P_ptr, do_ptr, dr_ptr, dfinal_ptr,
                      dh_ptr, dU_ptr, dh0_ptr, cu_ptr, seq_chunks_ptr,
                      key_heads, value_heads, group, scale,
                      K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, G_MODE: tl.constexpr,
                      HAS_DR: tl.constexpr, WALK: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """One walk (a sequence, or a segment: see "Segmented walks"), v head and block of BV
    columns, chunk after chunk in reverse: dU = P^T dO' + (k Gamma_C / Gamma) dS_C and
    dS_0 = Diag(Gamma_C) dS_C + (Gamma q)^T dO' - W^T dU; stores dS_C per chunk, dU and the
    initial state's gradient (WALK 0), only the last (WALK 1, where transition columns have
    dO = 0), or all but the last (WALK 2). As in _fwd_state, dS is carried transposed ([BV, K]):
    dU^T = dO'^T P + dS_C^T (k Gamma_C / Gamma)^T, dS_0^T = dS_C^T Diag(Gamma_C) + dO'^T (Gamma q)
    - dU^T W."""
    n = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BV
    hk = hv // group
    in_state = tl.arange(0, K)[None, :] * V + (v0 + tl.arange(0, BV))[:, None]  # [BV, K] of a [K, V] state
    d_state, values = _walk_start(dfinal_ptr, n, value_heads, hv, K, V, v0, BV, 1, WALK)
    y0 = v0 % V  # a transition column's dO is zero: its load is masked off, its address in range
    first = tl.load(seq_chunks_ptr + n).to(tl.int64)
    bos, eos = tl.load(cu_ptr + n), tl.load(cu_ptr + n + 1)
    chunks = tl.cdiv(eos - bos, _C)
    for step in range(0, chunks):  # the walk's chunks in reverse
        j = chunks - 1 - step
        c = first + j
        start, count, t, valid = sequence_chunk_rows(bos, eos, j, _C)
        if WALK != 1:
            tl.store(dh_ptr + (c * value_heads + hv) * K * V + in_state, d_state.to(dh_ptr.dtype.element_ty))
        d_out_t = _cols(do_ptr, start, t, valid & values, value_heads, hv, V, y0, BV) * scale
        if G_MODE == 2:
            keys_t = _tile(KD_ptr, start, t, valid, value_heads, hv, K, 0, K, True)
            queries = _tile(QG_ptr, start, t, valid, value_heads, hv, K, 0, K, False)
        else:
            keys_t = _tile(k_ptr, start, t, valid, key_heads, hk, K, 0, K, True)
            queries = _tile(q_ptr, start, t, valid, key_heads, hk, K, 0, K, False)
        if G_MODE == 1:
            decay, decay_to_end, chunk_decay = _head_decays(G_ptr, start, count, t, valid, value_heads, hv)
            keys_t = keys_t.to(tl.float32) * decay_to_end[None, :]
            queries = queries.to(tl.float32) * decay[:, None]
        d_u_t = (_mm(d_out_t, _square(P_ptr, (c * value_heads + hv) * _C * _C, False), DOT, IEEE)
                 + _mm(d_state, keys_t, DOT, IEEE))
        if HAS_DR:
            d_u_t += _cols(dr_ptr, start, t, valid & values, value_heads, hv, V, y0, BV)
        if WALK != 1:
            _put_t(dU_ptr, start, t, valid, value_heads, hv, V, v0, BV, d_u_t)
        if G_MODE == 1:
            d_state = d_state * chunk_decay
        elif G_MODE == 2:
            d_state = d_state * _channel_decay_to_chunk_end(G_ptr, start, count, value_heads, hv, K)[None, :]
        d_state += (_mm(d_out_t, queries, DOT, IEEE)
                    - _mm(d_u_t, _tile(W_ptr, start, t, valid, value_heads, hv, K, 0, K, False), DOT, IEEE))
    _walk_end(dh0_ptr, n, value_heads, hv, K, V, v0, BV, d_state, WALK)


@triton.jit(do_not_specialize=["value_heads"])
def _bwd_scores_kernel(v_ptr, beta_ptr, write_ptr, T_ptr, U_ptr, do_ptr, dU_ptr, dP_ptr, dA_ptr,
                       dv_ptr, dwrite_ptr, dbeta_ptr, chunks_ptr, value_heads, scale,
                       V: tl.constexpr, BV: tl.constexpr, WRITE: tl.constexpr,
                       DOT: tl.constexpr, IEEE: tl.constexpr):
    """dX = T^T dU, dO' U^T and -dX U^T (whole: _bwd_qkg takes dP and dA from them by masking),
    dv = w * dX and dw = v * dX (summed over V into beta's share where w is beta) for one chunk
    and v head."""
    c = tl.program_id(0).to(tl.int64)
    hv = tl.program_id(1)
    start, count, t, valid = chunk_rows(chunks_ptr, c, _C)
    base = (c * value_heads + hv) * _C * _C
    inverse_t = _square(T_ptr, base, True)
    d_scores_p = tl.zeros([_C, _C], dtype=tl.float32)
    d_scores_a = tl.zeros([_C, _C], dtype=tl.float32)
    if not WRITE:
        beta = _vec(beta_ptr, start, t, valid, value_heads, hv)
        d_beta = tl.zeros([_C], dtype=tl.float32)
    for vb in range(0, V // BV):
        v0 = vb * BV
        U_t = _tile(U_ptr, start, t, valid, value_heads, hv, V, v0, BV, True)
        d_x = _mm(inverse_t, _tile(dU_ptr, start, t, valid, value_heads, hv, V, v0, BV, False), DOT, IEEE)
        d_scores_p += _mm(_rows(do_ptr, start, t, valid, value_heads, hv, V, v0, BV) * scale, U_t, DOT, IEEE)
        d_scores_a += _mm(d_x, U_t, DOT, IEEE)
        v = _rows(v_ptr, start, t, valid, value_heads, hv, V, v0, BV)
        if WRITE:
            _put(dv_ptr, start, t, valid, value_heads, hv, V, v0, BV,
                 d_x * _rows(write_ptr, start, t, valid, value_heads, hv, V, v0, BV))
            _put(dwrite_ptr, start, t, valid, value_heads, hv, V, v0, BV, d_x * v)
        else:
            _put(dv_ptr, start, t, valid, value_heads, hv, V, v0, BV, d_x * beta[:, None])
            d_beta += tl.sum(d_x * v, 1)
    offsets = t[:, None] * _C + t[None, :]
    tl.store(dP_ptr + base + offsets, d_scores_p.to(dP_ptr.dtype.element_ty))
    tl.store(dA_ptr + base + offsets, (-d_scores_a).to(dA_ptr.dtype.element_ty))
    if not WRITE:
        tl.store(_at(dbeta_ptr, start, value_heads, hv, 1) + t * value_heads, d_beta, mask=valid)


@triton.jit
def _qkg_state_terms(h_ptr, dh_ptr, U_ptr, dU_ptr, do_ptr, start, t, valid, value_heads, hv, state_base,
                     scale, c0, BK: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr,
                     IEEE: tl.constexpr):
    """The terms of _bwd_qkg from the states, for key channels c0.. (BK of them) of one chunk and v
    head: d(Gamma * q) = dO' S_0^T (o's state term), dU S_0^T (d(Gamma * a) = -T^T dU S_0^T) and
    d(k Gamma_C / Gamma) = U dS_C^T (from S_C), [64, BK] each, and rowsum(S_0 * dS_C) [BK]."""
    d_qg = tl.zeros([_C, BK], dtype=tl.float32)
    d_us = tl.zeros([_C, BK], dtype=tl.float32)
    d_kd = tl.zeros([_C, BK], dtype=tl.float32)
    d_end = tl.zeros([BK], dtype=tl.float32)
    for vb in range(0, V // BV):
        v0 = vb * BV
        state_t = _state_tile(h_ptr, state_base, c0, BK, v0, BV, V, True)
        d_state_t = _state_tile(dh_ptr, state_base, c0, BK, v0, BV, V, True)
        d_qg += _mm(_rows(do_ptr, start, t, valid, value_heads, hv, V, v0, BV) * scale, state_t, DOT, IEEE)
        d_us += _mm(_tile(dU_ptr, start, t, valid, value_heads, hv, V, v0, BV, False), state_t, DOT, IEEE)
        d_kd += _mm(_tile(U_ptr, start, t, valid, value_heads, hv, V, v0, BV, False), d_state_t, DOT, IEEE)
        d_end += tl.sum(state_t * d_state_t, 0)
    return d_qg, d_us, d_kd, d_end


@triton.jit
def _group_put(out_ptr, acc_ptr, start, t, valid, key_heads, hk, K: tl.constexpr, c0, BK: tl.constexpr, x,
               member, group):
    """Add x, the share of v head ``member`` of its q/k head's group in a q or k gradient tile, to
    the group's sum: members before the last leave fp32 partial sums in acc (the same program's
    tile, read back by the next member), the last stores the sum in out's dtype."""
    if member > 0:
        x += _rows(acc_ptr, start, t, valid, key_heads, hk, K, c0, BK)
    if member == group - 1:
        _put(out_ptr, start, t, valid, key_heads, hk, K, c0, BK, x)
    else:
        _put(acc_ptr, start, t, valid, key_heads, hk, K, c0, BK, x)


@triton.jit(do_not_specialize=["num_tokens", "key_heads", "value_heads", "group"])
def _bwd_qkg_kernel(q_ptr, k_ptr, beta_ptr, erase_ptr, G_ptr, T_ptr, h_ptr, dh_ptr, U_ptr, dU_ptr,
                    do_ptr, dP_ptr, dA_ptr, dq_ptr, dk_ptr, dq_acc_ptr, dk_acc_ptr, derase_ptr, dbeta_ptr, dg_ptr,
                    chunks_ptr, num_tokens, key_heads, value_heads, group, scale, GROUP_LOOP: tl.constexpr,
                    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                    G_MODE: tl.constexpr, ERASE: tl.constexpr, DOT: tl.constexpr, IEEE: tl.constexpr):
    """dq and dk of one chunk and q/k head, and for each v head of its group the erase gate's
    gradient (or beta's share) and dg, BK key channels at a time. With GROUP_LOOP the program takes
    the group's v heads one after another and sums their shares of dq and dk itself
    (``_group_put``); without, the group is one v head (no loop, partial sums or barrier), as it
    always is with a per-channel decay (see "Hopper"). G_MODE is 1 or 2: without a decay the host
    passes a zero per-head one (see "Hopper" in the module docstring). With one decay per head
    (grid [NC, Hk]) the program loops over the key blocks: it masks and decays the
    [64, 64] tiles of dP and dA (and their transposes) once per v head, before the loop, and sums
    dg and beta's share over the key blocks itself. With one per key channel those tiles decay per
    channel: one program per head and key block (grid [NC, Hk, K/BK]), and beta's share is a
    partial sum over the key blocks, at [kb, token, head]. dP and dA come whole from _bwd_scores
    and are masked here, as they are used, so that their tiles reach tl.dot from registers, not
    straight from memory."""
    c = tl.program_id(0).to(tl.int64)
    start, count, t, valid = chunk_rows(chunks_ptr, c, _C)
    last_row = count - 1
    hk = tl.program_id(1)
    if GROUP_LOOP:  # over the q/k head's group of v heads, summing their shares
        members = group
    else:  # one v head per q/k head: no loop, no partial sums, no barrier
        members = 1
    for member in range(0, members):
        hv = hk * members + member
        state_base = (c * value_heads + hv) * K * V
        square = (c * value_heads + hv) * _C * _C
        if G_MODE == 2:
            kb = tl.program_id(2)
            c0 = kb * BK
            d_qg, d_us, d_kd, d_end = _qkg_state_terms(h_ptr, dh_ptr, U_ptr, dU_ptr, do_ptr, start, t, valid,
                                                       value_heads, hv, state_base, scale, c0, BK, V, BV, DOT, IEEE)
            d_ga = -_mm(_square(T_ptr, square, True), d_us, DOT, IEEE)  # d(Gamma * a)
            q = _rows(q_ptr, start, t, valid, key_heads, hk, K, c0, BK)
            k = _rows(k_ptr, start, t, valid, key_heads, hk, K, c0, BK)
            if ERASE:
                gate = _rows(erase_ptr, start, t, valid, value_heads, hv, K, c0, BK)
            else:
                gate = _vec(beta_ptr, start, t, valid, value_heads, hv)[:, None]
            a = k * gate
            blk = t // _SUB
            within = t % _SUB
            G = _rows(G_ptr, start, t, valid, value_heads, hv, K, c0, BK)
            G_end = _decay_row(G_ptr, start, count, value_heads, hv, K, count - 1, c0, BK)
            # Diagonal sub-blocks, exactly: step j pairs each row with row 16 * blk + j of its
            # sub-block, as its column (rows at or after it; for A after it) or as its row (rows up to
            # it; for A before it), the pairs chosen by masking the per-row entries of dP and dA. They
            # have accumulators of their own (in the layout of the loads, where those of the dots
            # would cost layout conversions at every step) and come first, where fewer registers are
            # live than around the dots.
            d_q_diag = tl.zeros([_C, BK], dtype=tl.float32)
            d_a_diag = tl.zeros([_C, BK], dtype=tl.float32)
            d_k_diag = tl.zeros([_C, BK], dtype=tl.float32)
            for j in range(0, _SUB):
                other = blk * _SUB + j
                other_valid = other < count
                decay = tl.exp(-tl.abs(G - _rows(G_ptr, start, other, other_valid, value_heads, hv, K, c0, BK)))
                k_decayed = _rows(k_ptr, start, other, other_valid, key_heads, hk, K, c0, BK) * decay
                p_below = tl.load(dP_ptr + square + t * _C + other, mask=within >= j, other=0.0).to(tl.float32)
                a_below = tl.load(dA_ptr + square + t * _C + other, mask=within > j, other=0.0).to(tl.float32)
                p_above = tl.load(dP_ptr + square + other * _C + t, mask=within <= j, other=0.0).to(tl.float32)
                a_above = tl.load(dA_ptr + square + other * _C + t, mask=within < j, other=0.0).to(tl.float32)
                d_q_diag += p_below[:, None] * k_decayed
                d_a_diag += a_below[:, None] * k_decayed
                q_other = _rows(q_ptr, start, other, other_valid, key_heads, hk, K, c0, BK)
                if ERASE:
                    gate_other = _rows(erase_ptr, start, other, other_valid, value_heads, hv, K, c0, BK)
                    a_above_gate = a_above[:, None] * gate_other
                else:
                    a_above_gate = (a_above * _vec(beta_ptr, start, other, other_valid, value_heads, hv))[:, None]
                d_k_diag += p_above[:, None] * q_other * decay + a_above_gate * k_decayed
            d_q = tl.exp(G) * d_qg + d_q_diag
            d_a = tl.exp(G) * d_ga + d_a_diag
            d_k = tl.exp(tl.minimum(G_end[None, :] - G, 0.0)) * d_kd
            d_G_end = tl.sum(k * d_k, 0) + tl.exp(G_end) * d_end
            d_k += d_k_diag
            # Off-diagonal sub-blocks, referenced at the row sub-block's first token: the pairs (t, s)
            # of rows t in sub-block i and columns s before it.
            d_scores_p = _square(dP_ptr, square, False)
            d_scores_a = _square(dA_ptr, square, False)
            d_scores_p_t = _square(dP_ptr, square, True)
            d_scores_a_t = _square(dA_ptr, square, True)
            for i in tl.static_range(1, 4):
                G_ref = _decay_row(G_ptr, start, count, value_heads, hv, K, i * _SUB, c0, BK)
                row_decay = tl.exp(tl.minimum(G - G_ref[None, :], 0.0))
                col_decay = tl.exp(tl.minimum(G_ref[None, :] - G, 0.0))
                pairs = (blk == i)[:, None] & (t < i * _SUB)[None, :]    # [t, s]
                pairs_t = (t < i * _SUB)[:, None] & (blk == i)[None, :]  # [s, t]
                k_cols = k * col_decay
                d_q += row_decay * _mm(tl.where(pairs, d_scores_p, 0.0), k_cols, DOT, IEEE)
                d_a += row_decay * _mm(tl.where(pairs, d_scores_a, 0.0), k_cols, DOT, IEEE)
                d_k += col_decay * (_mm(tl.where(pairs_t, d_scores_p_t, 0.0), q * row_decay, DOT, IEEE)
                                    + _mm(tl.where(pairs_t, d_scores_a_t, 0.0), a * row_decay, DOT, IEEE))
            d_G = q * d_q + a * d_a - k * d_k
            d_G += tl.where((t == last_row)[:, None], d_G_end[None, :], 0.0)
            _put(dg_ptr, start, t, valid, value_heads, hv, K, c0, BK, tl.cumsum(d_G, 0, reverse=True))
            _group_put(dq_ptr, dq_acc_ptr, start, t, valid, key_heads, hk, K, c0, BK, d_q, member, members)
            _group_put(dk_ptr, dk_acc_ptr, start, t, valid, key_heads, hk, K, c0, BK, d_k + gate * d_a,
                       member, members)
            if ERASE:
                _put(derase_ptr, start, t, valid, value_heads, hv, K, c0, BK, k * d_a)
            else:
                partial_start = kb.to(tl.int64) * num_tokens + start  # this key block's row of partial sums
                tl.store(_at(dbeta_ptr, partial_start, value_heads, hv, 1) + t * value_heads, tl.sum(k * d_a, 1),
                         mask=valid)
        else:
            G = _vec(G_ptr, start, t, valid, value_heads, hv)
            G_end = tl.load(_at(G_ptr, start, value_heads, hv, 1) + last_row * value_heads)
            decay = tl.exp(tl.minimum(G[:, None] - G[None, :], 0.0))  # [t, s]
            decay_t = tl.exp(tl.minimum(G[None, :] - G[:, None], 0.0))  # [s, t]
            # The operands shared by all key blocks, in the dot dtype (the compiler keeps them in shared
            # memory through the loop).
            d_scores_p = (tl.where(t[:, None] >= t[None, :], _square(dP_ptr, square, False), 0.0) * decay).to(DOT)
            d_scores_a = (tl.where(t[:, None] > t[None, :], _square(dA_ptr, square, False), 0.0) * decay).to(DOT)
            d_scores_p_t = (tl.where(t[:, None] <= t[None, :], _square(dP_ptr, square, True), 0.0) * decay_t).to(DOT)
            d_scores_a_t = (tl.where(t[:, None] < t[None, :], _square(dA_ptr, square, True), 0.0) * decay_t).to(DOT)
            inverse_t = _square(T_ptr, square, True)
            if not ERASE:
                beta = _vec(beta_ptr, start, t, valid, value_heads, hv)
                d_beta = tl.zeros([_C], dtype=tl.float32)
            d_G = tl.zeros([_C], dtype=tl.float32)
            for kb in range(0, K // BK):
                c0 = kb * BK
                d_qg, d_us, d_kd, d_end = _qkg_state_terms(h_ptr, dh_ptr, U_ptr, dU_ptr, do_ptr, start, t, valid,
                                                           value_heads, hv, state_base, scale, c0, BK, V, BV, DOT,
                                                           IEEE)
                d_ga = -_mm(inverse_t, d_us, DOT, IEEE)  # d(Gamma * a)
                q = _rows(q_ptr, start, t, valid, key_heads, hk, K, c0, BK)
                k = _rows(k_ptr, start, t, valid, key_heads, hk, K, c0, BK)
                if ERASE:
                    gate = _rows(erase_ptr, start, t, valid, value_heads, hv, K, c0, BK)
                else:
                    gate = beta[:, None]
                a = k * gate
                d_k = tl.exp(tl.minimum(G_end - G, 0.0))[:, None] * d_kd
                d_G_end = tl.sum(tl.sum(k * d_k, 1), 0) + tl.exp(G_end) * tl.sum(d_end, 0)
                d_q = tl.exp(G)[:, None] * d_qg + _mm(d_scores_p, k, DOT, IEEE)
                d_a = tl.exp(G)[:, None] * d_ga + _mm(d_scores_a, k, DOT, IEEE)
                d_k += _mm(d_scores_p_t, q, DOT, IEEE) + _mm(d_scores_a_t, a, DOT, IEEE)
                d_G += tl.sum(q * d_q + a * d_a - k * d_k, 1) + tl.where(t == last_row, d_G_end, 0.0)
                _group_put(dq_ptr, dq_acc_ptr, start, t, valid, key_heads, hk, K, c0, BK, d_q, member, members)
                _group_put(dk_ptr, dk_acc_ptr, start, t, valid, key_heads, hk, K, c0, BK, d_k + gate * d_a,
                       member, members)
                if ERASE:
                    _put(derase_ptr, start, t, valid, value_heads, hv, K, c0, BK, k * d_a)
                else:
                    d_beta += tl.sum(k * d_a, 1)
            tl.store(_at(dg_ptr, start, value_heads, hv, 1) + t * value_heads, tl.cumsum(d_G, 0, reverse=True),
                     mask=valid)
            if not ERASE:
                tl.store(_at(dbeta_ptr, start, value_heads, hv, 1) + t * value_heads, d_beta, mask=valid)
        if GROUP_LOOP:
            tl.debug_barrier()  # the next member reads the partial sums this one stored


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------

class _Config:
    """What the autograd function needs besides the tensors: sizes, the form of the gates, the
    dot dtype, the chunk tables and the tile sizes."""

    def __init__(self, q, k, v, g, erase, write, scale, cu_seqlens, want_residual):
        self.batch, self.seq_len, self.key_heads, self.key_dim = q.shape
        self.value_heads, self.value_dim = v.shape[2], v.shape[3]
        self.group = self.value_heads // self.key_heads
        self.tokens = self.batch * self.seq_len
        self.scale = scale
        self.g_mode = 0 if g is None else (1 if g.dim() == 3 else 2)
        self.erase, self.write = erase is not None, write is not None
        self.want_residual = want_residual
        self.store_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        self.flags = dict(DOT=_DOT_DTYPES[self.store_dtype], IEEE=self.store_dtype == torch.float32)
        bounds = sequence_bounds(cu_seqlens, self.batch, self.seq_len)
        layout = chunk_layout(bounds, _C.value, q.device)
        self.chunks, self.cu, self.seq_chunks = layout.chunks, layout.cu, layout.seq_chunks
        self.num_chunks, self.num_states = layout.num_chunks, layout.num_seqs
        key_dim, value_dim = self.key_dim, self.value_dim
        self.block_k = min(key_dim, 64)
        self.block_v = min(value_dim, 64)
        self.score_block_k = min(key_dim, 32)  # _fwd_scores
        self.qkg_block_k = min(key_dim, 16 if self.g_mode == 2 else 32)  # _bwd_qkg
        fp32 = self.store_dtype == torch.float32
        self.qkg_warps = 8 if fp32 else 4  # _bwd_qkg
        self.score_block_v = min(value_dim, 32)  # _bwd_scores
        self.score_warps = 8 if fp32 else 4  # _bwd_scores
        state_block_v = min(value_dim, 64, max(16, 4096 // key_dim))  # _fwd_state
        # _bwd_state: 64 up to K = 128 on tensor cores (at K = 256 the shared memory would not fit)
        bwd_state_block_v = state_block_v if fp32 or key_dim > 128 else min(value_dim, 64)
        # The state kernels walk each sequence's chunks in one program per (sequence, head, value
        # tile); with few sequences and heads (B = 1 at long T) most SMs would idle, so the value
        # tile narrows (down to 16) while the programs still fit on the SMs at once; where even
        # that leaves SMs idle, the walks are cut into segments instead (see "Segmented walks").
        longest = max((-(-(end - start) // _C.value) for start, end in zip(bounds, bounds[1:])), default=0)
        programs = self.num_states * self.value_heads
        self.segment_chunks = _segment_chunks(programs, key_dim, value_dim, longest, q.device)
        if self.segment_chunks:
            walks, self.seq_segments = segment_layout(bounds, _C.value, self.segment_chunks, q.device)
            self.walk_cu, self.walk_chunks, self.num_walks = walks.cu, walks.seq_chunks, walks.num_seqs
            self.state_block_v = min(state_block_v, key_dim)  # transition columns come K at a time
            self.bwd_state_block_v = min(bwd_state_block_v, key_dim)
        else:
            self.walk_cu, self.walk_chunks, self.num_walks = self.cu, self.seq_chunks, self.num_states
            self.state_block_v = _parallel_block(state_block_v, value_dim, programs, q.device)
            self.bwd_state_block_v = _parallel_block(bwd_state_block_v, value_dim, programs, q.device)
        # The state kernels' loop is a chain of small dots, shorter than a load's latency: with 3
        # stages Triton's pipeliner loads the chunk after next while one is computed (with 2 it
        # waits for each chunk's tiles at the top of its step). At K = 256, and in fp32, 3 stages
        # do not fit in shared memory.
        self.state_stages = 2 if fp32 or key_dim > 128 else 3

    def empty(self, *shape, dtype=None):
        """A new tensor on the device, [tokens, Hv, *shape] (no shape: one value per token), in the
        dot dtype unless given."""
        return torch.empty(self.tokens, self.value_heads, *shape, device=self.chunks.device,
                           dtype=dtype or self.store_dtype)


def _sms(device) -> int:
    """The device's SMs (the interpreter: as a GPU of 128 SMs)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 128


def _parallel_block(block_v: int, value_dim: int, programs: int, device) -> int:
    """The widest value tile <= block_v (a power of two >= 16) at which ``programs`` x the value
    tiles still fit on the device's SMs, or block_v where even it does not."""
    while block_v > 16 and programs * (value_dim // (block_v // 2)) <= _sms(device):
        block_v //= 2
    return block_v


def _segment_chunks(programs: int, key_dim: int, value_dim: int, longest: int, device) -> int:
    """Chunks per segment of the state walks (see "Segmented walks"), or 0 to walk whole
    sequences: segment where ``programs`` (sequences x v heads) walks at the narrowest value tile
    (16) would fill at most half the SMs, the longest sequence (``longest`` chunks) has at least
    four segments of _SEGMENT_CHUNKS (two are slower than a whole walk), and K <= 128 (the combine
    holds a K x K transition). The segment is _SEGMENT_CHUNKS doubled while the longest sequence
    would keep 16 segments or more, so that it gets about 8 (4 to 16 of the shortest): the count
    that profiles fastest at B = 1, Hv = 16, K = V = 64 from T = 8192 to 32768."""
    if 2 * programs * (value_dim // 16) > _sms(device) or longest < 4 * _SEGMENT_CHUNKS or key_dim > 128:
        return 0
    chunks = _SEGMENT_CHUNKS
    while longest >= 16 * chunks:
        chunks *= 2
    return chunks


def _state_walks(cfg: _Config, walk, init, has_init: int, out, block_v: int, reverse: bool) -> None:
    """One state walk (forward, or with ``reverse`` the gradient's), whole or in segments (see
    "Segmented walks"). ``walk(columns, init, has_init, out, WALK)`` launches the state kernel over
    cfg's walks (its per-chunk outputs are stored in WALK 0 and 2, not 1); ``init`` [N, Hv, K, V] is the
    state it starts from (where ``has_init``), ``out`` [N, Hv, K, V] gets the state it ends with."""
    K, V, Hv = cfg.key_dim, cfg.value_dim, cfg.value_heads
    if not cfg.segment_chunks:
        walk(V, init, has_init, out, WALK=0)
        return
    device, dummy = cfg.chunks.device, cfg.chunks
    LM = torch.empty(cfg.num_walks, Hv, K, V + K, device=device, dtype=torch.float32)
    walk(V + K, dummy, 0, LM, WALK=1)
    entering = torch.empty(cfg.num_walks, Hv, K, V, device=device, dtype=torch.float32)
    combine_v = _parallel_block(block_v, V, cfg.num_states * Hv, device)
    _combine_segments_kernel[(cfg.num_states, Hv, V // combine_v)](
        LM, init, entering, out, cfg.seq_segments, Hv, has_init, K=K, V=V, BV=combine_v, REVERSE=reverse,
        num_warps=8)
    del LM
    walk(V, entering, 1, dummy, WALK=2)


def _flat(tensor):
    """[B, T, ...] -> contiguous [B * T, ...]; None stays None."""
    return None if tensor is None else tensor.reshape(-1, *tensor.shape[2:]).contiguous()


def _forward(cfg: _Config, q, k, v, beta, g, erase, write, initial_state):
    K, V, Hv, Hk, NC = cfg.key_dim, cfg.value_dim, cfg.value_heads, cfg.key_heads, cfg.num_chunks
    device, stages = q.device, _NUM_STAGES
    dummy = cfg.chunks  # stands for an absent tensor, which the kernel's flags keep it from reading
    beta_, erase_, write_ = (dummy if t is None else t for t in (beta, erase, write))
    square = (NC, Hv, _C.value, _C.value)
    G = dummy if cfg.g_mode == 0 else cfg.empty(*([K] if cfg.g_mode == 2 else []), dtype=torch.float32)
    P = torch.empty(square, device=device, dtype=cfg.store_dtype)
    T = torch.empty_like(P)
    W = cfg.empty(K)
    KD, QG = (cfg.empty(K), cfg.empty(K)) if cfg.g_mode == 2 else (dummy, dummy)
    h = torch.empty(NC, Hv, K, V, device=device, dtype=cfg.store_dtype)
    U = cfg.empty(V, dtype=torch.float32 if cfg.want_residual else None)
    final = torch.empty(cfg.num_states, Hv, K, V, device=device, dtype=torch.float32)
    o = cfg.empty(V, dtype=v.dtype)
    if NC > 0:
        if cfg.g_mode != 0:
            _chunk_cumsum_kernel[(NC, Hv)](g, G, cfg.chunks, Hv, K=K, BK=cfg.block_k,
                                           PER_CHANNEL=cfg.g_mode == 2, num_warps=4, num_stages=stages)
        A = torch.empty(square, device=device, dtype=torch.float32)
        _fwd_scores_kernel[(NC, Hv)](
            q, k, beta_, erase_, G, A, P, cfg.chunks, Hk, Hv, cfg.group,
            K=K, BK=cfg.score_block_k, G_MODE=cfg.g_mode, ERASE=cfg.erase,
            num_warps=8, num_stages=stages, **cfg.flags)
        _invert_kernel[(NC * Hv,)](A, T, IEEE=cfg.flags["IEEE"], num_warps=4, num_stages=stages)
        del A
        Y = cfg.empty(V)
        _fwd_prepare_kernel[(NC, Hv)](
            q, k, v, beta_, erase_, write_, G, T, W, Y, KD, QG, cfg.chunks, Hk, Hv, cfg.group,
            K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, G_MODE=cfg.g_mode, ERASE=cfg.erase,
            WRITE=cfg.write, num_warps=8, num_stages=stages, **cfg.flags)
    else:
        Y = dummy

    def walk(columns, h0, has_initial, final, WALK):  # WALK 1 stores no h or U
        _fwd_state_kernel[(cfg.num_walks, Hv, columns // cfg.state_block_v)](
            k, G, W, Y, KD, h, U, h0, final, cfg.walk_cu, cfg.walk_chunks, Hk, Hv, cfg.group, has_initial,
            K=K, V=V, BV=cfg.state_block_v, G_MODE=cfg.g_mode, WALK=WALK, num_warps=8,
            num_stages=cfg.state_stages, **cfg.flags)

    _state_walks(cfg, walk, dummy if initial_state is None else initial_state, int(initial_state is not None),
                 final, cfg.state_block_v, reverse=False)
    if NC > 0:
        _fwd_output_kernel[(NC, Hv, V // cfg.block_v)](
            q, G, QG, P, h, U, o, cfg.chunks, Hk, Hv, cfg.group, cfg.scale,
            K=K, V=V, BK=cfg.block_k, BV=cfg.block_v, G_MODE=cfg.g_mode,
            num_warps=4, num_stages=stages, **cfg.flags)
    return o, final, U, (G, T, P, W, KD, QG, h, U)


def _backward(cfg: _Config, saved, d_o, d_final, d_residual):
    q, k, v, beta, g, erase, write, initial_state, G, T, P, W, KD, QG, h, U = saved
    K, V, Hv, Hk, NC = cfg.key_dim, cfg.value_dim, cfg.value_heads, cfg.key_heads, cfg.num_chunks
    device, stages, tokens = q.device, _NUM_STAGES, cfg.tokens
    dummy = cfg.chunks
    beta_, erase_, write_ = (dummy if t is None else t for t in (beta, erase, write))
    if d_final is None:
        d_final = torch.zeros(cfg.num_states, Hv, K, V, device=device, dtype=torch.float32)
    d_final = d_final.float().contiguous()
    d_o = torch.zeros_like(v) if d_o is None else _flat(d_o)
    d_residual = None if d_residual is None else _flat(d_residual)

    dh = torch.empty(NC, Hv, K, V, device=device, dtype=cfg.store_dtype)
    dU = cfg.empty(V)  # every reader feeds it to tl.dot, which rounds it to the dot dtype
    dh0 = torch.empty(cfg.num_states, Hv, K, V, device=device, dtype=torch.float32)

    def walk(columns, d_final, _, dh0, WALK):  # starts from d_final, always given; WALK 1 stores no dh or dU
        _bwd_state_kernel[(cfg.num_walks, Hv, columns // cfg.bwd_state_block_v)](
            q, k, G, W, KD, QG, P, d_o, dummy if d_residual is None else d_residual, d_final, dh, dU, dh0,
            cfg.walk_cu, cfg.walk_chunks, Hk, Hv, cfg.group, cfg.scale, K=K, V=V, BV=cfg.bwd_state_block_v,
            G_MODE=cfg.g_mode, HAS_DR=d_residual is not None, WALK=WALK, num_warps=8,
            num_stages=cfg.state_stages, **cfg.flags)

    _state_walks(cfg, walk, d_final, 1, dh0, cfg.bwd_state_block_v, reverse=True)

    # With grouped heads (one decay per head or none; gated_delta_rule_triton gives a per-channel
    # decay one v head per q/k head) a _bwd_qkg program sums its group's shares of dq and dk, with
    # fp32 partial sums in dq_acc, dk_acc.
    group_loop = cfg.group > 1
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dq_acc, dk_acc = ((torch.empty(tokens, Hk, K, device=device, dtype=torch.float32) for _ in range(2))
                      if group_loop else (dummy, dummy))
    dv = torch.empty_like(v)
    dwrite = torch.empty_like(write) if cfg.write else None
    derase = torch.empty_like(erase) if cfg.erase else None
    dbeta_v = None if cfg.write else cfg.empty(dtype=torch.float32)
    # _bwd_qkg always takes a decay: without one, a zero per-head decay (see "Hopper" above), and
    # the gradient it then finds for it is dropped. With a per-channel decay it runs a program per
    # block of key channels, and beta's share comes in partial sums over them, one row each (summed
    # below); with one per head a program takes all K.
    qkg_mode = max(cfg.g_mode, 1)
    G_qkg = G if cfg.g_mode != 0 else torch.zeros(tokens, Hv, device=device, dtype=torch.float32)
    if cfg.g_mode == 2:
        qkg_grid = (NC, Hk, K // cfg.qkg_block_k)
        dbeta_k_shape = (qkg_grid[2], tokens, Hv)
        dg = torch.empty_like(g)
    else:
        qkg_grid = (NC, Hk)
        dbeta_k_shape = (tokens, Hv)
        dg = cfg.empty(dtype=torch.float32)
    dbeta_k = None if cfg.erase else torch.empty(dbeta_k_shape, device=device, dtype=torch.float32)
    if NC > 0:
        dP = torch.empty(NC, Hv, _C.value, _C.value, device=device, dtype=cfg.store_dtype)
        dA = torch.empty_like(dP)
        _bwd_scores_kernel[(NC, Hv)](
            v, beta_, write_, T, U, d_o, dU, dP, dA, dv, dummy if dwrite is None else dwrite,
            dummy if dbeta_v is None else dbeta_v, cfg.chunks, Hv, cfg.scale,
            V=V, BV=cfg.score_block_v, WRITE=cfg.write, num_warps=cfg.score_warps, num_stages=stages,
            **cfg.flags)
        _bwd_qkg_kernel[qkg_grid](
            q, k, beta_, erase_, G_qkg, T, h, dh, U, dU, d_o, dP, dA, dq, dk, dq_acc, dk_acc,
            dummy if derase is None else derase, dummy if dbeta_k is None else dbeta_k,
            dg, cfg.chunks, tokens, Hk, Hv, cfg.group, cfg.scale, GROUP_LOOP=group_loop,
            K=K, V=V, BK=cfg.qkg_block_k, BV=cfg.block_v, G_MODE=qkg_mode, ERASE=cfg.erase,
            num_warps=cfg.qkg_warps, num_stages=stages, **cfg.flags)
    else:  # no tokens at all
        for tensor in (dq, dk, dv, dwrite, derase, dbeta_v, dbeta_k, dg):
            if tensor is not None:
                tensor.zero_()

    d_beta = None
    if beta is not None:
        if dbeta_k is not None and cfg.g_mode == 2:
            dbeta_k = dbeta_k.sum(0)  # over the key blocks
        parts = [part for part in (dbeta_v, dbeta_k) if part is not None]
        d_beta = sum(parts).to(beta.dtype)
    if cfg.g_mode == 1:
        dg = dg.to(g.dtype)
    elif cfg.g_mode == 0:
        dg = None
    d_initial = None if initial_state is None else dh0.to(initial_state.dtype)
    return dq, dk, dv, d_beta, dg, derase, dwrite, d_initial


class _GatedDeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, beta, g, erase, write, initial_state, cfg):
        shapes = [None if t is None else t.shape for t in (q, k, v, beta, g, erase, write)]
        flat = [_flat(t) for t in (q, k, v, beta, g, erase, write)]
        initial = None if initial_state is None else initial_state.contiguous()
        o, final, U, saved = _forward(cfg, *flat, initial)
        ctx.cfg, ctx.shapes = cfg, shapes
        ctx.save_for_backward(*flat, initial, *saved)
        o = o.view(cfg.batch, cfg.seq_len, cfg.value_heads, cfg.value_dim)
        return o, final, U.view(o.shape) if cfg.want_residual else None

    @staticmethod
    def backward(ctx, d_o, d_final, d_residual):
        *grads, d_initial = _backward(ctx.cfg, ctx.saved_tensors, d_o, d_final, d_residual)
        grads = [None if grad is None else grad.view(shape) for grad, shape in zip(grads, ctx.shapes)]
        return (*grads, d_initial, None)


def gated_delta_rule_triton(
    q, k, v, *, beta=None, g=None, erase=None, write=None, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None, return_write_residual=False,
):
    """``gated_delta_rule`` in our Triton kernels: same arguments, shapes and results as
    ``gated_delta_rule_reference`` (q, k ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; beta
    ``[B, T, Hv]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``, <= 0; erase ``[B, T, Hv, K]``; write
    ``[B, T, Hv, V]``; initial_state ``[N, Hv, K, V]``), returning o ``[B, T, Hv, V]`` in v's
    dtype, the fp32 final state ``[N, Hv, K, V]`` (or None), and with ``return_write_residual``
    the write residual ``[B, T, Hv, V]`` in fp32, all with gradients.

    Raises kernels.registry.BackendUnavailable (a ValueError and a RuntimeError: "gated_delta_rule:
    backend 'triton' cannot run ...") for what the registry's rule of this backend refuses
    (kernels.backends.triton_unsupported): K or V outside kernels.backends.TRITON_HEAD_DIMS
    (tl.dot wants power-of-two tiles of at least 16), tensors off CUDA (unless Triton's
    interpreter is on, TRITON_INTERPRET=1), fp64 inputs, and on a GPU a per-channel decay below
    V = 128 in 16 bits (see "Hopper").
    """
    check_inputs(q, k, v, beta=beta, g=g, erase=erase, write=write, initial_state=initial_state,
                 cu_seqlens=cu_seqlens)
    registry.require(OP, "triton", q, k, v, beta=beta, g=g, erase=erase, write=write,
                     initial_state=initial_state, cu_seqlens=cu_seqlens)
    key_dim = q.shape[-1]
    scale = key_dim**-0.5 if scale is None else float(scale)
    group = v.shape[2] // q.shape[2]
    if g is not None and g.dim() == 4 and group > 1:  # one v head per q/k head (see "Hopper")
        q, k = (t.unsqueeze(3).expand(*t.shape[:3], group, key_dim).flatten(2, 3) for t in (q, k))
    cfg = _Config(q, k, v, g, erase, write, scale, cu_seqlens, return_write_residual)
    o, final, residual = _GatedDeltaRule.apply(q, k, v, beta, g, erase, write, initial_state, cfg)
    final = final if output_final_state else None
    if return_write_residual:
        return o, final, residual
    return o, final
