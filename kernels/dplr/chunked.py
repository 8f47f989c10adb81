"""The DPLR delta rule in chunkwise form: matmuls inside chunks, a K x K recurrence across them.

The split into a triangular solve inside chunks and a state pass across them is the WY / UT
form of the delta rule (Yang, Wang, Zhang, Shen and Kim, "Parallelizing Linear Transformers with
the Delta Rule over Sequence Length", NeurIPS 2024), here for a transition that is diagonal plus
rank one with independent read and write vectors, as RWKV-7 needs (Peng et al., "RWKV-7 'Goose'
with Expressive Dynamic State Evolution", 2025). Our own derivation, in plain PyTorch, so that
autograd gives the backward pass.

Derivation, per head, for one chunk of C tokens entered with state S_0 (tokens are rows). With
G_t = g_1 + ... + g_t the cumulative log-decay inside the chunk (per key channel, or one per
head broadcast over them) and G'_t = G_{t-1} (G'_1 = 0) the one before token t, write
u_t = a_t^T S_{t-1} (what a_t reads). The step S_t = (Diag(exp g_t) + b_t a_t^T) S_{t-1} + k_t v_t^T
is then a decaying linear recurrence with two writes, ``b_t u_t^T`` and ``k_t v_t^T``, so

    S_{t-1} = Diag(exp G'_t) S_0 + sum_{s<t} Diag(exp(G'_t - G_s)) (b_s u_s^T + k_s v_s^T).

With E_tsc = exp(G'_tc - G_sc) for s < t (0 elsewhere), A_ts = sum_c a_tc b_sc E_tsc and
B_ts = sum_c a_tc k_sc E_tsc, the reads solve a unit lower-triangular system:

    (I - A) U = B V + (exp(G') * a) S_0,    so    U = Y + W S_0,
    Y = (I - A)^-1 B V,   W = (I - A)^-1 (exp(G') * a),   both independent of the state.

For s < t, exp(G_t - G_s) = exp(g_t) E_ts; so with q'_t = exp(g_t) * q_t and the P's holding
the token's own write on their diagonal (P^b_tt = q_t . b_t, P^k_tt = q_t . k_t),
P^b_ts = sum_c q'_tc b_sc E_tsc and P^k_ts = sum_c q'_tc k_sc E_tsc for s < t:

    O   = scale * ((exp(G) * q) S_0 + P^b U + P^k V) = scale * (R S_0 + Z),
          R = exp(G) * q + P^b W,    Z = P^b Y + P^k V,
    S_C = Diag(exp G_C) S_0 + (exp(G_C - G) * b)^T U + (exp(G_C - G) * k)^T V = M S_0 + H,
          M = Diag(exp G_C) + (exp(G_C - G) * b)^T W  (K x K),   H = (exp(G_C - G) * b)^T Y + (exp(G_C - G) * k)^T V.

R, Z, M and H run for all chunks at once; only ``S <- M S + H`` runs chunk after chunk, and then
O for all chunks at once from the chunks' entering states. Numerics: the only exponents are
G'_t - G_s with s < t, g_t, G_t and G_C - G_s, all <= 0 when g <= 0, so nothing overflows however
strong the decay; E is formed only under the strict causal mask (the masked entries would be
exp of a large positive number). Everything inside is fp32 (fp64 for fp64 inputs).

The four decayed score matrices. A, B and the strictly lower parts of P^b and P^k are the only
place where the decay couples the key channels: each is, per chunk and head,

    S[t, s] = sum_c rows[t, c] * cols[s, c] * exp(Grow[t, c] - Gcol[s, c])   for s < t, else 0,

with (rows, Grow, cols, Gcol) = (a, G', b, G), (a, G', k, G), (q, G, b, G) and (q, G, k, G)
(exp(g_t) E_ts = exp(G_t - G_s)). :func:`chunkwise` is the whole algorithm above with these four
matrices left to a ``scores`` function (:data:`ScoresFunction`), which is all that differs between
the backends: :func:`pytorch_scores` (the "chunked" backend) forms E, ``[C, C, K]`` per chunk and
head for a decay per key channel (kept for the backward: ``T * C * K`` values per head, twice);
``triton.py`` (the "triton" backend) computes them in Triton kernels without E. For a decay per
head (or none) E is one ``[C, C]`` matrix and the scores are a plain matmul times it, in both.
"""
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..common import from_chunks, sequence_spans, to_chunks
from .reference import OP, check_inputs, expand_inputs

