"""Decaying linear attention in chunkwise form: masked attention inside chunks, the state across.

The split into an intra-chunk attention with relative decays and an inter-chunk state pass is
the chunkwise form of Sun et al., "Retentive Network: A Successor to Transformer for Large
Language Models" (2023, constant decay per head), of Qin et al., "Lightning Attention-2: A Free
Lunch for Handling Unlimited Sequence Lengths in Large Language Models" (2024, intra/inter
blocks), and of Dao and Gu, "Transformers are SSMs: Generalized Models and Efficient Algorithms
Through Structured State Space Duality" (ICML 2024, Mamba-2 SSD, a data-dependent scalar decay).
The per-channel decay with secondary chunks follows Yang, Wang, Shen, Panda and Kim, "Gated
Linear Attention Transformers with Hardware-Efficient Training" (ICML 2024, GLA). Plain PyTorch;
autograd gives the backward pass.

Derivation, per head, for one chunk of C tokens entered with state S_0 (tokens are rows). With
G_t = g_1 + ... + g_t the cumulative log-decay inside the chunk (per key channel, or one per head
broadcast over them), the recurrence S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T unrolls to
S_t = Diag(exp G_t) S_0 + sum_{s<=t} Diag(exp(G_t - G_s)) k_s v_s^T, so

    O   = scale * ((exp(G) * q) S_0 + P V),    P_ts = sum_c q_tc k_sc exp(G_tc - G_sc)  for s <= t
    S_C = Diag(exp G_C) S_0 + (exp(G_C - G) * k)^T V.

Only the state pass S_0 -> S_C runs chunk after chunk, and it is an elementwise multiply-add;
P, O and every chunk's contribution run for all chunks at once. Numerics: every exponent is a
sum of log-decays over a causal span (G_t - G_s with t >= s, G_t, G_C - G_s), so it is <= 0 when
g <= 0 and nothing overflows however strong the decay; the pairwise decays are formed only under
the causal mask (the masked entries would be exp of a large positive number). Everything inside
is fp32 (fp64 for fp64 inputs).
"""
import math

import torch

from ..common import from_chunks, sequence_spans, to_chunks
from .reference import OP, check_inputs, expand_inputs

__all__ = ["decay_linear_attention_chunked"]


