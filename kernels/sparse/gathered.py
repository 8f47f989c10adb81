"""A :class:`~.layout.BlockLayout` run in PyTorch: for each query block, gather the key blocks
it visits and take one masked softmax over them. Any device; autograd gives the backward.

Work and memory follow the layout: a query block costs ``q_block x (visited blocks x kv_block)``
scores, never a row of the full ``[T, S]`` matrix. Query blocks run in chunks of at most
``max_scores`` scores; with gradients, each chunk is recomputed in the backward pass
(activation checkpointing), so that what is kept for backward is linear in T.
"""
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .layout import BlockLayout

__all__ = ["gathered_attention"]

MAX_SCORES = 1 << 24  # fp32 scores per chunk: 64 MiB (1 GiB on a GPU: max_scores)


def max_scores(device: torch.device) -> int:
    """The fp32 values one chunk of queries may hold on ``device``: MAX_SCORES, 16 times that on
    CUDA, where each chunk's launches and host work dominate small chunks."""
    return MAX_SCORES * (16 if device.type == "cuda" else 1)


def _softmax_with_sink(scores, mask, sink):
    """Masked softmax over the last dim with ``exp(sink)`` in the denominator (sink None: none);
    a row with no allowed key and no sink is all zero."""
    scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(-1, keepdim=True)
    if sink is not None:
        top = torch.maximum(top, sink)
    top = top.masked_fill(top == float("-inf"), 0.0).detach()  # any shift gives the same result
    weights = torch.exp(scores - top)
    denominator = weights.sum(-1, keepdim=True)
    if sink is not None:
        denominator = denominator + torch.exp(sink - top)
    return weights / denominator.clamp_min(torch.finfo(weights.dtype).tiny)


def _attend_chunk(q, k_flat, v_flat, flat_index, kv_index, kv_valid, q_index, sink, scale,
                  mask_mod):
    """One chunk of query blocks. q ``[B, L, G, c, qb, D]`` (L layout heads, G query heads
    each); flat_index / kv_index / kv_valid ``[B, L, c, K]``: the gathered keys' rows in
    k_flat, their positions, and whether they count; q_index ``[c, qb]``."""
    batch, layout_heads, group, chunk, q_block, _ = q.shape
    rows = torch.arange(batch, device=q.device).view(batch, 1, 1, 1)
    keys = k_flat[rows, flat_index].float()  # [B, L, c, K, D]
    values = v_flat[rows, flat_index].float()
    scores = torch.einsum("blgcqd,blckd->blgcqk", q.float(), keys) * scale
    query_heads = (torch.arange(layout_heads, device=q.device)[:, None] * group
                   + torch.arange(group, device=q.device))
    mask = mask_mod(rows.view(batch, 1, 1, 1, 1, 1),
                    query_heads.view(1, layout_heads, group, 1, 1, 1),
                    q_index.view(1, 1, 1, chunk, q_block, 1), kv_index[:, :, None, :, None, :])
    mask = mask & kv_valid[:, :, None, :, None, :]
    if sink is not None:
        sink = sink.float().view(1, layout_heads, group, 1, 1, 1)
    probs = _softmax_with_sink(scores, mask, sink)
    return torch.einsum("blgcqk,blckd->blgcqd", probs, values)


def gathered_attention(q, k, v, layout: BlockLayout, *, sink=None, scale=None):
    """Attention of q ``[B, T, Hq, D]`` over k, v ``[B, S, Hkv, D]`` restricted to ``layout``,
    with an optional sink logit per query head ``[Hq]``; ``[B, T, Hq, D]`` in v's dtype."""
    batch, seq_len, heads, dim = q.shape
    key_len, kv_heads = k.shape[1], k.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    q_block, kv_block = layout.q_block, layout.kv_block
    active = layout.active
    # Keys are gathered once per layout head: per key/value head when the layout is shared by
    # a key/value group (or by all heads), per query head otherwise.
    layout_heads = heads if active.shape[1] == heads else kv_heads
    group = heads // layout_heads
    num_q = active.shape[2]
    active = active.expand(batch, layout_heads, num_q, active.shape[3])
    counts, order = layout.kv_blocks(active)

    kv_head = torch.arange(layout_heads, device=q.device) // (layout_heads // kv_heads)
    k_flat = k.transpose(1, 2).reshape(batch, kv_heads * key_len, dim)
    v_flat = v.transpose(1, 2).reshape(batch, kv_heads * key_len, dim)
    padded_len = num_q * q_block
    q_blocks = F.pad(q, (0, 0, 0, 0, 0, padded_len - seq_len)).view(
        batch, num_q, q_block, layout_heads, group, dim).permute(0, 3, 4, 1, 2, 5)

    widest = max(int(counts.max()), 1) * kv_block
    per_chunk = max(1, max_scores(q.device) // (batch * heads * q_block * widest))
    keep_for_backward = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, sink))
    outputs = []
    for first in range(0, num_q, per_chunk):
        last = min(first + per_chunk, num_q)
        visited = max(int(counts[:, :, first:last].max()), 1)
        blocks = order[:, :, first:last, :visited].long()  # [B, L, c, M]
        block_valid = (torch.arange(visited, device=q.device)
                       < counts[:, :, first:last, None])
        kv_index = (blocks[..., None] * kv_block
                    + torch.arange(kv_block, device=q.device)).flatten(-2)  # [B, L, c, M * kvb]
        kv_valid = block_valid.repeat_interleave(kv_block, dim=-1) & (kv_index < key_len)
        kv_index = kv_index.clamp(max=key_len - 1)
        flat_index = kv_head.view(1, layout_heads, 1, 1) * key_len + kv_index
        q_index = (torch.arange(first, last, device=q.device)[:, None] * q_block
                   + torch.arange(q_block, device=q.device)).clamp(max=seq_len - 1)
        args = (q_blocks[:, :, :, first:last], k_flat, v_flat, flat_index, kv_index, kv_valid,
                q_index, sink, scale, layout.mask_mod)
        if keep_for_backward:
            outputs.append(checkpoint(_attend_chunk, *args, use_reentrant=False))
        else:
            outputs.append(_attend_chunk(*args))
    out = torch.cat(outputs, dim=3)  # [B, L, G, nq, qb, D]
    out = out.permute(0, 3, 4, 1, 2, 5).reshape(batch, padded_len, heads, dim)
    return out[:, :seq_len].to(v.dtype)
