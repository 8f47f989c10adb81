"""The affine summary of a stretch of tokens under the gated delta rule (for context parallelism).

Per head, each step ``S_t = (I - k_t a_t^T) Diag(exp g_t) S_{t-1} + k_t x_t^T`` (a_t = b_t * k_t,
x_t = w_t * v_t) is affine in the state, so a stretch of T tokens entered with state S_0 leaves

    S_T = M S_0 + H,    M = (I - k_T a_T^T) D_T ... (I - k_1 a_1^T) D_1  (K x K),
                        H = the state the stretch leaves when entered with S_0 = 0  (K x V).

Both come from ONE call of the op: the columns of the state evolve independently, each driven by
its own value column, so entering with ``[0 | I_K]`` while writing the values ``[v | 0]``
leaves ``[H | M I_K] = [H | M]``. Any backend of the op therefore gives the summary, with its
own backward; the cost is one run with V + K value channels. Where V + K is no head dim our
Triton kernels take but V and K are (e.g. K = 64, V = 128), the same columns run as two calls,
``[v]`` from 0 and ``[0]`` from ``I_K``, so that a GPU keeps its Triton kernels.
"""
import torch

from .. import backends, registry
from .reference import OP

__all__ = ["gated_delta_rule_summary"]


def gated_delta_rule_summary(k, v, *, beta=None, g=None, erase=None, write=None,
                             cu_seqlens=None, backend: str = "auto"):
    """(transition ``[N, Hv, K, K]``, state ``[N, Hv, K, V]``) of each of the N sequences (the
    batch rows, or the packed sequences of ``cu_seqlens``), fp32.

    Arguments as in :func:`~megatron_ext.kernels.gated_delta_rule` (k ``[B, T, Hk, K]``, v
    ``[B, T, Hv, V]``, beta, g, erase, write, cu_seqlens); q plays no part in the state.
    Then for any entering state S_0, the state after the sequence's tokens is
    ``transition @ S_0 + state``.
    """

    batch, seq_len, _, key_dim = k.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    sequences = batch if cu_seqlens is None else len(cu_seqlens) - 1
    dtype = torch.promote_types(torch.float32, v.dtype)

    def final_state(values, write, entering):
        return registry.call(OP, backend, k, k, values, beta=beta, g=g, erase=erase, write=write,
                             initial_state=entering, output_final_state=True,
                             cu_seqlens=cu_seqlens)[1]

    zeros = v.new_zeros(batch, seq_len, value_heads, key_dim)
    ones = None if write is None else write.new_ones(batch, seq_len, value_heads, key_dim)  # any gate
    zero_start = torch.zeros(sequences, value_heads, key_dim, value_dim, dtype=dtype, device=v.device)
    identity = torch.eye(key_dim, dtype=dtype, device=v.device).expand(sequences, value_heads,
                                                                      key_dim, key_dim)
    values = torch.cat([v, zeros], dim=-1)
    if backends.triton_dims_reason(k, values) and not backends.triton_dims_reason(k, v):
        return final_state(zeros, ones, identity), final_state(v, write, zero_start)
    write = None if write is None else torch.cat([write, ones], dim=-1)
    final = final_state(values, write, torch.cat([zero_start, identity], dim=-1))
    return final[..., value_dim:], final[..., :value_dim]