def _masked_exp(log_values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``exp(log_values)`` where keep, 0 elsewhere. Masking before exp keeps the dropped entries,
    which may be large and positive, from overflowing, and keeps their gradient at 0."""
    return log_values.masked_fill(~keep, -math.inf).exp()


def _sub_chunk_size(chunk_size: int) -> int:
    """The largest divisor of chunk_size not above its square root (8 for 64, 4 for 16): it
    balances the two memory terms of ``_per_channel_scores``, ``C * c`` and ``C * C / c``."""
    return max(size for size in range(1, math.isqrt(chunk_size) + 1) if chunk_size % size == 0)


def _per_head_scores(queries, keys, cumulative_decay) -> torch.Tensor:
    """P for a decay that is one scalar per head: the decay factors out of the sum over channels.

    queries, keys ``[..., C, K]``; cumulative_decay ``[..., C, 1]``. Returns ``[..., C, C]``."""
    causal = torch.ones(keys.shape[-2], keys.shape[-2], dtype=torch.bool, device=keys.device).tril()
    pairwise_log_decay = cumulative_decay - cumulative_decay.transpose(-1, -2)  # G_t - G_s at [t, s]
    return (queries @ keys.transpose(-1, -2)) * _masked_exp(pairwise_log_decay, causal)


def _per_channel_scores(queries, keys, cumulative_decay) -> torch.Tensor:
    """P for a decay per key channel, with secondary chunks of c tokens (GLA, Yang et al. 2024).

    queries, keys, cumulative_decay ``[..., C, K]``. Returns ``[..., C, C]``.

    Forming exp(G_t - G_s) for every pair would take ``C * C * K`` values per chunk (and as many
    again saved for the backward). Instead, for a key s in sub-chunk j and a query t after it,
    factor through the last token e_j of sub-chunk j:

        exp(G_t - G_s) = exp(G_t - G_{e_j}) * exp(G_{e_j} - G_s),    s <= e_j < t,

    where both exponents are <= 0, so neither factor can overflow (and if one underflows, the
    exact product is at most that small). Each block of P is then a plain matmul of rescaled
    queries and keys, at ``C * (C / c) * K`` values per chunk for the queries rescaled to each e_j.
    Only the c x c blocks on the diagonal, where no sub-chunk boundary lies between query and key,
    keep the pairwise form: ``C * c * K`` values per chunk. With c = 8 at C = 64 that is 4x less
    than the pairwise form (measured on the whole op: 3x less saved for the backward, and a 2.7x
    faster CPU fwd+bwd), for the price of the rescaled queries' rows up to e_j, which are zeros.
    """
    chunk_size = keys.shape[-2]
    sub_size = _sub_chunk_size(chunk_size)
    num_subs = chunk_size // sub_size
    key_blocks, query_blocks, decay_blocks = (
        tensor.unflatten(-2, (num_subs, sub_size)) for tensor in (keys, queries, cumulative_decay)
    )  # [..., n, c, K]
    decay_at_block_end = decay_blocks[..., -1, :]  # G_{e_j}: [..., n, K]

    # Off the diagonal: column block j of P, for the query rows after sub-chunk j (the rest is 0).
    positions = torch.arange(chunk_size, device=keys.device)
    block_ends = torch.arange(num_subs, device=keys.device) * sub_size + sub_size - 1
    after_block = (positions > block_ends[:, None]).unsqueeze(-1)  # [n, C, 1]: t > e_j
    queries_from_block_end = queries.unsqueeze(-3) * _masked_exp(  # exp(G_t - G_{e_j}) q_t: [..., n, C, K]
        cumulative_decay.unsqueeze(-3) - decay_at_block_end.unsqueeze(-2), after_block
    )
    keys_to_block_end = (decay_at_block_end.unsqueeze(-2) - decay_blocks).exp() * key_blocks  # [..., n, c, K]
    off_diagonal = queries_from_block_end @ keys_to_block_end.transpose(-1, -2)  # [..., n_j, C, c]
    off_diagonal = off_diagonal.transpose(-3, -2).flatten(-2)  # [..., C, C]

    # On the diagonal: sub-chunk by sub-chunk, the masked pairwise decays.
    causal = torch.ones(sub_size, sub_size, dtype=torch.bool, device=keys.device).tril().unsqueeze(-1)
    pairwise_log_decay = decay_blocks.unsqueeze(-2) - decay_blocks.unsqueeze(-3)  # [..., n, c, c, K]
    pairwise_decay = _masked_exp(pairwise_log_decay, causal)
    diagonal = torch.einsum(  # [..., n, c, c]
        "...tk,...tsk,...sk->...ts", query_blocks, pairwise_decay, key_blocks
    )
    # diag_embed puts sub-chunk i's block at rows and columns of block i: [..., n, c, n, c].
    block_diagonal = torch.diag_embed(diagonal.movedim(-3, -1), dim1=-4, dim2=-2)
    return off_diagonal + block_diagonal.reshape(off_diagonal.shape)


def decay_linear_attention_chunked(
    q, k, v, *, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    chunk_size: int = 64,
):
    """Decaying linear attention by chunks of ``chunk_size`` tokens (any T; the last chunk is
    padded with tokens that change nothing: q = k = v = 0, g = 0).

    Same arguments, shapes and results as ``decay_linear_attention_reference``: q, k
    ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; g ``[Hv]``, ``[B, T, Hv]`` or ``[B, T, Hv, K]``;
    initial_state ``[N, Hv, K, V]``. Returns o ``[B, T, Hv, V]`` in v's dtype and the final state
    ``[N, Hv, K, V]`` (or None). Varlen (``cu_seqlens``) sequences are laid out as rows of a
    zero-padded batch and run together.

    Memory: with g per head, P takes ``T * chunk_size`` values per head. With g per key channel,
    about ``T * K * (c + chunk_size / c)`` with c the largest divisor of chunk_size up to its
    square root (see ``_per_channel_scores``); a chunk_size with no such divisor, e.g. a prime,
    degrades to the pairwise ``T * chunk_size * K``.
    """
    check_inputs(q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"{OP}: chunk_size = {chunk_size}, expected a positive integer")
    batch, seq_len, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    x = expand_inputs(q, k, v, g=g)

    spans = sequence_spans(cu_seqlens, batch, seq_len)
    num_chunks = max(1, math.ceil(max(end - start for _, start, end in spans) / chunk_size))
    # Each [N, Hv, num_chunks, C, D]
    queries, keys, values, log_decay = (
        to_chunks(tensor, spans, num_chunks, chunk_size) for tensor in (x.q, x.k, x.v, x.log_decay)
    )
    cumulative_decay = log_decay.cumsum(dim=-2)  # G: [N, Hv, num_chunks, C, K or 1]
    per_head = cumulative_decay.shape[-1] == 1
    scores = (_per_head_scores if per_head else _per_channel_scores)(queries, keys, cumulative_decay)

    decayed_queries = cumulative_decay.exp() * queries  # exp(G_t) q_t: read the entry state at t
    keys_decayed_to_end = (cumulative_decay[..., -1:, :] - cumulative_decay).exp() * keys
    chunk_writes = keys_decayed_to_end.transpose(-1, -2) @ values  # [N, Hv, num_chunks, K, V]
    chunk_decay = cumulative_decay[..., -1, :].exp().unsqueeze(-1)  # [N, Hv, num_chunks, K or 1, 1]

    if initial_state is None:
        state = torch.zeros(len(spans), value_heads, key_dim, value_dim, dtype=x.v.dtype, device=v.device)
    else:
        state = initial_state.to(x.v.dtype)
    # Unbind once rather than index per chunk: the backward of each index would be a full-size
    # zero tensor, which makes the backward quadratic in the number of chunks.
    entry_states = []
    for writes, decay in zip(chunk_writes.unbind(dim=2), chunk_decay.unbind(dim=2)):
        entry_states.append(state)
        state = decay * state + writes
    entry_states = torch.stack(entry_states, dim=2)  # S_0 of each chunk: [N, Hv, num_chunks, K, V]

    o = scale * (decayed_queries @ entry_states + scores @ values)  # [N, Hv, num_chunks, C, V]
    o = from_chunks(o, spans, batch, seq_len)
    return o.to(v.dtype), (state if output_final_state else None)
