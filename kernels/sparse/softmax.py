"""Softmax attention with a sliding window and a sink (``softmax_attention``), and its
declaration in the backend registry: "auto" prefers flash (on CUDA, where flash.py takes the
call and has passed its first-use check), then flex (on CUDA), then gathered, then the reference
(forget gates, which neither flash nor gathered takes, off CUDA)."""
from .. import registry
from . import flash
from .layout import allowed_rule, both, document_rule, interval_layout, window_rule, window_span
from .reference import OP, check_qkv, softmax_attention_reference
from .routing import _EXECUTORS, _blocks, _check_sink, attention_facts, layout_backends, unless

NAME = "softmax_attention"


def _facts(q, k, v, *, allowed=None, log_forget=None, **_options):
    return attention_facts(q, k, v, allowed=allowed is not None, log_forget=log_forget is not None)


registry.declare(registry.Op(
    NAME,
    backends=layout_backends(
        softmax_attention_reference, flash.flash_attention,
        flash_unsupported=unless("log_forget", "forget gates (flash.py does not take them)"),
        gathered_unsupported=unless("log_forget", "forget gates: use 'flex' (CUDA) or 'reference'")),
    auto=("flash", "flex", "gathered", "reference"),
    facts=_facts,
))


def softmax_attention(q, k, v, *, causal=True, window=None, sink=None, scale=None,
                      cu_seqlens=None, allowed=None, backend="auto", layout_blocks=None,
                      log_forget=None):
    """Softmax attention, optionally causal, with an optional sliding window ``(left, right)``
    (Megatron's convention: query t sees keys t - left .. t + right, -1 unbounded), learnable
    sink ``[Hq]`` (``exp(sink_h)`` added to the softmax denominator), packed sequences
    (``cu_seqlens [N + 1]``, B == 1) and extra bool mask ``allowed`` ``[B | 1, Hq | 1, T, S]``
    (True = may attend). q ``[B, T, Hq, D]``, k, v ``[B, S, Hkv, D]`` -> ``[B, T, Hq, D]``.
    Backends as the package's (``__init__``), plus "flash" (flash.py); a backend named that
    cannot take the call raises ``registry.BackendUnavailable`` (a ValueError) with the reason.

    ``log_forget [B, T, Hq]`` (<= 0, causal self-attention): the Forgetting Transformer (Lin et
    al. 2025), each logit biased by the log forget gates between key and query
    (:func:`~.reference.forget_bias`); it runs on "flex" (a ``score_mod`` adding ``c_i - c_j``,
    differentiated by FlexAttention) or the reference ("auto": flex on CUDA, the reference
    elsewhere; flash and gathered do not take it)."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    if log_forget is not None:
        _check_forget(log_forget, q, k, causal)
    name = registry.choose(NAME, backend, _facts(q, k, v, allowed=allowed, log_forget=log_forget))
    if name == "flash":
        return flash.flash_attention(q, k, v, causal=causal, window=window, sink=sink,
                                     scale=scale, cu_seqlens=cu_seqlens)
    if name == "reference":
        return softmax_attention_reference(q, k, v, causal=causal, window=window, sink=sink,
                                           scale=scale, cu_seqlens=cu_seqlens, allowed=allowed,
                                           log_forget=log_forget)
    seq_len, key_len = q.shape[1], k.shape[1]
    rule = window_rule(causal, window)
    if cu_seqlens is not None:
        rule = both(rule, document_rule(cu_seqlens, seq_len))
    if allowed is not None:
        rule = both(rule, allowed_rule(allowed.expand(q.shape[0], -1, seq_len, key_len)))
    layout = interval_layout(seq_len, key_len, *_blocks(name, layout_blocks),
                             *window_span(causal, window), rule, q.device)
    forget = {} if log_forget is None else {"log_forget": log_forget}  # flex's only (above)
    return _EXECUTORS[name](q, k, v, layout, sink=sink, scale=scale, **forget)


def _check_forget(log_forget, q, k, causal):
    if not causal or q.shape[1] != k.shape[1]:
        raise ValueError(f"{OP}: forget gates (log_forget) need causal self-attention (T == S); "
                         f"got causal={causal}, T={q.shape[1]}, S={k.shape[1]}")
    if tuple(log_forget.shape) != tuple(q.shape[:3]):
        raise ValueError(f"{OP}: log_forget has shape {tuple(log_forget.shape)}, expected "
                         f"[B, T, Hq] = {list(q.shape[:3])}")
