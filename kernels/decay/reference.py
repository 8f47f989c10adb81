"""Linear attention with a decaying state, token by token: the oracle every other backend is
tested against.

One recurrence covers causal linear attention, Mamba-2 SSD, RetNet, Lightning Attention and GLA.
Per head, with a state ``S`` of shape ``[K, V]``:

    S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

``g_t`` is a log-decay (``<= 0``). The special cases differ only in its form:

    linear attention     g = 0 (g=None)
    Mamba-2 SSD          g a scalar per head and token (A * dt), q = C, k = B, v = x * dt
    RetNet, Lightning    g a constant per head (g of shape [Hv])
    GLA                  g per key channel and token

This file also holds what the family's backends share: ``check_inputs``, the one place where the
argument contract is enforced, and ``expand_inputs``, which upcasts, maps q/k heads onto v heads
and gives g one form.
"""
from typing import NamedTuple

import torch

from ..common import check_shared_inputs, fail, per_token, sequence_start_states, stack_tokens, upcast_qkv

__all__ = ["decay_linear_attention_reference", "check_inputs", "expand_inputs", "input_form"]

OP = "decay_linear_attention"
FORM_OF_DIM = {1: "constant", 3: "per_head", 4: "per_channel"}


def input_form(g) -> str | None:
    """The call's decay form, as cases.DECAY_CASES names it ("none", "constant", "per_head",
    "per_channel"), or None for a g of another shape (which check_inputs refuses)."""
    return "none" if g is None else FORM_OF_DIM.get(g.dim())


def check_inputs(q, k, v, *, g, initial_state, cu_seqlens) -> None:
    """Raise ValueError, naming the argument, its shape and what was expected, if the arguments
    do not fit together. See ``decay_linear_attention`` for the contract."""
    check_shared_inputs(OP, q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens)
    batch, seq_len, _, key_dim = q.shape
    value_heads = v.shape[2]
    per_head = [batch, seq_len, value_heads]
    if g is not None and list(g.shape) not in ([value_heads], per_head, per_head + [key_dim]):
        fail(OP, "g", g, f"[Hv] = [{value_heads}] (a constant per head), [B, T, Hv] = {per_head} "
                         f"(one per head and token) or [B, T, Hv, K] = {per_head + [key_dim]} "
                         "(per key channel)")


class ExpandedInputs(NamedTuple):
    """The inputs in the compute dtype, every tensor with Hv heads: ``[B, T, Hv, *]``.

    A decay that is one scalar per head keeps a trailing axis of size 1, so that it broadcasts
    over the key channels without being materialised per channel."""

    q: torch.Tensor  # [B, T, Hv, K]
    k: torch.Tensor  # [B, T, Hv, K]
    v: torch.Tensor  # [B, T, Hv, V]
    log_decay: torch.Tensor  # [B, T, Hv, K or 1]: g, else zeros


def expand_inputs(q, k, v, *, g) -> ExpandedInputs:
    """Upcast (fp32, fp64 for fp64 inputs), give each v head its q/k head, and bring g to
    ``[B, T, Hv, K or 1]``; a constant per head ``[Hv]`` becomes a broadcast view, not a copy."""
    q, k, v = upcast_qkv(q, k, v)
    if g is None:
        log_decay = torch.zeros(*v.shape[:3], 1, dtype=v.dtype, device=v.device)
    elif g.dim() == 1:
        log_decay = g.to(v.dtype)[:, None].expand(*v.shape[:3], 1)
    else:
        log_decay = (g.unsqueeze(-1) if g.dim() == 3 else g).to(v.dtype)
    return ExpandedInputs(q=q, k=k, v=v, log_decay=log_decay)


def decay_linear_attention_reference(
    q, k, v, *, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """The recurrence above, one token at a time, in fp32 (fp64 if the inputs are fp64).

    Shapes: q, k ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``, each q/k head serving ``Hv // Hk``
    consecutive v heads; g ``[Hv]``, ``[B, T, Hv]`` or ``[B, T, Hv, K]``; initial_state
    ``[N, Hv, K, V]``. Returns o ``[B, T, Hv, V]`` in v's dtype and the final state
    ``[N, Hv, K, V]`` (or None).
    """
    check_inputs(q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    batch, seq_len, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    x = expand_inputs(q, k, v, g=g)
    decay = torch.exp(x.log_decay)  # [B, T, Hv, K or 1]

    tokens = per_token(x.q, x.k, x.v, decay)  # each [Hv, *]
    outputs, final_states = [], []
    for row, start, end, state in sequence_start_states(  # state: [Hv, K, V]
            initial_state, cu_seqlens, batch, seq_len, (value_heads, key_dim, value_dim),
            x.v.dtype, v.device):
        for q_t, k_t, v_t, decay_t in tokens[row * seq_len + start: row * seq_len + end]:
            # Diag(exp g_t) scales the key rows of S; then the outer product k_t v_t^T is added.
            state = decay_t.unsqueeze(-1) * state + torch.einsum("hk,hv->hkv", k_t, v_t)
            outputs.append(scale * torch.einsum("hk,hkv->hv", q_t, state))
        final_states.append(state)
    o = stack_tokens(outputs, batch, seq_len, (value_heads, value_dim), x.v.dtype, v.device)
    final_state = torch.stack(final_states) if output_final_state else None
    return o.to(v.dtype), final_state
