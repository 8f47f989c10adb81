"""Softmax attention with a sliding window and a learnable sink, and the sparse attentions MoBA,
NSA and DSA, behind one layout ``[B, T, H, D]`` (grouped heads: k and v may have fewer heads).

Backends, with one signature per op:
    reference   the dense fp32 definitions, explicit ``[B, H, T, S]`` masks (reference.py)
    gathered    the op as a block layout (layout.py) run in PyTorch: each query block gathers
                the key blocks it visits; any device, memory linear in T (gathered.py)
    flex        the same layout as a FlexAttention BlockMask; compiled on CUDA; on the CPU
                forward only (flex.py)
"auto" is flex on CUDA and gathered elsewhere. ``layout_blocks=(q_block, kv_block)`` overrides
the layout's block sizes (defaults: 128 x 128 for flex, 64 x 64 for gathered; 16 x 64 for
NSA's selected branch in gathered, whose queries pick their own blocks); the result does not
depend on them.

DSA selects keys per token, which no block layout describes; its ops (``dsa_select``,
``dsa_attention``, ``dsa_indexer_loss``) run the reference or, for every other backend, the
per-token gathered form of selected.py.

``exclusive_self_attention`` (XSA) post-processes any attention output.
"""
import math

import torch

from .flex import flex_attention_layout
from .gathered import gathered_attention
from .layout import (allowed_rule, both, compress, document_rule, interval_layout, moba_chosen,
                     nsa_chosen, selection_layout, window_rule, window_span)
from .reference import (OP, check_qkv, dsa_attention_reference, dsa_indexer_loss_reference,
                        dsa_select_reference, exclusive_self_attention, moba_attention_reference,
                        nsa_attention_reference, softmax_attention_reference)
from .selected import indexer_loss, select_keys, selected_attention

__all__ = [
    "BACKENDS", "softmax_attention", "moba_attention", "nsa_attention", "dsa_select",
    "dsa_attention", "dsa_indexer_loss", "exclusive_self_attention",
]

BACKENDS = ("auto", "reference", "gathered", "flex")
_EXECUTORS = {"gathered": gathered_attention, "flex": flex_attention_layout}


def _backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend={backend!r} is not one of {list(BACKENDS)}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "gathered"
    return backend


def _blocks(name: str, layout_blocks, gathered_default=(64, 64)):
    if layout_blocks is not None:
        return layout_blocks
    return (128, 128) if name == "flex" else gathered_default


def _check_sink(sink, q):
    if sink is not None and tuple(sink.shape) != (q.shape[2],):
        raise ValueError(f"{OP}: sink has shape {tuple(sink.shape)}, expected [Hq] = "
                         f"[{q.shape[2]}] (one logit per query head)")


