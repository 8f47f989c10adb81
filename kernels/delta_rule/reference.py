"""The gated delta rule, token by token: the oracle every other backend is tested against.

One recurrence covers DeltaNet, Gated DeltaNet, KDA and Gated DeltaNet-2. Per head, with a state
``S`` of shape ``[K, V]``:

    S_t = (I - k_t (b_t * k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T
    o_t = scale * S_t^T q_t

``g_t`` is a log-decay (``<= 0``), ``b_t`` the erase gate over key channels and ``w_t`` the write
gate over value channels. The special cases:

    DeltaNet        g = 0,                      b = w = beta (a scalar per head and token)
    Gated DeltaNet  g a scalar per head,        b = w = beta
    KDA             g per key channel,          b = w = beta
    GDN-2           g per key channel,          b = erase [K],  w = write [V]

This file also holds what every backend shares: ``check_inputs``, the one place where the
argument contract is enforced (shapes, the varlen rules, which of beta/erase/write are needed),
and ``expand_inputs``, which upcasts, maps q/k heads onto v heads and resolves beta into gates.
"""
from typing import NamedTuple

import torch

from ..common import check_shared_inputs, fail, sequence_spans, per_token, sequence_start_states, stack_tokens

__all__ = ["gated_delta_rule_reference", "check_inputs", "expand_inputs", "input_form", "sequence_spans"]

OP = "gated_delta_rule"


def input_form(*, g, erase, write) -> str:
    """The call's input form, as cases.DELTA_RULE_CASES names it: "gdn2" (erase or write
    gates), "deltanet" (no decay), "gated_deltanet" (g per head) or "kda" (g per key channel)."""
    if erase is not None or write is not None:
        return "gdn2"
    if g is None:
        return "deltanet"
    return "gated_deltanet" if g.dim() == 3 else "kda"


def _fail(name: str, tensor: torch.Tensor, expected: str) -> None:
    fail("gated_delta_rule", name, tensor, expected)


def check_inputs(q, k, v, *, beta, g, erase, write, initial_state, cu_seqlens) -> None:
    """Raise ValueError, naming the argument, its shape and what was expected, if the arguments
    do not fit together. See ``gated_delta_rule`` for the contract."""
    check_shared_inputs("gated_delta_rule", q, k, v, initial_state=initial_state,
                        cu_seqlens=cu_seqlens)
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]

    per_head = [batch, seq_len, value_heads]
    if erase is None or write is None:
        if beta is None:
            raise ValueError(
                "gated_delta_rule: beta is required unless both erase and write are given "
                f"(expected beta of shape [B, T, Hv] = {per_head})"
            )
        if list(beta.shape) != per_head:
            _fail("beta", beta, f"[B, T, Hv] = {per_head}")
    elif beta is not None:
        raise ValueError(
            "gated_delta_rule: beta would be ignored because both erase and write are given; pass beta=None"
        )
    if g is not None and list(g.shape) not in (per_head, per_head + [key_dim]):
        _fail("g", g, f"[B, T, Hv] = {per_head} (one log-decay per head) "
                      f"or [B, T, Hv, K] = {per_head + [key_dim]} (per key channel)")
    if erase is not None and list(erase.shape) != per_head + [key_dim]:
        _fail("erase", erase, f"[B, T, Hv, K] = {per_head + [key_dim]}")
    if write is not None and list(write.shape) != per_head + [value_dim]:
        _fail("write", write, f"[B, T, Hv, V] = {per_head + [value_dim]}")


class ExpandedInputs(NamedTuple):
    """The inputs in the compute dtype, every tensor with Hv heads: ``[B, T, Hv, *]``.

    A gate or decay that is one scalar per head keeps a trailing axis of size 1, so that it
    broadcasts over the channels without being materialised per channel."""

    q: torch.Tensor  # [B, T, Hv, K]
    k: torch.Tensor  # [B, T, Hv, K]
    v: torch.Tensor  # [B, T, Hv, V]
    erase_gate: torch.Tensor  # [B, T, Hv, K or 1]: erase, else beta
    write_gate: torch.Tensor  # [B, T, Hv, V or 1]: write, else beta
    log_decay: torch.Tensor  # [B, T, Hv, K or 1]: g, else zeros


