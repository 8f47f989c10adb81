"""The DPLR delta rule with its decayed scores in Triton kernels: the "triton" backend of
``dplr_delta_rule``.

The algorithm is chunked.py's (:func:`.chunked.chunkwise`, chunks of ``CHUNK`` = 64 tokens). What
runs in Triton is the one part that couples the key channels through a decay per key channel:
the four decayed score matrices of each chunk and head, A, B and the strictly lower parts of P^b
and P^k, forward and backward (:func:`decayed_scores`). Each is, for s < t (zero on and above the
diagonal),

    S[t, s] = sum_c rows[t, c] * cols[s, c] * exp(Grow[t, c] - Gcol[s, c]),

with (rows, Grow) = (a, G') against cols b and k, and (q, G) against b and k; G is the
cumulative log-decay inside the chunk (inclusive), G' the one before each token. The PyTorch
"chunked" backend forms the pairwise decays ``[C, C, K]`` per chunk and head for this and keeps
them for the backward; these kernels form none, and keep only the inputs. Everything else stays
in PyTorch, as in chunked.py: the cumulative sums, P's diagonal, the unit-triangular solves with
I - A, the chunk matmuls (R, Z, M, H), the state pass across chunks and the output; and the
decay's gradient from the kernels' d_rows and d_cols (below) through the cumulative sum, by
autograd. With a decay per head (or none) the scores factor into a plain matmul times a [C, C]
decay matrix, which PyTorch forms without the blow-up: this backend then runs chunked.py's
scores too (:func:`.chunked.pytorch_scores`) and differs from "chunked" only by its chunk size.

Kernels (M = N * Hv * num_chunks chunks of every head; J column tensors, here 2: b and k):
    _scores_kernel            [M, J]        S_j = the scores of the rows against cols j, fp32,
                                            ``[J, M, C, C]`` (zeros on and above the diagonal)
    _scores_backward_kernel   [M, K/BK]     with dS_j the gradients of the S_j:
                                            d_rows[t, c] = sum_j sum_s dS_j[t, s] cols_j[s, c] e_tsc,
                                            d_cols_j[s, c] = sum_t dS_j[t, s] rows[t, c] e_tsc,
                                            e_tsc = exp(Grow[t, c] - Gcol[s, c]), s < t
The decay's gradients are elementwise from these (the exponent's derivative):
dGrow = rows * d_rows and dGcol = -sum_j cols_j * d_cols_j, formed in PyTorch.

Numerics: Grow[t] <= Gcol[s] for every s < t when g <= 0 (G is a cumulative sum of log-decays
and G'_t = G_{t-1}), so the exponents of the scores are <= 0; but above the diagonal they are
positive and, with strong decays, large. So no exponent is formed across the diagonal: as in
decay/triton.py's GLA kernels, a chunk is cut into sub-chunks of ``SUB_CHUNK`` = 16 tokens, and
the pairs of an off-diagonal sub-chunk pair factor through a reference point R between them,

    exp(Grow_t - Gcol_s) = exp(Grow_t - R) * exp(R - Gcol_s),   Grow_t <= R <= Gcol_s,

both factors <= 1, and are one tl.dot: R = Grow at the first row of the row sub-chunk for S and
d_rows (the columns before it), R = Gcol at the last column of the column sub-chunk for d_cols
(the rows after it). The 16 x 16 blocks on the diagonal are summed elementwise under the strict
mask (exp of a masked exponent is never taken), one token at a time. So nothing overflows for
any g <= 0; a factor that underflows stands for a product that is smaller still. Inputs and
accumulation are fp32, tl.dot with input_precision "ieee" (no TF32). The chunks are those of
chunked.py's layout (:func:`..common.to_chunks`: each sequence one row, zero-padded to the
chunks of the longest, its padding tokens reading, writing and decaying nothing), so the kernels
need no sequence bounds; packed sequences of unequal lengths cost the padded chunks' work.

Supported: K a power of two from 16 to 256 (tl.dot's tiles; V is never in a kernel), q, k, v in
fp32, bf16 or fp16 (the chunked algorithm upcasts everything to fp32), CUDA tensors or CPU
tensors under TRITON_INTERPRET=1: the backend's rule in the registry (``dplr/__init__.py``).
Memory: what the backward keeps is of ``T * C``, ``T * K`` or ``T * K * K / C`` values per head
(scores, solves, inputs, the chunks' transitions), none of ``T * C * K`` as "chunked"'s.
"""
import contextlib

import torch
import triton
import triton.language as tl