__all__ = ["ScoresFunction", "chunkwise", "dplr_delta_rule_chunked", "pytorch_scores"]

# (reads a, writes b, keys k, queries q, log-decay g, G, G') -> (A, B, P^b, P^k). Every input
# ``[..., C, D]`` (chunks of C tokens; D = K, or 1 for g, G and G' with a decay per head or none),
# every output ``[..., C, C]``, zero on and above the diagonal (P's diagonal is added by the
# caller).
ScoresFunction = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def _decayed_scores(rows: torch.Tensor, cols: list[torch.Tensor], decay: torch.Tensor) -> list[torch.Tensor]:
    """``scores[t, s] = sum_c rows[t, c] * col[s, c] * decay[t, s, c]`` for each col in cols.

    rows and each col ``[..., C, D]``; decay ``[..., C, C, D]`` or ``[..., C, C, 1]`` (one decay
    per head, which factors out of the sum and leaves a plain matmul). Returns ``[..., C, C]``
    per col."""
    if decay.shape[-1] == 1:
        return [(rows @ col.transpose(-1, -2)) * decay.squeeze(-1) for col in cols]
    weighted_rows = rows.unsqueeze(-2) * decay  # [..., C, C, D], shared by the cols
    return [torch.einsum("...tsc,...sc->...ts", weighted_rows, col) for col in cols]


def pytorch_scores(reads, writes, keys, queries, log_decay, cumulative_decay, decay_before):
    """A, B, P^b and P^k below the diagonal (:data:`ScoresFunction`) through the pairwise decays
    E_ts = exp(G'_t - G_s), ``[..., C, C, K or 1]``, shared by all four (P's rows are
    q' = exp(g) * q)."""
    chunk_size = reads.shape[-2]
    strictly_causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=reads.device).tril(-1)
    # masked before exp, where the exponent may be large and positive
    pairwise = (decay_before.unsqueeze(-2) - cumulative_decay.unsqueeze(-3)).masked_fill(
        ~strictly_causal.unsqueeze(-1), -math.inf).exp()
    read_on_writes, read_on_keys = _decayed_scores(reads, [writes, keys], pairwise)
    query_on_writes, query_on_keys = _decayed_scores(log_decay.exp() * queries, [writes, keys], pairwise)
    return read_on_writes, read_on_keys, query_on_writes, query_on_keys


def dplr_delta_rule_chunked(
    q, k, v, *, a, b, g=None, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, chunk_size: int = 32,
):
    """The DPLR delta rule by chunks of ``chunk_size`` tokens (any T; the last chunk is padded
    with tokens that change nothing: q = k = v = a = b = 0, g = 0).

    Same arguments, shapes and results as ``dplr_delta_rule_reference``: q, k ``[B, T, Hk, K]``;
    v ``[B, T, Hv, V]``; a, b ``[B, T, Hv, K]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``;
    initial_state ``[N, Hv, K, V]``. Returns o ``[B, T, Hv, V]`` in v's dtype and the final state
    ``[N, Hv, K, V]`` (or None). Varlen (``cu_seqlens``) sequences are laid out as rows of a
    zero-padded batch and run together.

    Memory: with g per key channel, the pairwise decays E and the rows weighted by them take
    ``T * chunk_size * K`` values per head each (kept for the backward); the default chunk of 32
    halves that against the delta rule's 64.
    """
    return chunkwise(q, k, v, a=a, b=b, g=g, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                     chunk_size=chunk_size, scores=pytorch_scores)


