"""The affine summary of a stretch of tokens under the DPLR delta rule (for context parallelism).

Per head, each step ``S_t = (Diag(exp g_t) + b_t a_t^T) S_{t-1} + k_t v_t^T`` is affine in the
state, so a stretch of T tokens entered with state S_0 leaves

    S_T = M S_0 + H,    M = (D_T + b_T a_T^T) ... (D_1 + b_1 a_1^T)  (K x K),
                        H = the state the stretch leaves when entered with S_0 = 0  (K x V).

Both come from ONE call of the op: the columns of the state evolve independently, each driven by
its own value column, so entering with ``[0 | I_K]`` while writing the values ``[v | 0]`` leaves
``[H | M]``. Any backend of the op gives the summary, with its own backward.
"""
import torch

from .. import registry
from .reference import OP

__all__ = ["dplr_delta_rule_summary"]


def dplr_delta_rule_summary(k, v, *, a, b, g=None, cu_seqlens=None, backend: str = "auto"):
    """(transition ``[N, Hv, K, K]``, state ``[N, Hv, K, V]``) of each of the N sequences (the
    batch rows, or the packed sequences of ``cu_seqlens``), fp32 (fp64 for fp64 inputs).

    Arguments as in :func:`~megatron_ext.kernels.dplr_delta_rule` (k ``[B, T, Hk, K]``, v
    ``[B, T, Hv, V]``, a, b, g, cu_seqlens); q plays no part in the state. Then for any entering
    state S_0, the state after the sequence's tokens is ``transition @ S_0 + state``.
    """

    batch, seq_len, _, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    sequences = batch if cu_seqlens is None else len(cu_seqlens) - 1
    dtype = torch.promote_types(torch.float32, v.dtype)
    zero_start = torch.zeros(sequences, value_heads, key_dim, value_dim, dtype=dtype, device=v.device)
    identity = torch.eye(key_dim, dtype=dtype, device=v.device).expand(sequences, value_heads,
                                                                      key_dim, key_dim)
    values = torch.cat([v, v.new_zeros(batch, seq_len, value_heads, key_dim)], dim=-1)
    _, final = registry.call(OP, backend, k, k, values, a=a, b=b, g=g,
                             initial_state=torch.cat([zero_start, identity], dim=-1),
                             output_final_state=True, cu_seqlens=cu_seqlens)
    return final[..., value_dim:], final[..., :value_dim]
