"""MoBA (``moba_attention``): each query's own key block and its top-k earlier blocks; declared
in the backend registry: "auto" prefers flash (on CUDA, without a window, where flash.py takes
the call and has passed its first-use check), then flex (on CUDA), then gathered."""
import math

from .. import registry
from . import flash
from .layout import (allowed_rule, both, interval_layout, moba_chosen, selection_layout,
                     window_rule, window_span)
from .reference import OP, check_qkv, moba_attention_reference
from .routing import _EXECUTORS, _blocks, _check_sink, _check_top_k, attention_facts, layout_backends, unless

NAME = "moba_attention"


def _facts(q, k, v, *, window=None, allowed=None, **_options):
    return attention_facts(q, k, v, window=window is not None, allowed=allowed is not None)


registry.declare(registry.Op(
    NAME,
    backends=layout_backends(moba_attention_reference, flash.moba_attention,
                             flash_unsupported=unless("window", "a sliding window (flash.py does not take it)")),
    auto=("flash", "flex", "gathered"),
    facts=_facts,
))


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
    name = registry.choose(NAME, backend, _facts(q, k, v, window=window, allowed=allowed))
    if name == "flash":
        return flash.moba_attention(q, k, v, block_size=block_size, top_k=top_k, sink=sink,
                                    scale=scale)
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
# Flash and the block layout (FlexAttention) are about even at T = 4096, and flash is the faster
# beyond (benchmarks/sparse_attention.py). Flash's peak memory is several times the layout's:
# its call over the chosen blocks holds each query's row once per block.
