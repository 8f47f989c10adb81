"""Softmax attention with a sliding window and a sink (``softmax_attention``)."""
from . import flash
from .layout import allowed_rule, both, document_rule, interval_layout, window_rule, window_span
from .reference import OP, check_qkv, softmax_attention_reference
from .routing import _EXECUTORS, _backend, _blocks, _check_sink, _runs_flash


def softmax_attention(q, k, v, *, causal=True, window=None, sink=None, scale=None,
                      cu_seqlens=None, allowed=None, backend="auto", layout_blocks=None):
    """Softmax attention, optionally causal, with an optional sliding window ``(left, right)``
    (Megatron's convention: query t sees keys t - left .. t + right, -1 unbounded), learnable
    sink ``[Hq]`` (``exp(sink_h)`` added to the softmax denominator), packed sequences
    (``cu_seqlens [N + 1]``, B == 1) and extra bool mask ``allowed`` ``[B | 1, Hq | 1, T, S]``
    (True = may attend). q ``[B, T, Hq, D]``, k, v ``[B, S, Hkv, D]`` -> ``[B, T, Hq, D]``.
    Backends as the package's (``__init__``), plus "flash" (flash.py)."""
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
