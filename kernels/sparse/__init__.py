"""Softmax attention with a sliding window and a learnable sink, and the sparse attentions MoBA,
NSA and DSA, behind one layout ``[B, T, H, D]`` (grouped heads: k and v may have fewer heads).

Backends, with one signature per op:
    reference   the dense fp32 definitions, explicit ``[B, H, T, S]`` masks (reference.py)
    gathered    the op as a block layout (layout.py) run in PyTorch: each query block gathers
                the key blocks it visits; any device, memory linear in T (gathered.py)
    flex        the same layout as a FlexAttention BlockMask; compiled on CUDA; on the CPU
                forward only (flex.py)
    flash       ``softmax_attention``, ``moba_attention`` (no window) and
                ``nsa_attention`` (its selected and window branches) only: torch's
                FlashAttention-2 kernels with the sink applied through their log-sum-exp (and
                cuDNN's fused attention for MoBA's and NSA's own blocks where every block is
                full, and for their earlier blocks from blocks of 128, once cuDNN passed its
                own first-use check); CUDA, fp16/bf16, no extra mask (flash.py);
                ``dsa_attention`` of a causal selection on cuDNN's fused attention, the
                selection an additive bias; and ``csa_attention`` given its entries'
                compression ``rate``: the window on FlashAttention-2, the selected entries on
                cuDNN with the selection as a bias
    triton      ``dsa_attention`` and ``csa_attention`` only, and the sparse stage of
                ``dsa_indexer_loss`` and ``csa_indexer_loss`` (its target and its KL): our
                Triton kernels of the per-token selected attention and of the indexer's loss,
                forward and backward; CUDA, fp32/bf16/fp16, head dims up to 256 (triton.py and
                triton_indexer.py; imported on first use, so that this package imports where
                Triton does not)
"auto" is flex on CUDA (head dims of 16 or more) and gathered elsewhere; for softmax_attention
and moba_attention it is flash where flash.py covers the call and has passed its first-use check
on the device, and so it is for nsa_attention's selected and window branches from
``NSA_FLASH_MIN_LEN`` tokens a sequence.
``layout_blocks=(q_block, kv_block)`` overrides the layout's block sizes (defaults: 128 x 128
for flex, 64 x 64 for gathered; 16 x 64 for NSA's selected branch in gathered, whose queries
pick their own blocks); the result does not depend on them.

DSA selects keys per token; its ops (``dsa_select``, ``dsa_attention``, ``dsa_indexer_loss``)
run the reference or, for every other backend, the per-token gathered form of selected.py (the
selection's scores in triton_indexer.py's kernel on CUDA); but ``dsa_attention`` (and CSA's
``csa_attention``), and the indexer losses' sparse stage, run triton.py's kernels with
"triton", and with "auto" on CUDA where they take the call and have passed their first-use
check on the device in the call's dtype. With "flex", and with "auto" on CUDA for up to
``SELECTED_FLEX_MAX_KEYS`` keys, ``dsa_attention`` and ``csa_attention`` run FlexAttention over
the selection written as a bitmap (``layout.key_selection_layout``): dense tiles on tensor
cores instead of a gather of each query's keys per key/value head (the indexer losses' sparse
stage runs as under "auto" then). A selection declared causal (``dsa_attention(...,
causal=True)``, as the DSA layer declares ``dsa_select``'s) runs, with "flash" and with "auto"
before those, on cuDNN's fused attention with the selection as an additive bias (flash.py).

DeepSeek-V4's compressed attentions (compressed.py): ``compress_kv`` makes one entry per block
of tokens; HCA's ``compressed_attention`` (all the entries a query sees, plus a sliding window)
is a block layout, run like ``softmax_attention``; CSA's ``csa_select``, ``csa_attention`` and
``csa_indexer_loss`` pick entries per token and run like DSA's ops, but ``csa_attention`` given
``rate=`` runs, with "flash" and with "auto" before those, on flash.py's window + entries split
(both kernels' first-use checks passed), and returns the entries' log-sum-exp for the loss.

``exclusive_self_attention`` (XSA) post-processes any attention output.
"""
import math

import torch

from . import flash
from .compressed import (compress_blocks, compressed_entries, compressed_layout, first_tokens,
                         tiled_compressed_layout, window_and_selected, with_entries)
from .flex import compiled_on_cuda, flex_attention_layout
from .gathered import gathered_attention
from .layout import (allowed_rule, both, compress, document_rule, interval_layout,
                     key_selection_layout, moba_chosen, nsa_chosen, selection_layout, window_rule,
                     window_span)