def expand_inputs(q, k, v, *, beta, g, erase, write) -> ExpandedInputs:
    """Upcast to fp32 (fp64 if an input is fp64, so that tests can compare backends to ~1e-12),
    give each v head its q/k head, and turn beta into the erase and write gates it stands for."""
    dtype = torch.float32
    for tensor in (q, k, v):
        dtype = torch.promote_types(dtype, tensor.dtype)
    heads_per_key = v.shape[2] // q.shape[2]
    if g is None:
        log_decay = torch.zeros(*v.shape[:3], 1, dtype=dtype, device=v.device)
    else:
        log_decay = (g.unsqueeze(-1) if g.dim() == 3 else g).to(dtype)
    return ExpandedInputs(
        q=q.to(dtype).repeat_interleave(heads_per_key, dim=2),
        k=k.to(dtype).repeat_interleave(heads_per_key, dim=2),
        v=v.to(dtype),
        erase_gate=(beta.unsqueeze(-1) if erase is None else erase).to(dtype),
        write_gate=(beta.unsqueeze(-1) if write is None else write).to(dtype),
        log_decay=log_decay,
    )


def gated_delta_rule_reference(
    q, k, v, *, beta=None, g=None, erase=None, write=None, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None, return_write_residual=False,
):
    """The recurrence above, one token at a time, in fp32 (fp64 if the inputs are fp64).

    Shapes: q, k ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``, each q/k head serving ``Hv // Hk``
    consecutive v heads; beta ``[B, T, Hv]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``; erase
    ``[B, T, Hv, K]``; write ``[B, T, Hv, V]``; initial_state ``[N, Hv, K, V]``.
    Returns o ``[B, T, Hv, V]`` in v's dtype and the final state ``[N, Hv, K, V]`` (or None);
    with ``return_write_residual`` also the write residual
    ``r_t = w_t * v_t - (Diag(exp g_t) S_{t-1})^T (b_t * k_t)`` ``[B, T, Hv, V]`` (fp32), the
    part of the value the memory did not already predict (S_t = Diag(exp g_t) S_{t-1} + k_t r_t^T).
    """
    check_inputs(q, k, v, beta=beta, g=g, erase=erase, write=write, initial_state=initial_state,
                 cu_seqlens=cu_seqlens)
    batch, seq_len, _, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    scale = key_dim**-0.5 if scale is None else scale
    x = expand_inputs(q, k, v, beta=beta, g=g, erase=erase, write=write)
    decay = torch.exp(x.log_decay)  # [B, T, Hv, K or 1]

    tokens = per_token(x.q, x.k, x.v, x.erase_gate, x.write_gate, decay)  # each [Hv, *]
    outputs, residuals, final_states = [], [], []
    for row, start, end, state in sequence_start_states(  # state: [Hv, K, V]
            initial_state, cu_seqlens, batch, seq_len, (value_heads, key_dim, value_dim),
            x.v.dtype, v.device):
        for q_t, k_t, v_t, erase_t, write_t, decay_t in tokens[row * seq_len + start: row * seq_len + end]:
            state = decay_t.unsqueeze(-1) * state  # Diag(exp g_t) S_{t-1}: scales the key rows
            erased = torch.einsum("hk,hkv->hv", erase_t * k_t, state)  # (b_t * k_t)^T S
            written = write_t * v_t  # w_t * v_t
            residual_t = written - erased
            residuals.append(residual_t)
            state = state + torch.einsum("hk,hv->hkv", k_t, residual_t)
            outputs.append(scale * torch.einsum("hk,hkv->hv", q_t, state))
        final_states.append(state)
    o = stack_tokens(outputs, batch, seq_len, (value_heads, value_dim), x.v.dtype, v.device)
    final_state = torch.stack(final_states) if output_final_state else None
    if return_write_residual:
        residual = stack_tokens(residuals, batch, seq_len, (value_heads, value_dim), x.v.dtype, v.device)
        return o.to(v.dtype), final_state, residual
    return o.to(v.dtype), final_state