def chunkwise(q, k, v, *, a, b, g, scale, initial_state, output_final_state, cu_seqlens,
              chunk_size: int, scores: ScoresFunction):
    """The algorithm of the module docstring, with the decayed scores A, B, P^b and P^k below the
    diagonal from ``scores``; arguments and results as :func:`dplr_delta_rule_chunked`'s."""
    check_inputs(q, k, v, a=a, b=b, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"{OP}: chunk_size = {chunk_size}, expected a positive integer")
    batch, seq_len, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    x = expand_inputs(q, k, v, a=a, b=b, g=g)

    spans = sequence_spans(cu_seqlens, batch, seq_len)
    num_chunks = max(1, math.ceil(max(end - start for _, start, end in spans) / chunk_size))
    # Each [N, Hv, num_chunks, C, D]
    queries, keys, values, reads, writes, log_decay = (
        to_chunks(tensor, spans, num_chunks, chunk_size)
        for tensor in (x.q, x.k, x.v, x.a, x.b, x.log_decay)
    )

    cumulative_decay = log_decay.cumsum(dim=-2)  # G: [N, Hv, num_chunks, C, K or 1]
    # G': the cumulative decay before each token, G shifted (not G - g, which would round G's
    # magnitude into every exponent built from it)
    decay_before = F.pad(cumulative_decay[..., :-1, :], (0, 0, 1, 0))

    read_on_writes, read_on_keys, query_on_writes, query_on_keys = scores(
        reads, writes, keys, queries, log_decay, cumulative_decay, decay_before)  # A, B, P^b, P^k
    query_on_writes = query_on_writes + torch.diag_embed((queries * writes).sum(-1))  # P^b
    query_on_keys = query_on_keys + torch.diag_embed((queries * keys).sum(-1))  # P^k

    identity = torch.eye(chunk_size, dtype=read_on_writes.dtype, device=v.device)
    unit_lower = identity - read_on_writes  # I - A

    def solve(rhs):  # (I - A)^-1 rhs
        return torch.linalg.solve_triangular(unit_lower, rhs, upper=False, unitriangular=True)

    solved_values = solve(read_on_keys @ values)  # Y: [N, Hv, num_chunks, C, V]
    solved_reads = solve(decay_before.exp() * reads)  # W: [N, Hv, num_chunks, C, K]
    state_queries = cumulative_decay.exp() * queries + query_on_writes @ solved_reads  # R
    intra_outputs = query_on_writes @ solved_values + query_on_keys @ values  # Z
    to_end = (cumulative_decay[..., -1:, :] - cumulative_decay).exp()  # exp(G_C - G_t)
    writes_to_end = (to_end * writes).transpose(-1, -2)  # [N, Hv, num_chunks, K, C]
    chunk_decay = cumulative_decay[..., -1, :].exp()  # [N, Hv, num_chunks, K or 1]
    transitions = (torch.diag_embed(chunk_decay.expand(*chunk_decay.shape[:-1], key_dim))
                   + writes_to_end @ solved_reads)  # M: [N, Hv, num_chunks, K, K]
    offsets = writes_to_end @ solved_values + (to_end * keys).transpose(-1, -2) @ values  # H

    if initial_state is None:
        state = torch.zeros(len(spans), value_heads, key_dim, value_dim, dtype=x.v.dtype, device=v.device)
    else:
        state = initial_state.to(x.v.dtype)
    # Unbind once rather than index per chunk: the backward of each index would be a full-size
    # zero tensor, which makes the backward quadratic in the number of chunks.
    entry_states = []
    for transition, offset in zip(transitions.unbind(dim=2), offsets.unbind(dim=2)):
        entry_states.append(state)
        state = transition @ state + offset
    entry_states = torch.stack(entry_states, dim=2)  # S_0 of each chunk: [N, Hv, num_chunks, K, V]

    o = scale * (state_queries @ entry_states + intra_outputs)  # [N, Hv, num_chunks, C, V]
    o = from_chunks(o, spans, batch, seq_len)
    return o.to(v.dtype), (state if output_final_state else None)