from .reference import (OP, _masked_probs, causal_mask, check_qkv, compress_kv_reference,
                        compressed_attention_reference, compressed_visibility,
                        csa_attention_reference, csa_indexer_loss_reference,
                        csa_select_reference, dsa_attention_reference,
                        dsa_indexer_loss_reference, dsa_select_reference,
                        exclusive_self_attention, indexer_kl, lightning_index_scores,
                        moba_attention_reference, nsa_attention_reference, selected_mask,
                        softmax_attention_reference)
from .selected import QueryShares, indexer_loss, select_keys, selected_attention

__all__ = [
    "BACKENDS", "softmax_attention", "moba_attention", "nsa_attention", "dsa_select",
    "dsa_attention", "dsa_indexer_loss", "compressed_entries", "compress_kv",
    "compressed_attention", "csa_select", "csa_attention", "csa_indexer_loss", "QueryShares",
    "exclusive_self_attention",
]

BACKENDS = ("auto", "reference", "gathered", "flex", "triton")
_EXECUTORS = {"gathered": gathered_attention, "flex": flex_attention_layout}


# FlexAttention's compiled CUDA kernels take head dims of 16 and more (torch 2.11).
FLEX_MIN_HEAD_DIM = 16


def _backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend={backend!r} is not one of {list(BACKENDS)}")
    if backend == "triton":
        raise ValueError(f"{OP}: backend='triton' runs dsa_attention and csa_attention only "
                         "(the Triton kernels of the per-token selected attention)")
    flex_fits = q.shape[-1] >= FLEX_MIN_HEAD_DIM or q.device.type != "cuda"
    if backend == "auto":
        return "flex" if q.device.type == "cuda" and flex_fits else "gathered"
    if backend == "flex" and not flex_fits:
        raise ValueError(f"{OP}: backend='flex' needs a head dim of at least "
                         f"{FLEX_MIN_HEAD_DIM} on CUDA (FlexAttention's kernels); got "
                         f"{q.shape[-1]}: use 'gathered' or 'auto'")
    return backend


def _runs_flash(backend: str, q, k, v, allowed, supported=True) -> bool:
    """Whether this call runs on flash.py: asked for ("flash", which raises ValueError with the
    reason where it cannot), or "auto" where flash.py covers the call and has passed its
    first-use check on this device and dtype. ``supported``: True, or what of the call's own
    options flash.py does not take."""
    if backend not in ("flash", "auto"):
        return False
    reason = flash.unavailable_reason(q, k, v, allowed=allowed)
    if reason is None and supported is not True:
        reason = f"flash.py does not take {supported}"
    if backend == "flash" and reason is not None:
        raise ValueError(f"{OP}: backend='flash' cannot run this call: {reason}")
    return reason is None and (backend == "flash" or flash.checked(q.device, q.dtype))


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
    (True = may attend). q ``[B, T, Hq, D]``, k, v ``[B, S, Hkv, D]`` -> ``[B, T, Hq, D]``.
    Backends as the module's, plus "flash" (flash.py)."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    if _runs_flash(backend, q, k, v, allowed):
        return flash.flash_attention(q, k, v, causal=causal, window=window, sink=sink,
                                     scale=scale, cu_seqlens=cu_seqlens)
    name = _backend(backend, q)
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
    if _runs_flash(backend, q, k, v, allowed, window is None or "a sliding window"):
        return flash.moba_attention(q, k, v, block_size=block_size, top_k=top_k, sink=sink,
                                    scale=scale)
    name = _backend(backend, q)
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


# From this many tokens a sequence, "auto" runs NSA's selected and window branches on flash.py
# (where it runs and has passed its first-use check), below it all three on the block layout.
# On an H200 (B*T = 32768, 16 query heads of 128, bf16, fwd+bwd; benchmarks/sparse_attention.py)
# flash and the block layout (FlexAttention) are even at T = 4096, and from T = 8192 on flash is
# the faster (about 3x at T = 32768), with 4 key/value heads (and with 16 at T = 8192). Flash's
# peak memory is 4-5x the layout's: its call over the chosen blocks holds each query's row once
# per block.
NSA_FLASH_MIN_LEN = 8192


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
    # (few keys, no FlashAttention form) on "auto"'s block layout. "auto" takes flash from
    # NSA_FLASH_MIN_LEN tokens on.
    asks_flash = backend == "flash" or (backend == "auto" and seq_len >= NSA_FLASH_MIN_LEN)
    use_flash = asks_flash and _runs_flash(backend, q, k, v, None)
    name = _backend("auto" if use_flash else backend, q)
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


