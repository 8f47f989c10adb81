"""The residual-stream ops of mHC and Attention Residuals, as plain autograd PyTorch in fp32.

These are the definitions every faster path is tested against; they keep every intermediate
for backward and are written to be read next to the papers:

- mHC (Xie et al. 2025, "mHC: Manifold-Constrained Hyper-Connections", DeepSeek-AI, arXiv
  2512.24880, itself built on Hyper-Connections, Zhu et al. 2024, arXiv 2409.19606), in the
  orientation of DeepSeek-V4's ``hc_pre`` / ``hc_post``: with n streams ``X [..., n, h]``,

      mixes = RMSNorm(flatten(X)) @ phi^T                          [..., (2 + n) n]
      H_pre  = sigmoid(alpha_0 mixes[:n]   + b[:n]) + eps          [..., n]
      H_post = 2 sigmoid(alpha_1 mixes[n:2n] + b[n:2n])            [..., n]
      H_res  = Sinkhorn(alpha_2 mixes[2n:] + b[2n:])               [..., n, n]
      u      = sum_m H_pre[m] X[m]                  (the sublayer input, before its own norm)
      X'[j]  = H_post[j] F(u) + sum_m H_res[m, j] X[m]

- Attention Residuals (Kimi Team 2026, "Attention Residuals", arXiv 2603.15031): a sublayer's
  input is a softmax over depth, ``h = sum_i softmax_i(q . RMSNorm(v_i)) v_i``, with a learned
  pseudo-query ``q`` (the key norm's weight folded in), RMS-normalised keys and raw values.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["EPS", "sinkhorn", "rms_project", "mhc_coefficients", "mhc_coefficient_logits",
           "stream_mix", "stream_update", "depth_attention"]

# The epsilon of every mHC normalisation (RMSNorm, H_pre offset, Sinkhorn), as in DeepSeek-V4.
EPS = 1e-6


def sinkhorn(logits: torch.Tensor, iters: int = 20, eps: float = EPS) -> torch.Tensor:
    """Sinkhorn-Knopp projection of ``logits [..., n, n]`` towards a doubly stochastic matrix.

    ``M = softmax(logits, -1) + eps`` (the exponential and the first row normalisation), then
    columns, then ``iters - 1`` more (row, column) passes. The last pass normalises columns, so
    every column sums to one up to ``eps`` and row sums are approximately one.
    """
    m = torch.softmax(logits.float(), dim=-1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def rms_project(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """``RMSNorm(x) @ weight^T`` in fp32 (no norm weight), for ``x [..., D]``, ``weight [M, D]``."""
    xf = x.float()
    return (xf @ weight.float().t()) * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def mhc_coefficients(mixes: torch.Tensor, bias: torch.Tensor, gate: torch.Tensor, n: int,
                     iters: int = 20, eps: float = EPS):
    """``(H_pre [..., n], H_post [..., n], H_res [..., n, n])`` from ``mixes [..., (2 + n) n]``,
    the static ``bias [(2 + n) n]`` and the three gating factors ``gate [3]`` (fp32)."""
    pre, post, res = mhc_coefficient_logits(mixes, bias, gate, n, eps)
    return pre, post, sinkhorn(res, iters, eps)


def mhc_coefficient_logits(mixes: torch.Tensor, bias: torch.Tensor, gate: torch.Tensor, n: int,
                           eps: float = EPS):
    """:func:`mhc_coefficients` before its Sinkhorn: ``(H_pre, H_post, logits of H_res
    [..., n, n])``."""
    mixes, bias, gate = mixes.float(), bias.float(), gate.float()
    pre = torch.sigmoid(mixes[..., :n] * gate[0] + bias[:n]) + eps
    post = 2 * torch.sigmoid(mixes[..., n:2 * n] * gate[1] + bias[n:2 * n])
    res = (mixes[..., 2 * n:] * gate[2] + bias[2 * n:]).unflatten(-1, (n, n))
    return pre, post, res


def stream_mix(streams: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_m weights[..., m] streams[..., m, :]`` in fp32, returned in the streams' dtype."""
    return torch.einsum("...m,...mh->...h", weights.float(), streams.float()).to(streams.dtype)


def stream_update(streams: torch.Tensor, y: torch.Tensor, post: torch.Tensor,
                  res: torch.Tensor) -> torch.Tensor:
    """``X'[j] = post[j] y + sum_m res[m, j] X[m]`` for ``X [..., n, h]``, ``y [..., h]``."""
    out = post.float()[..., :, None] * y.float()[..., None, :]
    out = out + torch.einsum("...mj,...mh->...jh", res.float(), streams.float())
    return out.to(streams.dtype)


def depth_attention(query: torch.Tensor, sources: Sequence[torch.Tensor],
                    eps: float = EPS) -> torch.Tensor:
    """``sum_k softmax_k(query . RMSNorm(v_k)) v_k`` over the sources ``v_k``, fp32 inside.

    ``sources`` is a list of ``[..., k_i, h]`` groups, concatenated along the source axis;
    ``query [h]`` is the pseudo-query times the key norm's weight; there is no temperature.
    """
    v = torch.cat([group.float() for group in sources], dim=-2)
    keys = v * torch.rsqrt(v.square().mean(-1, keepdim=True) + eps)
    weights = torch.softmax(keys @ query.float(), dim=-1)
    return torch.einsum("...k,...kh->...h", weights, v).to(sources[0].dtype)