from .. import registry
from ..backends import TRITON_HEAD_DIMS as KEY_DIMS
from ..decay.triton import LAUNCH, _exp_where
from .chunked import chunkwise, pytorch_scores
from .reference import OP, check_inputs

__all__ = ["CHUNK", "decayed_scores", "dplr_delta_rule_triton"]

CHUNK = 64  # tokens per chunk: fp32 errors against the fp64 reference within 1.5x of 32's (< 6e-7)
SUB_CHUNK = 16  # tokens per sub-chunk (BC in the kernels)
CHUNK_SIZES = (16, 32, 64, 128)  # whole sub-chunks, powers of two (tl.arange)
# The forward runs as decay/triton.py's kernels do (LAUNCH: 4 warps) with K blocks of up to 64;
# the backward holds three [C, BK] fp32 tiles and two [BC, BK] accumulators at once, and with
# BK = 64 at 4 warps ptxas (Triton 3.6, sm_90) spills ~880 bytes a thread; BK = 32 at 8 warps
# spills nothing. The choice is by spills, not by timing.
BACKWARD_KEY_BLOCK = 32
BACKWARD_LAUNCH = {"num_warps": 8, "num_stages": 2}


@triton.jit(do_not_specialize=["M"])
def _scores_kernel(rows, row_decay, cols, col_decay, scores, M,
                   K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """One (chunk m, column tensor j): S_j[t, s] for all t, s of the chunk into scores
    ``[J, M, C, C]``; rows, row_decay, col_decay ``[M, C, K]``, cols ``[J, M, C, K]``. Row
    sub-chunk by row sub-chunk: the columns before it through R = Grow at its first row, its own
    columns elementwise."""
    m, j = tl.program_id(0), tl.program_id(1)
    chunk = m.to(tl.int64) * C * K
    column = (j * M + m).to(tl.int64) * C * K
    tokens = tl.arange(0, C)
    sub = tl.arange(0, BC)
    for i in range(C // BC):
        r = i * BC
        t = r + sub  # the sub-chunk's rows
        result = tl.zeros([BC, C], dtype=tl.float32)
        for kb in range(K // BK):
            kk = kb * BK + tl.arange(0, BK)
            x = tl.load(rows + chunk + t[:, None] * K + kk[None, :])  # [BC, BK]
            x_decay = tl.load(row_decay + chunk + t[:, None] * K + kk[None, :])
            ref = tl.load(row_decay + chunk + r * K + kk)  # [BK]
            y_t = tl.load(cols + column + tokens[None, :] * K + kk[:, None])  # [BK, C], transposed by strides
            y_decay_t = tl.load(col_decay + chunk + tokens[None, :] * K + kk[:, None])
            x_ref = x * tl.exp(x_decay - ref[None, :])
            y_ref = y_t * _exp_where((tokens < r)[None, :], ref[:, None] - y_decay_t)
            result = tl.dot(x_ref, y_ref, result, input_precision="ieee")
            for u in range(BC):
                s = r + u
                y = tl.load(cols + column + s * K + kk)
                y_decay = tl.load(col_decay + chunk + s * K + kk)
                pair = _exp_where(t[:, None] > s, x_decay - y_decay[None, :])
                score = tl.sum(x * y[None, :] * pair, axis=1)  # [BC]: S[t, s]
                result += tl.where(tokens[None, :] == s, score[:, None], 0.0)
        tl.store(scores + (j * M + m).to(tl.int64) * C * C + t[:, None] * C + tokens[None, :], result)


@triton.jit(do_not_specialize=["M"])
def _scores_backward_kernel(rows, row_decay, cols, col_decay, grad_scores, grad_rows, grad_cols, M,
                            K: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                            J: tl.constexpr):
    """One (chunk m, K block): d_rows ``[M, C, K]`` and d_cols ``[J, M, C, K]`` from
    grad_scores ``[J, M, C, C]`` (read below the diagonal only). Sub-chunk b by sub-chunk: d_rows
    of its rows from the columns before it (through R = Grow at its first row), d_cols of its
    columns from the rows after it (through R = Gcol at its last column), and both from the
    pairs inside it elementwise."""
    m, kb = tl.program_id(0), tl.program_id(1)
    chunk = m.to(tl.int64) * C * K
    kk = kb * BK + tl.arange(0, BK)
    tokens = tl.arange(0, C)
    sub = tl.arange(0, BC)
    at_tokens = chunk + tokens[:, None] * K + kk[None, :]  # [C, BK]
    for i in range(C // BC):
        r = i * BC
        e = r + BC - 1
        t = r + sub  # the sub-chunk's tokens: rows for d_rows, columns for d_cols
        at_block = chunk + t[:, None] * K + kk[None, :]  # [BC, BK]
        x_decay = tl.load(row_decay + at_block)
        y_decay = tl.load(col_decay + at_block)
        ref_row = tl.load(row_decay + chunk + r * K + kk)  # [BK]
        ref_col = tl.load(col_decay + chunk + e * K + kk)
        # the rows after the sub-chunk, through ref_col
        x_after = tl.load(rows + at_tokens) * _exp_where(
            (tokens > e)[:, None], tl.load(row_decay + at_tokens) - ref_col[None, :])  # [C, BK]
        y_decay_all = tl.load(col_decay + at_tokens)
        before = tl.zeros([BC, BK], dtype=tl.float32)  # sum_j dS_j[t, s < r] y_s exp(R - Gcol_s)
        grad_x = tl.zeros([BC, BK], dtype=tl.float32)  # the pairs inside the sub-chunk
        for j in range(J):
            column = (j * M + m).to(tl.int64) * C * K
            grads = grad_scores + (j * M + m).to(tl.int64) * C * C
            y_before = tl.load(cols + column + tokens[:, None] * K + kk[None, :]) * _exp_where(
                (tokens < r)[:, None], ref_row[None, :] - y_decay_all)  # [C, BK]
            grad = tl.load(grads + t[:, None] * C + tokens[None, :], mask=(tokens < r)[None, :],
                           other=0.0)  # [BC, C]: dS[t, s]
            before = tl.dot(grad, y_before, before, input_precision="ieee")
            grad_t = tl.load(grads + tokens[None, :] * C + t[:, None], mask=(tokens > e)[None, :],
                             other=0.0)  # [BC, C]: dS[t', s] at [s, t'], transposed by strides
            grad_y = tl.exp(ref_col[None, :] - y_decay) * tl.dot(grad_t, x_after, input_precision="ieee")
            for u in range(BC):
                s = r + u
                # the sub-chunk's rows t > s against column s
                grad_column = tl.load(grads + t * C + s, mask=t > s, other=0.0)  # [BC]: dS[t, s]
                y = tl.load(cols + column + s * K + kk)
                y_decay_s = tl.load(col_decay + chunk + s * K + kk)
                grad_x += grad_column[:, None] * y[None, :] * _exp_where(
                    t[:, None] > s, x_decay - y_decay_s[None, :])
                # row s against the sub-chunk's columns s' < s
                grad_row = tl.load(grads + s * C + t, mask=t < s, other=0.0)  # [BC]: dS[s, s']
                x = tl.load(rows + chunk + s * K + kk)
                x_decay_s = tl.load(row_decay + chunk + s * K + kk)
                grad_y += grad_row[:, None] * x[None, :] * _exp_where(
                    t[:, None] < s, x_decay_s[None, :] - y_decay)
            tl.store(grad_cols + column + t[:, None] * K + kk[None, :], grad_y)
        tl.store(grad_rows + at_block, tl.exp(x_decay - ref_row[None, :]) * before + grad_x)


def _launch_device(tensor: torch.Tensor):
    """Triton launches on the current CUDA device: make it the tensor's."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


class _DecayedScores(torch.autograd.Function):
    """rows, row_decay, col_decay ``[..., C, K]`` and J cols ``[..., C, K]``, fp32 -> J scores
    ``[..., C, C]``; gradients for all of them (see the module docstring)."""

    @staticmethod
    def forward(ctx, rows, row_decay, col_decay, *cols):
        chunk_size, key_dim = rows.shape[-2:]
        flat = [tensor.reshape(-1, chunk_size, key_dim).contiguous() for tensor in (rows, row_decay, col_decay)]
        stacked = torch.stack([col.reshape(-1, chunk_size, key_dim) for col in cols])  # [J, M, C, K]
        num_chunks = flat[0].shape[0]
        scores = torch.empty(len(cols), num_chunks, chunk_size, chunk_size, dtype=torch.float32,
                             device=rows.device)
        if num_chunks:
            with _launch_device(rows):
                _scores_kernel[(num_chunks, len(cols))](
                    flat[0], flat[1], stacked, flat[2], scores, num_chunks, K=key_dim, C=chunk_size,
                    BC=SUB_CHUNK, BK=min(64, key_dim), **LAUNCH)
        ctx.save_for_backward(*flat, stacked)
        ctx.shape = rows.shape
        return tuple(score.view(*rows.shape[:-1], chunk_size) for score in scores.unbind(0))

    @staticmethod
    def backward(ctx, *grad_scores):
        rows, row_decay, col_decay, cols = ctx.saved_tensors
        num_cols, num_chunks, chunk_size, key_dim = cols.shape
        grads = torch.stack([grad.reshape(num_chunks, chunk_size, chunk_size) for grad in grad_scores]).float()
        grad_rows = torch.empty_like(rows)
        grad_cols = torch.empty_like(cols)
        if num_chunks:
            key_block = min(BACKWARD_KEY_BLOCK, key_dim)
            with _launch_device(rows):
                _scores_backward_kernel[(num_chunks, key_dim // key_block)](
                    rows, row_decay, cols, col_decay, grads, grad_rows, grad_cols, num_chunks, K=key_dim,
                    C=chunk_size, BC=SUB_CHUNK, BK=key_block, J=num_cols, **BACKWARD_LAUNCH)
        grad_row_decay = rows * grad_rows
        grad_col_decay = -(cols * grad_cols).sum(0)
        return (grad_rows.view(ctx.shape), grad_row_decay.view(ctx.shape), grad_col_decay.view(ctx.shape),
                *(grad.view(ctx.shape) for grad in grad_cols.unbind(0)))


def decayed_scores(rows: torch.Tensor, row_decay: torch.Tensor, col_decay: torch.Tensor,
                   cols: list[torch.Tensor]) -> list[torch.Tensor]:
    """``S[t, s] = sum_c rows[t, c] * col[s, c] * exp(row_decay[t, c] - col_decay[s, c])`` for
    s < t, zero elsewhere, for each col in cols, by the Triton kernels, with its backward.

    rows, row_decay, col_decay and each col ``[..., C, K]`` of one shape, fp32, C in CHUNK_SIZES
    and K in KEY_DIMS; returns ``[..., C, C]`` per col, fp32. The decays must satisfy
    ``row_decay[t] <= col_decay[s]`` for s < t (as G' or G against G do for g <= 0): then no
    exponent formed is positive beyond rounding, whatever their magnitude."""
    tensors = (rows, row_decay, col_decay, *cols)
    if any(tensor.shape != rows.shape or tensor.dtype != torch.float32 for tensor in tensors):
        raise ValueError(f"{OP}: decayed_scores takes fp32 tensors of one shape [..., C, K], not "
                         f"{[(tuple(tensor.shape), tensor.dtype) for tensor in tensors]}")
    chunk_size, key_dim = rows.shape[-2:]
    if chunk_size not in CHUNK_SIZES or key_dim not in KEY_DIMS:
        raise ValueError(f"{OP}: decayed_scores takes C in {CHUNK_SIZES} and K in {KEY_DIMS}, not "
                         f"C = {chunk_size}, K = {key_dim}")
    return list(_DecayedScores.apply(rows, row_decay, col_decay, *cols))


def _scores(reads, writes, keys, queries, log_decay, cumulative_decay, decay_before):
    """A, B, P^b and P^k below the diagonal (chunked.ScoresFunction): by the Triton kernels for a
    decay per key channel, through chunked.py's [C, C] decay matrix for one per head or none."""
    if cumulative_decay.shape[-1] == 1:
        return pytorch_scores(reads, writes, keys, queries, log_decay, cumulative_decay, decay_before)
    read_on_writes, read_on_keys = decayed_scores(reads, decay_before, cumulative_decay, [writes, keys])
    query_on_writes, query_on_keys = decayed_scores(queries, cumulative_decay, cumulative_decay, [writes, keys])
    return read_on_writes, read_on_keys, query_on_writes, query_on_keys


def dplr_delta_rule_triton(
    q, k, v, *, a, b, g=None, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, chunk_size: int = CHUNK,
):
    """The DPLR delta rule by chunks of ``chunk_size`` tokens (one of CHUNK_SIZES), its decayed
    scores in Triton kernels (see the module docstring).

    Same arguments, shapes and results as ``dplr_delta_rule_reference``: q, k ``[B, T, Hk, K]``;
    v ``[B, T, Hv, V]``; a, b ``[B, T, Hv, K]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``;
    initial_state ``[N, Hv, K, V]``. Returns o ``[B, T, Hv, V]`` in v's dtype and the final state
    ``[N, Hv, K, V]`` in fp32 (or None). K must be a power of two from 16 to 256.
    """
    check_inputs(q, k, v, a=a, b=b, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    registry.require(OP, "triton", q, k, v, a=a, b=b, g=g, initial_state=initial_state,
                     cu_seqlens=cu_seqlens)
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"{OP}: chunk_size = {chunk_size}; the triton backend takes {CHUNK_SIZES}")
    return chunkwise(q, k, v, a=a, b=b, g=g, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     chunk_size=chunk_size, scores=_scores)