def _check_selected(selected, q):
    if (selected.dim() != 3 or tuple(selected.shape[:2]) != tuple(q.shape[:2])
            or selected.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{OP}: selected has shape {tuple(selected.shape)} and dtype "
                         f"{selected.dtype}, expected integer [B, T, K] with B, T = "
                         f"{q.shape[0]}, {q.shape[1]}")


def _selected_kernels(backend: str, q, k, v):
    """triton.py's module where the per-token selected ops (the attention of dsa_attention and
    csa_attention, the sparse stage of their indexer losses) run on its kernels, else None:
    where asked for ("triton", which raises ValueError with the reason where they cannot run
    the call) or, under "auto" on CUDA, where they can and have passed their first-use check
    on this device in q's dtype. Elsewhere the gathered form of selected.py runs."""
    if backend != "triton" and not (backend == "auto" and q.device.type == "cuda"):
        return None
    try:
        from . import triton as kernels
    except ImportError as error:
        kernels, reason = None, f"Triton does not import here ({error})"
    else:
        reason = kernels.unavailable_reason(q, k, v)
    if backend == "triton" and reason is not None:
        raise ValueError(f"{OP}: backend='triton' cannot run this call: {reason}")
    if reason is None and (backend == "triton" or kernels.checked(q.device, q.dtype)):
        return kernels
    return None


# The most keys for which "auto" runs dsa_attention and csa_attention on FlexAttention over the
# selection's bitmap. Its dense tiles cost B Hq T S / 2 (query, key) products and its bitmap
# B T S / 8 bytes, against B T K rows for the gathered kernels (triton.py), which leaves flex the
# faster up to long sequences (benchmarks/dsa_stages.py, on an H200); beyond this limit, triton.
SELECTED_FLEX_MAX_KEYS = 65536


def _selected_attention(backend: str, q, k, v, selected, sink, scale):
    """dsa_attention's and csa_attention's per-token attention (backend not "reference")."""
    flex_fits = (q.device.type == "cuda" and q.shape[-1] >= FLEX_MIN_HEAD_DIM
                 and k.shape[1] <= SELECTED_FLEX_MAX_KEYS)
    if backend == "flex" or (backend == "auto" and flex_fits):
        _backend(backend, q)  # raises where FlexAttention's kernels cannot take the call
        layout = key_selection_layout(selected, k.shape[1], *_blocks("flex", None))
        # Its main kernel always: under 128 queries with grouped heads Inductor picks its
        # decoding kernel, which finds no valid configuration for this layout at T = 70 with 4
        # query heads per key/value head in fp32 on an H200 (torch 2.11).
        return flex_attention_layout(q, k, v, layout, sink=sink, scale=scale,
                                     kernel_options={"BACKEND": "TRITON"})
    kernels = _selected_kernels(backend, q, k, v)
    run = selected_attention if kernels is None else kernels.selected_attention
    return run(q, k, v, selected, sink=sink, scale=scale)


def _loss_kernels(backend: str, q, k, selected, index_q, index_k):
    """triton.py's module for an indexer loss's sparse stage (its target and its KL) where the
    kernels run (:func:`_selected_kernels`, and triton_indexer.py takes the indexer's tensors),
    else None (the chunked PyTorch form)."""
    if selected is None:
        return None
    # The loss has no FlexAttention form: under "flex" (which runs the attention over the
    # selection's bitmap) its sparse stage runs as under "auto".
    kernels = _selected_kernels("auto" if backend == "flex" else backend, q, k, k)
    if kernels is None:
        return None
    reason = kernels.indexer_unavailable_reason(index_q, index_k)
    if backend == "triton" and reason is not None:
        raise ValueError(f"{OP}: backend='triton' cannot run this call: {reason}")
    return kernels if reason is None else None


def _dsa_reference(backend: str) -> bool:
    """Whether a DSA op runs its reference (else the per-token gathered form)."""
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend={backend!r} is not one of {list(BACKENDS)}")
    return backend == "reference"