def softmax_attention(q, k, v, *, causal=True, window=None, sink=None, scale=None,
                      cu_seqlens=None, allowed=None, backend="auto", layout_blocks=None):
    """Softmax attention, optionally causal, with an optional sliding window ``(left, right)``
    (Megatron's convention: query t sees keys t - left .. t + right, -1 unbounded), learnable
    sink ``[Hq]`` (``exp(sink_h)`` added to the softmax denominator), packed sequences
    (``cu_seqlens [N + 1]``, B == 1) and extra bool mask ``allowed`` ``[B | 1, Hq | 1, T, S]``
    (True = may attend). q ``[B, T, Hq, D]``, k, v ``[B, S, Hkv, D]`` -> ``[B, T, Hq, D]``."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    name = _backend(backend, q.device)
    if name == "reference":
        return softmax_attention_reference(q, k, v, causal=causal, window=window, sink=sink,
                                           scale=scale, cu_seqlens=cu_seqlens, allowed=allowed)
    seq_len, key_len = q.shape[1], k.shape[1]
    rule = window_rule(causal, window)
    if cu_seqlens is not None:
        rule = both(rule, document_rule(cu_seqlens, seq_len))
    if allowed is not None:
        rule = both(rule, allowed_rule(allowed.expand(q.shape[0], -1, seq_len, key_len)))
    layout = interval_layout(seq_len, key_len, *_blocks(name, layout_blocks),
                             *window_span(causal, window), rule, q.device)
    return _EXECUTORS[name](q, k, v, layout, sink=sink, scale=scale)


def _check_top_k(top_k: int, num_blocks: int, what: str):
    if top_k > num_blocks:
        raise ValueError(f"{OP}: {what}: top_k={top_k} is more than the {num_blocks} blocks of "
                         "the sequence")


def moba_attention(q, k, v, *, block_size, top_k, window=None, sink=None, scale=None,
                   allowed=None, backend="auto", layout_blocks=None):
    """MoBA (Lu et al. 2025, see ``moba_attention_reference``): per query and head, causal
    attention over its own key block and the ``top_k - 1`` finished blocks of highest
    ``q . mean(K_block)``; with an optional sliding window, sink and extra mask as in
    :func:`softmax_attention`. top_k may not exceed the number of blocks,
    ``ceil(T / block_size)``."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    seq_len = q.shape[1]
    if k.shape[1] != seq_len:
        raise ValueError(f"{OP}: MoBA is self-attention; k has {k.shape[1]} tokens, q {seq_len}")
    _check_top_k(top_k, math.ceil(seq_len / block_size), f"MoBA with block_size={block_size}")
    name = _backend(backend, q.device)
    if name == "reference":
        return moba_attention_reference(q, k, v, block_size=block_size, top_k=top_k,
                                        window=window, sink=sink, scale=scale, allowed=allowed)
    chosen = moba_chosen(q, k, block_size, top_k)  # [B, Hq, T, n]
    rule = both(window_rule(True, window),
                lambda b, h, t, s: chosen[b, h, t, s // block_size])
    if allowed is not None:
        rule = both(rule, allowed_rule(allowed.expand(q.shape[0], -1, seq_len, seq_len)))
    q_block, kv_block = _blocks(name, layout_blocks)
    layout = selection_layout(chosen, block_size, seq_len, q_block, kv_block, rule)
    if window is not None:
        band = interval_layout(seq_len, seq_len, q_block, kv_block, *window_span(True, window),
                               rule, q.device)
        layout.active = layout.active & band.active
    return _EXECUTORS[name](q, k, v, layout, sink=sink, scale=scale)


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
    name = _backend(backend, q.device)
    sizes = dict(compress_block=compress_block, compress_stride=compress_stride,
                 select_block=select_block, select_top_k=select_top_k)
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
            sees, q.device)
        out_compressed = run(q, compressed_k, compressed_v, layout, sink=sink, scale=scale)
    else:
        out_compressed = torch.zeros_like(q, dtype=v.dtype)

    # Selected: per key/value group, the blocks ranked by the compressed branch.
    chosen = nsa_chosen(q, compressed_k, scale=scale, **sizes)  # [B, Hkv, T, n]
    group = heads // kv_heads
    rule = lambda b, h, t, s: chosen[b, h // group, t, s // select_block] & (s <= t)  # noqa: E731
    select_blocks = _blocks(name, layout_blocks, gathered_default=(16, 64))
    layout = selection_layout(chosen, select_block, seq_len, *select_blocks, rule)
    out_selected = run(q, k, v, layout, sink=sink, scale=scale)

    # Sliding window over the last `window` tokens.
    last_tokens = (window - 1, 0)
    layout = interval_layout(seq_len, seq_len, q_block, kv_block, *window_span(True, last_tokens),
                             window_rule(True, last_tokens), q.device)
    out_window = run(q, k, v, layout, sink=sink, scale=scale)

    gates = gates.float()
    out = (gates[..., 0:1] * out_compressed.float() + gates[..., 1:2] * out_selected.float()
           + gates[..., 2:3] * out_window.float())
    return out.to(v.dtype)


def _dsa_reference(backend: str) -> bool:
    """Whether a DSA op runs its reference (else the per-token gathered form)."""
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend={backend!r} is not one of {list(BACKENDS)}")
    return backend == "reference"


def _check_index(index_q, index_k, index_weights, seq_len: int):
    """Raise ValueError, with the shapes, unless the indexer's tensors fit each other and T."""
    tensors = (index_q, index_k, index_weights)
    fits = index_q.dim() == 4 and index_q.shape[1] == seq_len
    if fits:
        batch, _, heads, dim = index_q.shape
        fits = (tuple(index_k.shape) == (batch, seq_len, dim)
                and tuple(index_weights.shape) == (batch, seq_len, heads))
    if not fits or not all(t.is_floating_point() for t in tensors):
        shapes = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in
                           zip(("index_q", "index_k", "index_weights"), tensors))
        raise ValueError(f"{OP}: DSA's indexer takes floating-point index_q [B, T, HI, DI], "
                         f"index_k [B, T, DI], index_weights [B, T, HI] with T = {seq_len}; "
                         f"got {shapes}")


def dsa_select(index_q, index_k, index_weights, *, top_k, cu_seqlens=None, backend="auto"):
    """DSA (DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556; see ``lightning_index_scores``):
    the ``top_k`` keys of each query among its causal keys (within its own sequence of a pack,
    ``cu_seqlens``, B == 1) by the lightning indexer's score ``sum_j w_tj relu(q_tj . k_s)``.
    index_q ``[B, T, HI, DI]``, index_k ``[B, T, DI]``, index_weights ``[B, T, HI]`` ->
    ``[B, T, min(top_k, T)]`` int32 key positions; a query with fewer causal keys gets all of
    them, then -1. No gradient: the choice is discrete."""
    _check_index(index_q, index_k, index_weights, index_q.shape[1])
    if top_k < 1:
        raise ValueError(f"{OP}: DSA's top_k={top_k} must be >= 1")
    if _dsa_reference(backend):
        return dsa_select_reference(index_q, index_k, index_weights, top_k=top_k,
                                    cu_seqlens=cu_seqlens)
    return select_keys(index_q, index_k, index_weights, top_k=top_k, cu_seqlens=cu_seqlens)


def dsa_attention(q, k, v, selected, *, sink=None, scale=None, backend="auto"):
    """DSA's sparse attention: each query attends to its ``selected [B, T, K]`` keys
    (:func:`dsa_select`; shared by all heads, -1 skipped), with the sink and scale of
    :func:`softmax_attention`. q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` -> ``[B, T, Hq, D]``;
    memory O(T K)."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    if (selected.dim() != 3 or tuple(selected.shape[:2]) != tuple(q.shape[:2])
            or selected.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{OP}: selected has shape {tuple(selected.shape)} and dtype "
                         f"{selected.dtype}, expected integer [B, T, K] with B, T = "
                         f"{q.shape[0]}, {q.shape[1]}")
    if _dsa_reference(backend):
        return dsa_attention_reference(q, k, v, selected, sink=sink, scale=scale)
    return selected_attention(q, k, v, selected, sink=sink, scale=scale)


def dsa_indexer_loss(q, k, index_q, index_k, index_weights, *, selected=None, cu_seqlens=None,
                     sink=None, scale=None, reduce_heads=None, backend="auto"):
    """The indexer's training loss (arXiv 2512.02556, sec. 2.1), averaged over the B * T
    queries: ``KL(p_t || softmax(I_t))``, p the main attention of q, k (with sink and scale; no
    gradient reaches q, k or the sink) summed over the heads and L1-normalised, I the indexer's
    scores. ``selected=None`` (dense warm-up): over every causal key; else over the selected
    keys only (sparse training). ``reduce_heads``: sums a ``[B, T', S']`` tensor over the query
    heads of other processes (tensor parallelism) and returns the sum."""
    check_qkv(OP, q, k, k)
    _check_sink(sink, q)
    _check_index(index_q, index_k, index_weights, q.shape[1])
    options = dict(selected=selected, cu_seqlens=cu_seqlens, sink=sink, scale=scale,
                   reduce_heads=reduce_heads)
    if _dsa_reference(backend):
        return dsa_indexer_loss_reference(q, k, index_q, index_k, index_weights, **options)
    return indexer_loss(q, k, index_q, index_k, index_weights, **options)
