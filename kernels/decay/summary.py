"""The affine summary of a stretch of tokens under decayed linear attention (for context
parallelism): ``S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T`` gives, after T tokens entered with S_0,

    S_T = Diag(exp(g_1 + ... + g_T)) S_0 + H,   H = the state left when entered with S_0 = 0.

The transition is diagonal, so it is kept as a column ``[K or 1, 1]`` that broadcasts.
"""

__all__ = ["decay_linear_attention_summary"]


def decay_linear_attention_summary(k, v, *, g=None, backend: str = "auto"):
    """(transition ``[B, Hv, K or 1, 1]``, state ``[B, Hv, K, V]``) of each batch row, fp32.

    Arguments as in :func:`~megatron_ext.kernels.decay_linear_attention` (k ``[B, T, Hk, K]``,
    v ``[B, T, Hv, V]``, g None, ``[Hv]``, ``[B, T, Hv]`` or ``[B, T, Hv, K]``). The state after
    the row's T tokens, entered with S_0, is ``transition * S_0 + state``.
    """
    from . import decay_linear_attention  # the package entry point picks the backend

    batch, seq_len, value_heads = v.shape[:3]
    _, state = decay_linear_attention(k, k, v, g=g, output_final_state=True, backend=backend)
    if g is None:
        log_transition = state.new_zeros(batch, value_heads, 1)
    elif g.dim() == 1:  # a constant per head
        log_transition = (seq_len * g.to(state.dtype)).view(1, value_heads, 1).expand(batch, -1, -1)
    elif g.dim() == 3:  # one per head and token
        log_transition = g.to(state.dtype).sum(dim=1).unsqueeze(-1)
    else:  # per key channel
        log_transition = g.to(state.dtype).sum(dim=1)
    return log_transition.exp().unsqueeze(-1), state