def _check_index(index_q, index_k, index_weights, seq_len: int, keys: tuple | None = None,
                 shares: QueryShares | None = None):
    """Raise ValueError, with the shapes, unless the indexer's tensors fit each other and T;
    ``keys``: ``(name, count)`` of index_k's keys when they are not the T tokens (CSA);
    ``shares``: index_q and index_weights hold this process's n queries only."""
    key_name, key_len = keys if keys is not None else ("T", seq_len)
    query_name, queries = ("T", seq_len) if shares is None else ("n", shares.positions.shape[1])
    tensors = (index_q, index_k, index_weights)
    fits = index_q.dim() == 4 and index_q.shape[1] == queries
    if fits:
        batch, _, heads, dim = index_q.shape
        fits = (tuple(index_k.shape) == (batch, key_len, dim)
                and tuple(index_weights.shape) == (batch, queries, heads))
    if not fits or not all(t.is_floating_point() for t in tensors):
        shapes = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in
                           zip(("index_q", "index_k", "index_weights"), tensors))
        counts = f"T = {seq_len}" + (f", {key_name} = {key_len}" if keys is not None else "")
        if shares is not None:
            counts += f", n = {queries} (this process's share of the queries)"
        raise ValueError(f"{OP}: the indexer takes floating-point index_q [B, {query_name}, HI, "
                         f"DI], index_k [B, {key_name}, DI], index_weights [B, {query_name}, HI]"
                         f" with {counts}; got {shapes}")


def _check_shares(shares: QueryShares | None, seq_len: int):
    if shares is not None and (shares.positions.dim() != 2
                               or shares.positions.numel() != seq_len):
        raise ValueError(f"{OP}: shares.positions has shape {tuple(shares.positions.shape)}; "
                         f"expected [R, n] holding each of the T = {seq_len} queries once")


def _reference_share(q, k, index_q, index_k, index_weights, allowed, sink, scale, reduce_heads,
                     shares: QueryShares):
    """The reference loss's share of this process (:class:`QueryShares`): the target of every
    query over allowed ``[B | 1, T, S]``, reduce-scattered by query rows, and the KL of this
    process's queries."""
    positions = shares.positions.to(q.device)
    with torch.no_grad():
        mass = _masked_probs(q, k, allowed[:, None], sink, scale).sum(1)  # [B, T, S]
        mass = shares.reduce_scatter(mass[:, positions].movedim(1, 0))
    logits = lightning_index_scores(index_q, index_k, index_weights)
    allowed = allowed[:, positions[shares.rank]].expand_as(logits)
    return indexer_kl(mass, logits, allowed, reduce_heads) / (q.shape[0] * q.shape[1])


def dsa_select(index_q, index_k, index_weights, *, top_k, cu_seqlens=None, backend="auto"):
    """DSA (DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556; see ``lightning_index_scores``):
    the ``top_k`` keys of each query among its causal keys (within its own sequence of a pack,
    ``cu_seqlens``, B == 1) by the lightning indexer's score ``sum_j w_tj relu(q_tj . k_s)``.
    index_q ``[B, T, HI, DI]``, index_k ``[B, T, DI]``, index_weights ``[B, T, HI]`` ->
    ``[B, T, min(top_k, T)]`` int32 key positions, in no particular order (ties go to the
    earlier key); a query with fewer causal keys gets all of them and -1 in its other slots.
    No gradient: the choice is discrete."""
    _check_index(index_q, index_k, index_weights, index_q.shape[1])
    if top_k < 1:
        raise ValueError(f"{OP}: DSA's top_k={top_k} must be >= 1")
    if _dsa_reference(backend):
        return dsa_select_reference(index_q, index_k, index_weights, top_k=top_k,
                                    cu_seqlens=cu_seqlens)
    return select_keys(index_q, index_k, index_weights, top_k=top_k, cu_seqlens=cu_seqlens)


