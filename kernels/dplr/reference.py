"""The DPLR delta rule, token by token: the oracle every other backend is tested against.

Per head, with a state ``S`` of shape ``[K, V]`` (key channels index the rows, as in every op of
``megatron_ext.kernels``), the transition is diagonal plus low rank (DPLR):

    S_t = (Diag(exp g_t) + b_t a_t^T) S_{t-1} + k_t v_t^T
    o_t = scale * S_t^T q_t

``a_t`` reads the state (``a_t^T S_{t-1}``, one value row) and ``b_t`` writes what it read back
along its own direction; both act on the state before this token's decay, so the step is one
affine map of S_{t-1}. ``g_t`` is a log-decay (``<= 0``) per key channel or per head.

RWKV-7 (Peng et al., "RWKV-7 'Goose' with Expressive Dynamic State Evolution", 2025) writes its
state transposed, ``[V, K]`` with values on the rows: ``wkv_t = wkv_{t-1} (Diag(w_t) + a_t b_t^T)
+ v_t k_t^T`` and ``y_t = wkv_t r_t``. Its ``wkv_t`` is our ``S_t^T``, with the same a, b, k, v,
``g = log w`` and ``q = r``, ``scale = 1``; RWKV-7 takes ``a = -kappa_hat`` (the normalised removal
key) and ``b = kappa_hat * alpha`` (times the in-context learning rate).

The gated delta rule ``S_t = (I - k_t (e_t * k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T``
is the special case ``a = -(e_t * k_t * exp(g_t))``, ``b = k_t``, ``v -> w_t * v_t``.

This file also holds what every backend shares: ``check_inputs``, the one place where the
argument contract is enforced, and ``expand_inputs``, which upcasts, maps q/k heads onto v heads
and gives g one form.
"""
from typing import NamedTuple

import torch

from ..common import check_shared_inputs, fail, per_token, sequence_start_states, stack_tokens
from ..decay.reference import expand_inputs as expand_decay_inputs

__all__ = ["dplr_delta_rule_reference", "check_inputs", "expand_inputs", "input_form"]

OP = "dplr_delta_rule"
FORM_OF_DIM = {3: "per_head", 4: "rwkv7"}


def input_form(g) -> str | None:
    """The call's decay form, as cases.DPLR_CASES names it: "none", "per_head" (g ``[B, T, Hv]``)
    or "rwkv7" (g ``[B, T, Hv, K]``, per key channel as RWKV-7's); None for a g of another shape
    (which check_inputs refuses)."""
    return "none" if g is None else FORM_OF_DIM.get(g.dim())


def check_inputs(q, k, v, *, a, b, g, initial_state, cu_seqlens) -> None:
    """Raise ValueError, naming the argument, its shape and what was expected, if the arguments
    do not fit together. See ``dplr_delta_rule`` for the contract."""
    check_shared_inputs(OP, q, k, v, initial_state=initial_state, cu_seqlens=cu_seqlens)
    batch, seq_len, _, key_dim = q.shape
    per_head = [batch, seq_len, v.shape[2]]
    for name, tensor in (("a", a), ("b", b)):
        if tensor is None:
            raise ValueError(f"{OP}: {name} is required (expected [B, T, Hv, K] = "
                             f"{per_head + [key_dim]})")
        if list(tensor.shape) != per_head + [key_dim]:
            fail(OP, name, tensor, f"[B, T, Hv, K] = {per_head + [key_dim]}")
    if g is not None and list(g.shape) not in (per_head, per_head + [key_dim]):
        fail(OP, "g", g, f"[B, T, Hv] = {per_head} (one log-decay per head) "
                         f"or [B, T, Hv, K] = {per_head + [key_dim]} (per key channel)")


class ExpandedInputs(NamedTuple):
    """The inputs in the compute dtype, every tensor with Hv heads: ``[B, T, Hv, *]`` (the decay
    family's, :func:`..decay.reference.expand_inputs`, plus a and b)."""

    q: torch.Tensor  # [B, T, Hv, K]
    k: torch.Tensor  # [B, T, Hv, K]
    v: torch.Tensor  # [B, T, Hv, V]
    a: torch.Tensor  # [B, T, Hv, K]
    b: torch.Tensor  # [B, T, Hv, K]
    log_decay: torch.Tensor  # [B, T, Hv, K or 1]: g, else zeros


def expand_inputs(q, k, v, *, a, b, g) -> ExpandedInputs:
    """Upcast (fp32, fp64 for fp64 inputs), give each v head its q/k head, and bring g to
    ``[B, T, Hv, K or 1]``, as the decay family does; a and b in the same dtype."""
    x = expand_decay_inputs(q, k, v, g=g)
    return ExpandedInputs(q=x.q, k=x.k, v=x.v, a=a.to(x.v.dtype), b=b.to(x.v.dtype),
                          log_decay=x.log_decay)


def dplr_delta_rule_reference(
    q, k, v, *, a, b, g=None, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None,
):
    """The recurrence above, one token at a time, in fp32 (fp64 if the inputs are fp64).

    Shapes: q, k ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``, each q/k head serving ``Hv // Hk``
    consecutive v heads; a, b ``[B, T, Hv, K]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``;
    initial_state ``[N, Hv, K, V]``. Returns o ``[B, T, Hv, V]`` in v's dtype and the final state
    ``[N, Hv, K, V]`` (or None).
    """
    check_inputs(q, k, v, a=a, b=b, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    batch, seq_len, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    x = expand_inputs(q, k, v, a=a, b=b, g=g)
    decay = torch.exp(x.log_decay)  # [B, T, Hv, K or 1]

    tokens = per_token(x.q, x.k, x.v, x.a, x.b, decay)  # each [Hv, *]
    outputs, final_states = [], []
    for row, start, end, state in sequence_start_states(  # state: [Hv, K, V]
            initial_state, cu_seqlens, batch, seq_len, (value_heads, key_dim, value_dim),
            x.v.dtype, v.device):
        for q_t, k_t, v_t, a_t, b_t, decay_t in tokens[row * seq_len + start: row * seq_len + end]:
            read = torch.einsum("hk,hkv->hv", a_t, state)  # a_t^T S_{t-1}
            state = (decay_t.unsqueeze(-1) * state
                     + torch.einsum("hk,hv->hkv", b_t, read)
                     + torch.einsum("hk,hv->hkv", k_t, v_t))
            outputs.append(scale * torch.einsum("hk,hkv->hv", q_t, state))
        final_states.append(state)
    o = stack_tokens(outputs, batch, seq_len, (value_heads, value_dim), x.v.dtype, v.device)
    final_state = torch.stack(final_states) if output_final_state else None
    return o.to(v.dtype), final_state
