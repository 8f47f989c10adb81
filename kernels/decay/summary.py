"""The affine summary of a stretch of tokens under decayed linear attention (for context
parallelism): ``S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T`` gives, after T tokens entered with S_0,

    S_T = Diag(exp(g_1 + ... + g_T)) S_0 + H,   H = the state left when entered with S_0 = 0.

The transition is diagonal, so it is kept as a column ``[K or 1, 1]`` that broadcasts.
"""

import torch

from .. import registry
from .reference import OP

__all__ = ["decay_linear_attention_summary"]


def decay_linear_attention_summary(k, v, *, g=None, cu_seqlens=None, backend: str = "auto"):
    """(transition ``[N, Hv, K or 1, 1]``, state ``[N, Hv, K, V]``) of each of the N sequences
    (the batch rows, or the packed sequences of ``cu_seqlens``), fp32.

    Arguments as in :func:`~megatron_ext.kernels.decay_linear_attention` (k ``[B, T, Hk, K]``,
    v ``[B, T, Hv, V]``, g None, ``[Hv]``, ``[B, T, Hv]`` or ``[B, T, Hv, K]``, cu_seqlens). The
    state after the sequence's tokens, entered with S_0, is ``transition * S_0 + state``.
    """

    batch, seq_len, value_heads = v.shape[:3]
    _, state = registry.call(OP, backend, k, k, v, g=g, output_final_state=True,
                             cu_seqlens=cu_seqlens)
    if cu_seqlens is None:
        lengths = torch.full((batch,), seq_len, device=v.device)
    else:
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(v.device)
    if g is None:
        log_transition = state.new_zeros(len(lengths), value_heads, 1)
    elif g.dim() == 1:  # a constant per head
        log_transition = lengths.to(state.dtype).view(-1, 1, 1) * g.to(state.dtype).view(1, value_heads, 1)
    else:  # one per head and token ([.., Hv]), or per key channel ([.., Hv, K])
        per_token = g.to(state.dtype)
        if g.dim() == 3:
            per_token = per_token.unsqueeze(-1)
        if cu_seqlens is None:
            log_transition = per_token.sum(dim=1)
        else:  # the sum over each packed sequence
            sequence_of_token = torch.repeat_interleave(lengths)
            log_transition = per_token.new_zeros(len(lengths), *per_token.shape[2:]).index_add(
                0, sequence_of_token, per_token[0])
    return log_transition.exp().unsqueeze(-1), state
