"""NSA (``nsa_attention``): compressed, selected and sliding-window branches mixed by gates;
declared in the backend registry: "auto" prefers flash for the selected and window branches (on
CUDA, from ``NSA_FLASH_MIN_LEN`` tokens a sequence, where flash.py takes the call and has passed
its first-use check; the compressed branch then runs on "auto"'s block layout,
``routing``'s ``block_layout``), then flex (on CUDA), then gathered."""
import math

import torch

from .. import registry
from . import flash
from .flex import compiled_on_cuda
from .layout import (compress, interval_layout, nsa_chosen, selection_layout, window_rule,
                     window_span)
from .reference import OP, check_qkv, nsa_attention_reference
from .routing import _EXECUTORS, _blocks, _check_sink, _check_top_k, attention_facts, layout_backends


NSA_FLASH_MIN_LEN = 8192
NAME = "nsa_attention"


def _short(facts: registry.Facts) -> str | None:
    seq_len = facts.extra.get("seq_len")
    if seq_len is not None and seq_len < NSA_FLASH_MIN_LEN:
        return f"{seq_len} tokens, under NSA_FLASH_MIN_LEN = {NSA_FLASH_MIN_LEN}"
    return None


registry.declare(registry.Op(
    NAME,
    backends=layout_backends(nsa_attention_reference, flash.block_selection_attention,
                             flash_limit=_short),
    auto=("flash", "flex", "gathered"),
    facts=lambda q, k, v, *args, **options: attention_facts(q, k, v),
))


def nsa_attention(q, k, v, gates, k_weights, v_weights, *, compress_block, compress_stride,
                  select_block, select_top_k, window, sink=None, scale=None, backend="auto",
                  layout_blocks=None):
    """NSA (Yuan et al. 2025, see ``nsa_attention_reference``): compressed, selected and
    sliding-window branches, summed with the gates ``[B, T, Hq, 3]`` (in (0, 1)).
    ``k_weights``, ``v_weights`` ``[Hkv, compress_block]``: the compression's position weights.
    compress_block and select_block are multiples of compress_stride; select_top_k counts the
    3 blocks always kept and may not exceed ``ceil(T / select_block)``."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    batch, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    if tuple(gates.shape) != (batch, seq_len, heads, 3):
        raise ValueError(f"{OP}: gates has shape {tuple(gates.shape)}, expected [B, T, Hq, 3] = "
                         f"{[batch, seq_len, heads, 3]}")
    for label, weights in (("k_weights", k_weights), ("v_weights", v_weights)):
        if tuple(weights.shape) != (kv_heads, compress_block):
            raise ValueError(f"{OP}: {label} has shape {tuple(weights.shape)}, expected "
                             f"[Hkv, compress_block] = {[kv_heads, compress_block]}")
    if compress_block % compress_stride or select_block % compress_stride:
        raise ValueError(f"{OP}: NSA needs compress_block={compress_block} and select_block="
                         f"{select_block} to be multiples of compress_stride={compress_stride}")
    if select_top_k < 3:
        raise ValueError(f"{OP}: NSA's select_top_k={select_top_k} must be >= 3 (the first and "
                         "the 2 local blocks are always selected)")
    _check_top_k(select_top_k, math.ceil(seq_len / select_block),
                 f"NSA with select_block={select_block}")
    sizes = dict(compress_block=compress_block, compress_stride=compress_stride,
                 select_block=select_block, select_top_k=select_top_k)
    # With flash, the selected and window branches run on flash.py and the compressed one
    # (few keys, no FlashAttention form) on "auto"'s block layout.
    facts = attention_facts(q, k, v)
    name = registry.choose(NAME, backend, facts)
    use_flash = name == "flash"
    if use_flash:
        name = registry.choose("block_layout", "auto", facts)
    if name == "reference":
        return nsa_attention_reference(q, k, v, gates, k_weights, v_weights, window=window,
                                       sink=sink, scale=scale, **sizes)
    scale = dim ** -0.5 if scale is None else scale
    run = _EXECUTORS[name]
    q_block, kv_block = _blocks(name, layout_blocks)

    # Compressed: query t sees compressed token i when its block ends at or before t.
    compressed_k = compress(k, k_weights, compress_block, compress_stride)
    compressed_v = compress(v, v_weights, compress_block, compress_stride)
    num_compressed = compressed_k.shape[1]
    if num_compressed:
        sees = lambda b, h, t, i: i * compress_stride + compress_block - 1 <= t  # noqa: E731
        layout = interval_layout(
            seq_len, num_compressed, q_block, kv_block, torch.zeros_like,
            lambda t: torch.div(t - compress_block + 1, compress_stride, rounding_mode="floor"),
            sees, q.device, dense_columns=True)
        out_compressed = run(q, compressed_k, compressed_v, layout, sink=sink, scale=scale)
    else:
        out_compressed = torch.zeros_like(q, dtype=v.dtype)

    # Selected: per key/value group, the blocks ranked by the compressed branch.
    chosen = nsa_chosen(q, compressed_k, scale=scale, **sizes)  # [B, Hkv, T, n]
    last_tokens = (window - 1, 0)  # the sliding window: the last `window` tokens
    if use_flash:
        out_selected = flash.block_selection_attention(q, k, v, chosen, select_block,
                                                       select_top_k, sink=sink, scale=scale)
        out_window = flash.flash_attention(q, k, v, causal=True, window=last_tokens, sink=sink,
                                           scale=scale)
    else:
        group = heads // kv_heads
        rule = lambda b, h, t, s: chosen[b, h // group, t, s // select_block] & (s <= t)  # noqa: E731
        select_blocks = _blocks(name, layout_blocks, gathered_default=(16, 64))
        layout = selection_layout(chosen, select_block, seq_len, *select_blocks, rule)
        out_selected = run(q, k, v, layout, sink=sink, scale=scale)
        layout = interval_layout(seq_len, seq_len, q_block, kv_block,
                                 *window_span(True, last_tokens), window_rule(True, last_tokens),
                                 q.device)
        out_window = run(q, k, v, layout, sink=sink, scale=scale)

    return _gated_sum_body(gates, out_compressed, out_selected, out_window)


def _gated_sum(gates, compressed, selected, window):
    """NSA's output: its branches weighted by the gates ``[B, T, Hq, 3]``, summed in fp32 and
    rounded once to the branches' dtype."""
    gates = gates.float()
    out = (gates[..., 0:1] * compressed.float() + gates[..., 1:2] * selected.float()
           + gates[..., 2:3] * window.float())
    return out.to(window.dtype)


# One fused kernel each way on CUDA, where eager PyTorch runs about ten elementwise passes over
# [B, T, Hq, D] in fp32 forward and more backward.
_gated_sum_body = compiled_on_cuda(_gated_sum, "NSA's gated sum of its branches")