def dsa_attention(q, k, v, selected, *, sink=None, scale=None, causal=False, backend="auto",
                  return_lse=False):
    """DSA's sparse attention: each query attends to its ``selected [B, T, K]`` keys
    (:func:`dsa_select`; shared by all heads, -1 skipped, each key at most once a row: the
    backends may differ on a key listed twice), with the sink and scale of
    :func:`softmax_attention`. q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` -> ``[B, T, Hq, D]``;
    memory O(T K), but O(T^2 / 8) bytes on flex and 2 T^2 on flash. ``causal``: a listed key
    after its query is dropped (:func:`dsa_select` lists none). Backends: the reference;
    cuDNN's fused attention with the selection as a bias (flash.py: "flash", and "auto" on a
    causal selection where it runs and has passed its first-use check, with a bias of up to
    ``CAUSAL_SELECTION_MAX_BIAS`` bytes); FlexAttention over the selection's bitmap ("flex", and
    "auto" on CUDA up to ``SELECTED_FLEX_MAX_KEYS`` keys); triton.py's kernels ("triton", and
    "auto" beyond, where they run); else the gathered form of selected.py.

    ``return_lse``: ``(o, lse)``, lse the log-sum-exp ``[B, T, Hq]`` fp32 of each query head's
    scaled scores over its keys and the sink, without gradient, where the backend that ran
    gives it (cuDNN's), else None; :func:`dsa_indexer_loss` takes it so as not to compute it
    again."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    _check_selected(selected, q)
    if causal:
        after = torch.arange(q.shape[1], device=selected.device)[None, :, None] < selected
        selected = selected.masked_fill(after, -1)
    lse = None
    if _runs_causal_selection(backend, q, k, v, causal):
        out, lse = flash.causal_selection_attention(q, k, v, selected, sink=sink, scale=scale,
                                                    return_lse=True)
    elif _dsa_reference(backend):
        out = dsa_attention_reference(q, k, v, selected, sink=sink, scale=scale)
    else:
        out = _selected_attention(backend, q, k, v, selected, sink, scale)
    return (out, lse) if return_lse else out


# The largest bias (2 B T^2 bytes, made in the forward and again in the backward) for which
# "auto" runs dsa_attention on cuDNN; beyond it FlexAttention's bitmap (B T^2 / 8 bytes). At 4 GiB:
# B = 2 at T = 32768, B = 8 at T = 16384; on an H200 DSA's sparse stage at B = 1, T = 32768
# peaks at 4.59 GiB with its 2 GiB bias (benchmarks/results/sparse_attention_h200.json), 3.33 GiB
# on FlexAttention (``benchmarks/sparse_attention.py --ops dsa/flex``).
CAUSAL_SELECTION_MAX_BIAS = 4 << 30


def _runs_causal_selection(backend: str, q, k, v, causal: bool) -> bool:
    """Whether dsa_attention runs on flash.py's cuDNN form: asked for ("flash", which raises
    ValueError with the reason where it cannot), or under "auto" on a causal selection where
    it can, with a bias of at most ``CAUSAL_SELECTION_MAX_BIAS`` bytes, and cuDNN has passed
    its first-use check on this device and dtype."""
    if backend not in ("flash", "auto"):
        return False
    reason = flash.causal_selection_unavailable_reason(q, k, v)
    if reason is None and not causal:
        reason = "it takes causal selections only (causal=True)"
    if backend == "flash":
        if reason is not None:
            raise ValueError(f"{OP}: backend='flash' cannot run this dsa_attention: {reason}")
        return True
    bias_bytes = q.shape[0] * q.shape[1] * k.shape[1] * q.element_size()
    return (reason is None and bias_bytes <= CAUSAL_SELECTION_MAX_BIAS
            and flash.cudnn_checked(q.device, q.dtype))


def dsa_indexer_loss(q, k, index_q, index_k, index_weights, *, selected=None, cu_seqlens=None,
                     sink=None, scale=None, reduce_heads=None, shares=None, backend="auto",
                     lse=None):
    """The indexer's training loss (arXiv 2512.02556, sec. 2.1), averaged over the B * T
    queries: ``KL(p_t || softmax(I_t))``, p the main attention of q, k (with sink and scale; no
    gradient reaches q, k or the sink) summed over the heads and L1-normalised, I the indexer's
    scores. ``selected=None`` (dense warm-up): over every causal key; else over the selected
    keys only (sparse training; each key at most once a row, as :func:`dsa_attention`).
    ``reduce_heads``: sums a ``[B, T', S']`` tensor over the query heads of other processes
    (tensor parallelism) and returns the sum.

    ``shares`` (:class:`QueryShares`; context parallelism, each process with the whole
    sequence of its own heads in q, k and selected): this process's share of the loss, over its
    queries ``shares.mine``, whose rows alone index_q and index_weights hold
    ``[B, n, ...]``; the target is reduce-scattered from every process's heads (and summed by
    ``reduce_heads`` too, if given). The shares sum to the loss, still divided by B * T.

    ``lse``: :func:`dsa_attention`'s (``return_lse``) for this q, k, ``selected``, sink and
    scale, or None. The sparse stage's target on triton.py's kernels then reuses it rather than
    computing each query head's log-sum-exp again; the other paths compute their own."""
    check_qkv(OP, q, k, k)
    _check_sink(sink, q)
    _check_shares(shares, q.shape[1])
    _check_index(index_q, index_k, index_weights, q.shape[1], shares=shares)
    if _dsa_reference(backend):
        if shares is not None:
            if selected is None:
                allowed = causal_mask(q.shape[1], cu_seqlens, q.device)[None]
            else:
                allowed = selected_mask(selected, k.shape[1])
            return _reference_share(q, k, index_q, index_k, index_weights, allowed, sink, scale,
                                    reduce_heads, shares)
        return dsa_indexer_loss_reference(q, k, index_q, index_k, index_weights,
                                          selected=selected, cu_seqlens=cu_seqlens, sink=sink,
                                          scale=scale, reduce_heads=reduce_heads)
    return indexer_loss(q, k, index_q, index_k, index_weights, selected=selected,
                        cu_seqlens=cu_seqlens, sink=sink, scale=scale, reduce_heads=reduce_heads,
                        shares=shares,
                        kernels=_loss_kernels(backend, q, k, selected, index_q, index_k), lse=lse)


