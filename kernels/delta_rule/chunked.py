"""The gated delta rule in chunkwise form: matmuls inside chunks, a short recurrence across them.

The WY / UT-transform form of the delta rule follows Yang, Wang, Zhang, Shen and Kim,
"Parallelizing Linear Transformers with the Delta Rule over Sequence Length" (NeurIPS 2024);
the scalar decay follows Yang, Kautz and Hatamizadeh, "Gated Delta Networks: Improving Mamba2
with Delta Rule" (ICLR 2025); the per-channel decay follows Kimi Team, "Kimi Linear: An
Expressive, Efficient Hybrid Linear Attention Architecture" (2025, Kimi Delta Attention). This
is our own derivation for the general case with erase and write gates, in plain PyTorch, so that
autograd gives the backward pass.

Derivation, per head, for one chunk of C tokens entered with state S_0 (tokens are rows). Write
a_t = b_t * k_t (the erase key), x_t = w_t * v_t (the written value) and G_t = g_1 + ... + g_t
(the cumulative log-decay inside the chunk, per key channel, or one per head broadcast over them).
The recurrence S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + k_t x_t^T is

    S_t = Diag(exp g_t) S_{t-1} + k_t u_t^T,    u_t = x_t - (Diag(exp g_t) S_{t-1})^T a_t,

and unrolling Diag(exp g_t) S_{t-1} = Diag(exp G_t) S_0 + sum_{s<t} Diag(exp(G_t - G_s)) k_s u_s^T
inside the chunk gives a lower-triangular system for the rows u_t:

    (I + A) U = X - (exp(G) * a) S_0,     A_ts = sum_c a_tc k_sc exp(G_tc - G_sc)  for s < t, else 0.

With Y = (I + A)^-1 X and W = (I + A)^-1 (exp(G) * a), both independent of the state, U = Y - W S_0.
Then, with P_ts = sum_c q_tc k_sc exp(G_tc - G_sc) for s <= t,

    O   = scale * ((exp(G) * q) S_0 + P U)
    S_C = Diag(exp G_C) S_0 + (exp(G_C - G) * k)^T U.

Only U, O and S_C need the entering state, so they run chunk after chunk; everything else runs
for all chunks at once. Numerics: the only exponents are G_t - G_s with t >= s, G_t and G_C - G_s,
all <= 0 when g <= 0, so nothing overflows however strong the decay; the pairwise decays are
formed only under the causal mask (the masked entries would be exp of a large positive number).
Everything inside is fp32 (fp64 for fp64 inputs).
"""
import math

import torch

from ..common import from_chunks, sequence_spans, to_chunks
from .reference import check_inputs, expand_inputs

__all__ = ["gated_delta_rule_chunked"]


def _decayed_scores(rows: torch.Tensor, cols: torch.Tensor, relative_decay: torch.Tensor) -> torch.Tensor:
    """``scores[t, s] = sum_c rows[t, c] * cols[s, c] * relative_decay[t, s, c]``.

    rows, cols ``[..., C, D]``; relative_decay ``[..., C, C, D]`` or ``[..., C, C, 1]`` (one decay
    per head, which factors out of the sum and leaves a plain matmul). Returns ``[..., C, C]``.
    """
    if relative_decay.shape[-1] == 1:
        return (rows @ cols.transpose(-1, -2)) * relative_decay.squeeze(-1)
    return torch.einsum("...tsc,...sc->...ts", rows.unsqueeze(-2) * relative_decay, cols)


