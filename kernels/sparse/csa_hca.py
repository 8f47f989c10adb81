"""DeepSeek-V4's compressed attentions: ``compress_kv``, HCA's ``compressed_attention`` and CSA's
``csa_select``, ``csa_attention``, ``csa_indexer_loss``."""
import torch

from .. import registry
from . import flash
from .compressed import (compress_blocks, compressed_entries, compressed_layout, first_tokens,
                         tiled_compressed_layout, window_and_selected, with_entries)
from .dsa import (SELECTED_AUTO, _check_index, _check_selected, _check_shares, _loss_kernels,
                  _reference_share, _runs_reference, _selected_attention, declare_indexer_loss,
                  declare_per_token, selected_backends)
from .reference import (OP, check_qkv, compress_kv_reference, compressed_attention_reference,
                        compressed_visibility, csa_attention_reference,
                        csa_indexer_loss_reference, csa_select_reference, selected_mask)
from .routing import (_EXECUTORS, _blocks, _check_sink, attention_facts, flash_and_cudnn_verified,
                      layout_backends)
from .selected import indexer_loss, select_keys
from .softmax import softmax_attention


def _csa_facts(q, k, v, compressed_k, *_args, rate=None, **_options) -> registry.Facts:
    """csa_attention's facts: its flash path's over the raw keys, its selected attention's over
    the raw keys followed by the entries (``selected_keys``, ``selected_key_elements``)."""
    keys = k.shape[1] + compressed_k.shape[1]
    return attention_facts(q, k, v, rate=rate, selected_keys=keys,
                           selected_key_elements=keys * k.shape[2] * k.shape[3])


registry.declare(registry.Op(
    "compressed_attention", backends=layout_backends(compressed_attention_reference),
    auto=("flex", "gathered"), facts=lambda q, k, v, *args, **options: attention_facts(q, k, v)))
registry.declare(registry.Op(
    "csa_attention",
    backends=selected_backends(
        csa_attention_reference, flash.compressed_selection_attention,
        lambda facts: ("it needs the entries' compression rate (rate=)"
                       if facts.extra.get("rate", 0) is None else None),
        flash_and_cudnn_verified),
    auto=SELECTED_AUTO,
    facts=_csa_facts,
))
declare_indexer_loss("csa_indexer_loss", csa_indexer_loss_reference)
declare_per_token("csa_select", csa_select_reference, select_keys)
declare_per_token("compress_kv", compress_kv_reference, compress_blocks)


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
    if _runs_reference("compress_kv", backend):
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
    name = registry.choose("compressed_attention", backend, attention_facts(q, k, v))
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
    if _runs_reference("csa_select", backend):
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
    name = registry.choose("csa_attention", backend, _csa_facts(q, k, v, compressed_k, rate=rate))
    if name == "flash":
        out, lse = flash.compressed_selection_attention(
            q, k, v, compressed_k, compressed_v, selected, window=window, rate=rate, sink=sink,
            scale=scale, cu_seqlens=cu_seqlens, return_lse=True)
    elif name == "reference":
        out = csa_attention_reference(q, k, v, compressed_k, compressed_v, selected,
                                      window=window, sink=sink, scale=scale,
                                      cu_seqlens=cu_seqlens)
    else:
        chosen = window_and_selected(selected, first_tokens(q.shape[1], cu_seqlens, q.device),
                                     window)
        out = _selected_attention(name, q, *with_entries(k, v, compressed_k, compressed_v),
                                  chosen, sink, scale)
    return (out, lse) if return_lse else out


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
    if _runs_reference("csa_indexer_loss", backend):
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
                        shares=shares, kernels=_loss_kernels("csa_indexer_loss", backend, q,
                                                             compressed_k, selected, index_q, index_k),
                        lse=lse, **options)