# ------------------------------------------------------------------ DeepSeek-V4 CSA and HCA
def _check_rate(rate, window=None):
    for name, value in (("rate", rate), ("window", window)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{OP}: {name}={value!r} must be a positive integer")


def _check_packed(cu_seqlens, batch: int):
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"{OP}: packed sequences (cu_seqlens) take B == 1; got B = {batch}")


def _check_entries(compressed_k, compressed_v, k, num_entries: int | None = None, rate=None):
    """compressed_k / compressed_v ``[B, N, Hkv, D]`` like k, N = num_entries when given."""
    expected = (k.shape[0], compressed_k.shape[1], k.shape[2], k.shape[3])
    if num_entries is not None:
        expected = expected[:1] + (num_entries,) + expected[2:]
    for name, tensor in (("compressed_k", compressed_k), ("compressed_v", compressed_v)):
        if tuple(tensor.shape) != expected or not tensor.is_floating_point():
            blocks = ("" if num_entries is None else
                      f", N = {num_entries} (one per complete block of rate={rate} tokens)")
            raise ValueError(f"{OP}: {name} has shape {tuple(tensor.shape)} and dtype "
                             f"{tensor.dtype}, expected floating-point [B, N, Hkv, D] = "
                             f"{list(expected)}{blocks}")


def compress_kv(kv, gate, position_bias, *, rate, overlap, cu_seqlens=None, backend="auto"):
    """DeepSeek-V4's KV compression (DeepSeek-AI, "DeepSeek-V4: Towards Highly Efficient
    Million-Token Context Intelligence", arXiv 2606.19348, sec. 2.3; see
    ``compress_kv_reference``): ``kv``, ``gate`` ``[B, T, H, C]`` and ``position_bias``
    ``[H, rate, C]`` -> one entry per complete block of ``rate`` tokens of each sequence,
    ``[B, N, H, D]``; ``overlap`` (CSA: C = 2D) mixes each block with the one before it, else
    (HCA) C = D. Memory linear in T on every backend but "reference"."""
    _check_rate(rate)
    batch, seq_len, heads, channels = kv.shape if kv.dim() == 4 else (None,) * 4
    if (kv.dim() != 4 or gate.shape != kv.shape or not kv.is_floating_point()
            or not gate.is_floating_point() or (overlap and channels % 2)):
        raise ValueError(f"{OP}: compress_kv takes floating-point kv and gate of one shape "
                         f"[B, T, H, C], C even when overlap=True; got kv {tuple(kv.shape)}, "
                         f"gate {tuple(gate.shape)}")
    if tuple(position_bias.shape) != (heads, rate, channels):
        raise ValueError(f"{OP}: position_bias has shape {tuple(position_bias.shape)}, expected "
                         f"[H, rate, C] = {[heads, rate, channels]}")
    _check_packed(cu_seqlens, batch)
    if _dsa_reference(backend):
        return compress_kv_reference(kv, gate, position_bias, rate=rate, overlap=overlap,
                                     cu_seqlens=cu_seqlens)
    entries = compressed_entries(seq_len, rate, cu_seqlens, kv.device)
    return compress_blocks(kv, gate, position_bias, entries, overlap)