def gated_delta_rule_chunked(
    q, k, v, *, beta=None, g=None, erase=None, write=None, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None, return_write_residual=False,
    chunk_size: int = 64,
):
    """The gated delta rule by chunks of ``chunk_size`` tokens (any T; the last chunk is padded).

    Same arguments, shapes and results as ``gated_delta_rule_reference``: q, k ``[B, T, Hk, K]``;
    v ``[B, T, Hv, V]``; beta ``[B, T, Hv]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``; erase
    ``[B, T, Hv, K]``; write ``[B, T, Hv, V]``; initial_state ``[N, Hv, K, V]``. Returns o
    ``[B, T, Hv, V]`` in v's dtype and the final state ``[N, Hv, K, V]`` (or None), and with
    ``return_write_residual`` the write residual (the rows of U) ``[B, T, Hv, V]``.

    Varlen (``cu_seqlens``) sequences are laid out as rows of a zero-padded batch and run
    together. Memory: with per-channel g, the pairwise decays take ``T * chunk_size * K`` values
    per head; a smaller chunk_size (16 or 32) keeps long per-channel runs small on CPU.
    """
    check_inputs(q, k, v, beta=beta, g=g, erase=erase, write=write, initial_state=initial_state,
                 cu_seqlens=cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"gated_delta_rule: chunk_size = {chunk_size}, expected a positive integer")
    batch, seq_len, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    x = expand_inputs(q, k, v, beta=beta, g=g, erase=erase, write=write)

    spans = sequence_spans(cu_seqlens, batch, seq_len)
    num_chunks = max(1, math.ceil(max(end - start for _, start, end in spans) / chunk_size))
    # Each [N, Hv, num_chunks, C, D]
    queries, keys, erase_keys, written, log_decay = (
        to_chunks(tensor, spans, num_chunks, chunk_size)
        for tensor in (x.q, x.k, x.erase_gate * x.k, x.write_gate * x.v, x.log_decay)
    )

    cumulative_decay = log_decay.cumsum(dim=-2)  # G: [N, Hv, num_chunks, C, K or 1]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=v.device).tril()
    # G_t - G_s at [t, s]: [N, Hv, num_chunks, C, C, K or 1]
    pairwise_log_decay = cumulative_decay.unsqueeze(-2) - cumulative_decay.unsqueeze(-3)
    # Mask before exp: above the diagonal G_t - G_s >= 0 and can be large enough to overflow.
    relative_decay = pairwise_log_decay.masked_fill(~causal.unsqueeze(-1), -math.inf).exp()

    erase_scores = torch.tril(_decayed_scores(erase_keys, keys, relative_decay), diagonal=-1)  # A
    output_scores = _decayed_scores(queries, keys, relative_decay)  # P (the mask keeps s <= t)
    identity = torch.eye(chunk_size, dtype=erase_scores.dtype, device=v.device)
    unit_lower = identity + erase_scores  # I + A
    solved_writes = torch.linalg.solve_triangular(unit_lower, written, upper=False, unitriangular=True)  # Y
    decay_from_start = cumulative_decay.exp()  # exp(G_t): from the chunk's entry state to token t
    solved_erase_keys = torch.linalg.solve_triangular(  # W
        unit_lower, decay_from_start * erase_keys, upper=False, unitriangular=True
    )
    decayed_queries = decay_from_start * queries
    keys_decayed_to_end = (cumulative_decay[..., -1:, :] - cumulative_decay).exp() * keys
    chunk_decay = cumulative_decay[..., -1, :].exp().unsqueeze(-1)  # [N, Hv, num_chunks, K or 1, 1]

    if initial_state is None:
        state = torch.zeros(len(spans), value_heads, key_dim, value_dim, dtype=x.v.dtype, device=v.device)
    else:
        state = initial_state.to(x.v.dtype)
    # Unbind once rather than index per chunk: the backward of each index would be a full-size
    # zero tensor, which makes the backward quadratic in the number of chunks.
    per_chunk = zip(*(tensor.unbind(dim=2) for tensor in (
        solved_writes, solved_erase_keys, decayed_queries, output_scores, keys_decayed_to_end, chunk_decay,
    )))
    chunk_outputs, chunk_corrections = [], []
    for writes_solved, erase_keys_solved, queries_decayed, scores, keys_to_end, chunk_decay_n in per_chunk:
        corrections = writes_solved - erase_keys_solved @ state  # U: [N, Hv, C, V]
        chunk_outputs.append(queries_decayed @ state + scores @ corrections)
        chunk_corrections.append(corrections)
        state = chunk_decay_n * state + keys_to_end.transpose(-1, -2) @ corrections

    def unchunk(per_chunk_rows):  # [N, Hv, C, V] per chunk -> [B, T, Hv, V]
        return from_chunks(torch.stack(per_chunk_rows, dim=2), spans, batch, seq_len)

    o = (scale * unchunk(chunk_outputs)).to(v.dtype)
    final_state = state if output_final_state else None
    if return_write_residual:
        return o, final_state, unchunk(chunk_corrections)
    return o, final_state
