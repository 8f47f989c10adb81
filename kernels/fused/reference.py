"""The layer pieces around the token-mixer ops, in fp32 PyTorch: the definitions that the fused
Triton kernels (``triton.py``) are tested against, and the path on CPUs.

- :func:`short_conv`: ``y[b, t, c] = act(sum_j w[c, K-1-j] x[b, t-j, c])``, a causal depthwise
  convolution of width K (tap ``K-1`` multiplies the current token, torch Conv1d's orientation)
  followed by SiLU, and optionally an L2 normalisation of each group of ``l2_norm_dim`` channels
  (one head of q or k). Taps that would reach before the start of the token's sequence are
  dropped: ``positions[t]`` is the token's index within its sequence (packed sequences), or t.
- :func:`gated_rms_norm`: ``rmsnorm(o) * w * silu(gate)`` over each head's channels, or
  Mamba-2's ``rmsnorm(o * silu(gate)) * w`` (``gate_first``).
- :func:`gate`: a gate activation in fp32, ``sigmoid(x)`` (the delta rule's beta, erase and write
  gates), or the Mamba-2 / GDN log-decay ``-exp(A_log) * softplus(x + dt_bias)``.
- :func:`rms_norm`: ``x / rms(x) * w`` over the last dim (the layers' input norms).
- :func:`cross_entropy`: ``logsumexp(x) - x[target]`` per row of logits; over a vocabulary split
  across ranks (Megatron's vocab-parallel output layer) each rank reduces its columns to
  :func:`cross_entropy_stats` (max, sum of exponentials below it, the target's logit when the
  target is its own), the ranks combine those (``ops.merge_vocab_shards``), and the gradient
  of the rank's columns is :func:`cross_entropy_grad`, ``(softmax - onehot) * dloss``.
- :func:`rope`: rotary position embedding in Megatron's rotate-half form,
  ``y = t cos(f) + rotate_half(t) sin(f)`` with ``rotate_half([t1, t2]) = [-t2, t1]`` (halves of
  the head dim) and ``f`` the angles Megatron's rotary table gives each channel.

Shapes: ``x`` is ``[B, T, C]`` in any strides (a transposed view of Megatron's ``[s, b, C]`` is
read in place); ``o`` and ``gate`` are ``[B, T, H, D]``, ``w`` is ``[H, D]`` or ``[D]``; RoPE's
``t`` is Megatron's ``[s, b, H, D]`` and ``f`` its table ``[s, 1, 1, D]``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

L2_EPS = 1e-12  # as F.normalize


def sequence_positions(cu_seqlens: torch.Tensor | None, length: int, device) -> torch.Tensor | None:
    """Each token's index within its sequence for ``thd``-packed sequences (int32 ``[length]``),
    or None for ordinary batches (then the index is t)."""
    if cu_seqlens is None:
        return None
    t = torch.arange(length, device=device, dtype=torch.int32)
    sequence = torch.searchsorted(cu_seqlens[1:].to(torch.int32), t, right=True)
    return t - cu_seqlens[sequence].to(torch.int32)


def short_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None,
               l2_norm_dim: int | None = None) -> torch.Tensor:
    """``[B, T, C]`` -> ``[B, T, C]`` in ``x.dtype``: causal depthwise conv + SiLU (+ L2 norm)."""
    kernel, length = weight.shape[1], x.shape[1]
    xf, w = x.float(), weight.float()
    t = torch.arange(length, device=x.device)
    pos = t if positions is None else positions.to(x.device).long()
    acc = torch.zeros_like(xf)
    for shift in range(kernel):
        valid = (pos >= shift).view(1, -1, 1)
        shifted = F.pad(xf, (0, 0, shift, 0))[:, :length]
        acc = acc + torch.where(valid, shifted, 0.0) * w[:, kernel - 1 - shift]
    y = F.silu(acc)
    if l2_norm_dim is not None:
        y = F.normalize(y.unflatten(-1, (-1, l2_norm_dim)), dim=-1, eps=L2_EPS).flatten(-2)
    return y.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, eps: float,
                   gate_first: bool = False):
    """``rmsnorm(o) * weight * silu(gate)`` over the last dim, or with ``gate_first``
    ``rmsnorm(o * silu(gate)) * weight`` (Mamba-2's), in fp32, returned in ``o.dtype``."""
    x, gate = o.float(), F.silu(gate.float())
    if gate_first:
        x = x * gate
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (x if gate_first else x * gate).to(o.dtype)


def gate(x: torch.Tensor, A_log: torch.Tensor | None = None,
         dt_bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [B, T, N]`` -> fp32: ``sigmoid(x)``, or with ``A_log [N / C]`` and ``dt_bias [N]`` the
    log-decay ``-exp(A_log) * softplus(x + dt_bias)`` (C channels a head share an A)."""
    if A_log is None:
        return torch.sigmoid(x.float())
    a = -A_log.float().exp().repeat_interleave(x.shape[-1] // A_log.numel())
    return a * F.softplus(x.float() + dt_bias.float().flatten())


def rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """``t [s, b, H, D]``, ``freqs [s, 1, 1, D]`` (angles) -> ``[s, b, H, D]`` in ``t.dtype``:
    ``t cos(f) + rotate_half(t) sin(f)``, in fp32."""
    x, f = t.float(), freqs.float()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * torch.cos(f) + torch.cat((-x2, x1), dim=-1) * torch.sin(f)).to(t.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim, in fp32, returned in
    ``x.dtype``."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``logits [..., V]``, ``target [...]`` -> the loss ``[...]`` in fp32."""
    x = logits.float()
    return torch.logsumexp(x, -1) - x.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)


def cross_entropy_stats(rows: torch.Tensor, target: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """``rows [N, V]`` (columns ``vocab_start ..`` of the vocabulary), ``target [N]`` -> fp32
    ``[N, 3]``: each row's max m, ``sum exp(x - m)``, and its target's logit (0 where the
    target is not among the columns)."""
    x = rows.float()
    peak = x.max(-1).values
    total = torch.exp(x - peak[:, None]).sum(-1)
    local = target.long() - vocab_start
    inside = (local >= 0) & (local < x.shape[-1])
    picked = x.gather(-1, local.clamp(0, x.shape[-1] - 1)[:, None]).squeeze(-1)
    return torch.stack([peak, total, torch.where(inside, picked, 0.0)], dim=-1)


def cross_entropy_grad(rows: torch.Tensor, target: torch.Tensor, lse: torch.Tensor,
                       dloss: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """The gradient of the loss for ``rows`` (as in :func:`cross_entropy_stats`) given each
    row's log-sum-exp over the whole vocabulary ``lse [N]`` and the loss gradient ``dloss [N]``:
    ``(exp(x - lse) - onehot(target)) * dloss``, in ``rows.dtype``."""
    x = rows.float()
    local = target.long() - vocab_start
    onehot = torch.arange(x.shape[-1], device=x.device) == local[:, None]
    return ((torch.exp(x - lse[:, None]) - onehot.float()) * dloss[:, None]).to(rows.dtype)