def compressed_attention(q, k, v, compressed_k, compressed_v, *, rate, window, sink=None,
                         scale=None, cu_seqlens=None, backend="auto", layout_blocks=None):
    """HCA's attention (arXiv 2606.19348, sec. 2.3.2; see ``compressed_attention_reference``),
    also CSA's dense warm-up: one softmax per query over the last ``window`` tokens of its
    sequence and every compressed entry (``compressed_k``, ``compressed_v`` ``[B, N, Hkv, D]``
    from :func:`compress_kv` with this ``rate``) whose block is complete at the query. Sink,
    scale, packed sequences and backends as in :func:`softmax_attention`."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    _check_rate(rate, window)
    _check_packed(cu_seqlens, q.shape[0])
    seq_len = q.shape[1]
    if k.shape[1] != seq_len:
        raise ValueError(f"{OP}: compressed attention is self-attention; k has {k.shape[1]} "
                         f"tokens, q {seq_len}")
    entries = compressed_entries(seq_len, rate, cu_seqlens, q.device)
    _check_entries(compressed_k, compressed_v, k, len(entries), rate)
    name = _backend(backend, q)
    if name == "reference":
        return compressed_attention_reference(q, k, v, compressed_k, compressed_v, rate=rate,
                                              window=window, sink=sink, scale=scale,
                                              cu_seqlens=cu_seqlens)
    if len(entries) == 0:  # no complete block yet: the window alone
        return softmax_attention(q, k, v, window=(window - 1, 0), sink=sink, scale=scale,
                                 cu_seqlens=cu_seqlens, backend=name,
                                 layout_blocks=layout_blocks)
    blocks = _blocks(name, layout_blocks)
    if cu_seqlens is None:
        layout, padded = tiled_compressed_layout(seq_len, rate, window, *blocks, q.device)
    else:
        layout, padded = compressed_layout(entries, seq_len, window, *blocks)
    keys, values = with_entries(k, v, compressed_k, compressed_v, padded)
    return _EXECUTORS[name](q, keys, values, layout, sink=sink, scale=scale)


def csa_select(index_q, index_k, index_weights, *, rate, top_k, cu_seqlens=None,
               backend="auto"):
    """CSA's selection (arXiv 2606.19348, sec. 2.3.1; see ``csa_select_reference``): per query,
    the ``top_k`` compressed entries it sees with the highest lightning-indexer score
    ``sum_j w_tj relu(q_tj . k_i)``, k_i the indexer's own compressed keys. index_q
    ``[B, T, HI, DI]``, index_k ``[B, N, DI]``, index_weights ``[B, T, HI]`` ->
    ``[B, T, min(top_k, N)]`` int32 entry indices, in no particular order; a query that sees
    fewer entries gets all of them and -1 in its other slots (top_k is clamped, as DSA's is).
    No gradient."""
    _check_rate(rate)
    _check_packed(cu_seqlens, index_q.shape[0])
    seq_len = index_q.shape[1]
    entries = compressed_entries(seq_len, rate, cu_seqlens, index_q.device)
    _check_index(index_q, index_k, index_weights, seq_len, ("N", len(entries)))
    if top_k < 1:
        raise ValueError(f"{OP}: CSA's top_k={top_k} must be >= 1")
    if _dsa_reference(backend):
        return csa_select_reference(index_q, index_k, index_weights, rate=rate, top_k=top_k,
                                    cu_seqlens=cu_seqlens)
    return select_keys(index_q, index_k, index_weights, top_k=top_k, keys=entries.keys())


def csa_attention(q, k, v, compressed_k, compressed_v, selected, *, window, sink=None,
                  scale=None, cu_seqlens=None, backend="auto", rate=None, return_lse=False):
    """CSA's attention (arXiv 2606.19348, sec. 2.3.1; see ``csa_attention_reference``): one
    softmax per query over the last ``window`` tokens of its sequence and its ``selected
    [B, T, K]`` compressed entries (:func:`csa_select`; -1 skipped). Memory O(T (window + K)).

    ``rate``: the entries are one per complete block of ``rate`` tokens (N of them, as
    :func:`compress_kv` makes them); a listed entry not complete at its query is then dropped
    (:func:`csa_select` lists none), and the call may run on flash.py's
    ``compressed_selection_attention`` (the window on FlashAttention-2, the entries on cuDNN):
    "flash" (which raises ValueError with the reason where it cannot), and "auto" where it runs
    and both kernels have passed their first-use checks. Otherwise each query's keys are the
    window's raw tokens and its entries, run as :func:`dsa_attention` runs its selected keys
    (on the same backends).

    ``return_lse``: ``(o, lse)``, lse ``[B, T, Hq]`` fp32 the log-sum-exp of each query head's
    scaled scores over its selected entries and the sink (not the window), without gradient,
    where the backend that ran gives it (flash.py's), else None; :func:`csa_indexer_loss` takes
    it so as not to compute it again."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    _check_rate(rate, window)
    _check_packed(cu_seqlens, q.shape[0])
    _check_selected(selected, q)
    if rate is None:
        _check_entries(compressed_k, compressed_v, k)
    else:
        entries = compressed_entries(q.shape[1], rate, cu_seqlens, q.device)
        _check_entries(compressed_k, compressed_v, k, len(entries), rate)
        if len(entries):
            ends = entries.ends[selected.clamp(min=0, max=len(entries) - 1)]
            early = ends > torch.arange(q.shape[1], device=q.device)[None, :, None]
            selected = selected.masked_fill(early & (selected >= 0), -1)
        else:
            selected = torch.full_like(selected, -1)
    lse = None
    if _runs_compressed_selection(backend, q, k, v, rate):
        out, lse = flash.compressed_selection_attention(
            q, k, v, compressed_k, compressed_v, selected, window=window, rate=rate, sink=sink,
            scale=scale, cu_seqlens=cu_seqlens, return_lse=True)
    elif _dsa_reference(backend):
        out = csa_attention_reference(q, k, v, compressed_k, compressed_v, selected,
                                      window=window, sink=sink, scale=scale,
                                      cu_seqlens=cu_seqlens)
    else:
        chosen = window_and_selected(selected, first_tokens(q.shape[1], cu_seqlens, q.device),
                                     window)
        out = _selected_attention(backend, q, *with_entries(k, v, compressed_k, compressed_v),
                                  chosen, sink, scale)
    return (out, lse) if return_lse else out


def _runs_compressed_selection(backend: str, q, k, v, rate) -> bool:
    """Whether csa_attention runs on flash.py's ``compressed_selection_attention``: asked for
    ("flash", which raises ValueError with the reason where it cannot), or under "auto" where
    it can and FlashAttention-2 and cuDNN have passed their first-use checks on this device
    and dtype."""
    if backend not in ("flash", "auto"):
        return False
    reason = flash.causal_selection_unavailable_reason(q, k, v)
    if reason is None and rate is None:
        reason = "it needs the entries' compression rate (rate=)"
    if backend == "flash":
        if reason is not None:
            raise ValueError(f"{OP}: backend='flash' cannot run this csa_attention: {reason}")
        return True
    return (reason is None and flash.checked(q.device, q.dtype)
            and flash.cudnn_checked(q.device, q.dtype))


def csa_indexer_loss(q, compressed_k, index_q, index_k, index_weights, *, rate, selected=None,
                     cu_seqlens=None, sink=None, scale=None, reduce_heads=None, shares=None,
                     backend="auto", lse=None):
    """CSA's indexer loss (see ``csa_indexer_loss_reference``): :func:`dsa_indexer_loss` over
    compressed entries, averaged over the B * T queries (a query that sees no entry adds 0).
    The target is the main attention of q over the entries' keys ``compressed_k``: over every
    entry a query sees (``selected=None``, dense warm-up) or over its selected ones.
    ``reduce_heads``, ``shares`` and ``lse`` (:func:`csa_attention`'s, for this q,
    compressed_k, ``selected``, sink and scale) as in :func:`dsa_indexer_loss`."""
    check_qkv(OP, q, compressed_k, compressed_k)
    _check_sink(sink, q)
    _check_rate(rate)
    _check_packed(cu_seqlens, q.shape[0])
    seq_len = q.shape[1]
    _check_shares(shares, seq_len)
    entries = compressed_entries(seq_len, rate, cu_seqlens, q.device)
    _check_index(index_q, index_k, index_weights, seq_len, ("N", len(entries)), shares)
    if compressed_k.shape[1] != len(entries):
        raise ValueError(f"{OP}: compressed_k has {compressed_k.shape[1]} entries, expected "
                         f"N = {len(entries)} (one per complete block of rate={rate} tokens)")
    options = dict(selected=selected, sink=sink, scale=scale, reduce_heads=reduce_heads)
    if _dsa_reference(backend):
        if shares is not None:
            if selected is None:
                allowed = compressed_visibility(seq_len, rate, cu_seqlens, q.device)[None]
            else:
                allowed = selected_mask(selected, compressed_k.shape[1])
            return _reference_share(q, compressed_k, index_q, index_k, index_weights, allowed,
                                    sink, scale, reduce_heads, shares)
        return csa_indexer_loss_reference(q, compressed_k, index_q, index_k, index_weights,
                                          rate=rate, cu_seqlens=cu_seqlens, **options)
    if len(entries) == 0:  # no entry for any query
        return q.new_zeros((), dtype=torch.float32)
    return indexer_loss(q, compressed_k, index_q, index_k, index_weights, keys=entries.keys(),
                        shares=shares, kernels=_loss_kernels(backend, q, compressed_k, selected,
                                                             index_q, index_k),
                        lse=lse, **options)
