"""A :class:`~.layout.BlockLayout` run by PyTorch FlexAttention (Dong et al., "Flex Attention: A
Programming Model for Generating Optimized Attention Kernels", 2024): the layout becomes a
``BlockMask`` (the visited key blocks per query block) with the layout's token rule as its
``mask_mod``; the sink rescales the output by the log-sum-exp,
``o * sigmoid(lse - sink) = o * sum exp / (sum exp + exp sink)``, which FlexAttention
differentiates.

On CUDA the kernel is compiled once per shape and token rule (``torch.compile``), and so is
the sink's rescaling (one fused kernel each way). A layout keeps the BlockMasks made from it, so
a layout that is itself kept (HCA's, for sequences that are not packed) costs its host work
once. On the CPU,
torch 2.11's FlexAttention runs forward only and unfused: it evaluates the token rule on every
(query, key) pair and ignores the block sparsity, and it refuses inputs that require grad; so
"auto" picks the gathered executor there, and this backend serves CPU inference and tests of
the rule.
"""
import logging
from typing import Callable

import torch

from .layout import BlockLayout
from .reference import OP

__all__ = ["flex_attention_layout", "block_mask", "compiled_on_cuda"]

_log = logging.getLogger(__name__)
_compiled = None


def compiled_on_cuda(fn: Callable, what: str) -> Callable:
    """``fn`` through ``torch.compile`` (static shapes) for CUDA tensors, eager for others; a
    compiler failure is logged once (naming ``what``) and the eager ``fn``, which computes the
    same, runs from then on. The first tensor argument decides the device.

    Inductor's comprehensive padding (strides padded for alignment) is off: with it, torch 2.11
    gives a wrong gradient through the sink's rescaling into FlexAttention's backward on an H200
    (at T = 300 in fp32, q's gradient off by 0.46; right without padding, and at T = 1000 either
    way), and turning it off costs no measured speed."""
    state = {}

    def call(*args):
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.type == "cuda" and not state.get("failed"):
            if "compiled" not in state:
                state["compiled"] = torch.compile(fn, dynamic=False,
                                                  options={"comprehensive_padding": False})
            try:
                return state["compiled"](*args)
            except torch.OutOfMemoryError:
                raise
            except Exception as error:
                state["failed"] = True
                _log.warning("torch.compile of %s failed (%s: %s); it runs in eager PyTorch from "
                             "now on", what, type(error).__name__, error)
        return fn(*args)

    return call


def _rescale_by_sink(out, lse, sink):
    """``o * sigmoid(lse - sink) = o * sum exp / (sum exp + exp sink)``, per query head; a query
    with no key has o = 0 and lse = -inf, which any finite lse keeps 0 (and avoids NaN out of
    -inf - sink, for a sink of -inf)."""
    lse = lse.masked_fill(lse == float("-inf"), 0.0)
    keep = torch.sigmoid(lse - sink.float().view(1, -1, 1))
    return (out.float() * keep.unsqueeze(-1)).to(out.dtype)


_rescale_by_sink_body = compiled_on_cuda(_rescale_by_sink, "the sink's rescaling")


def _flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


def _compiled_flex_attention():
    global _compiled
    if _compiled is None:
        # One compiled variant per token rule and shape: a hybrid with window, MoBA and NSA
        # layers (NSA alone has three rules) passes Dynamo's default of 8 recompiles, after which
        # it would fall back to the unfused eager kernel.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled = torch.compile(_flex_attention(), dynamic=False)
    return _compiled


def block_mask(layout: BlockLayout, heads: int, seq_len: int, key_len: int):
    """The layout as a FlexAttention BlockMask over ``heads`` query heads, kept in the layout
    (``block_masks``)."""
    key = (heads, seq_len, key_len)
    if key not in layout.block_masks:
        with torch.inference_mode(False):  # a kept mask must serve training after inference
            layout.block_masks[key] = _block_mask(layout, heads, seq_len, key_len)
    return layout.block_masks[key]


def _block_mask(layout: BlockLayout, heads: int, seq_len: int, key_len: int):
    from torch.nn.attention.flex_attention import BlockMask

    active = layout.active
    if active.shape[1] not in (1, heads):  # one layout per key/value group -> per query head
        active = active.repeat_interleave(heads // active.shape[1], dim=1)
    counts, order = layout.kv_blocks(active)
    return BlockMask.from_kv_blocks(counts, order, BLOCK_SIZE=(layout.q_block, layout.kv_block),
                                    mask_mod=layout.mask_mod, seq_lengths=(seq_len, key_len))


def _repeat_heads(t, group: int):
    """``[B, S, Hkv, D]`` -> ``[B, S, Hkv * group, D]``, each head repeated ``group`` times in a
    row (its query heads); the backward sums each group back."""
    return t.repeat_interleave(group, dim=2)


def _forget_score_mod(log_forget: torch.Tensor):
    """FlexAttention's ``score_mod`` adding the Forgetting Transformer's bias ``c_i - c_j``
    (``c = cumsum(log f)`` per query head, fp32 ``[B, Hq, T]``). The query's and the key's
    terms index two copies of ``c``: FlexAttention's backward takes a captured tensor that
    needs gradients indexed once only."""
    c_query = log_forget.float().cumsum(1).transpose(1, 2).contiguous()
    c_key = c_query.clone()

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + (c_query[b, h, q_idx] - c_key[b, h, kv_idx])

    return score_mod


def flex_attention_layout(q, k, v, layout: BlockLayout, *, sink=None, scale=None,
                          kernel_options=None, log_forget=None):
    """Same contract as ``gathered_attention``; ``kernel_options`` go to FlexAttention on CUDA;
    ``log_forget [B, T, Hq]``: forget gates (``softmax_attention``'s). Grouped key/value heads
    run natively (``enable_gqa``), or repeated per query head for layouts with
    ``dense_columns``."""
    from torch.nn.attention.flex_attention import AuxRequest

    heads, kv_heads = q.shape[2], k.shape[2]
    if q.device.type == "cpu":
        if torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (q, k, v, sink, log_forget)):
            raise RuntimeError(
                f"{OP}: backend 'flex' cannot run: FlexAttention has no backward on the CPU in "
                f"torch {torch.__version__}; use backend='gathered'")
        q, k, v = q.detach(), k.detach(), v.detach()  # it refuses any input that requires grad
        log_forget = None if log_forget is None else log_forget.detach()
    options = {}
    if q.device.type == "cuda":
        run = _compiled_flex_attention()
        if kernel_options:
            options["kernel_options"] = kernel_options
    else:
        run = _flex_attention()
    if kv_heads != heads and layout.dense_columns:
        # FlexAttention's backward runs one program per key block and key/value head, which
        # loops over the query blocks that visit it and, with grouped heads, over the group:
        # the few dense key blocks then take group times longer than the rest. Repeating the
        # heads spreads them over group times as many programs; layouts without dense columns
        # (causal, windows) gain nothing from it and are not repeated
        # (``benchmarks/sparse_attention.py --kv-heads 1``).
        k, v = (_repeat_heads(t, heads // kv_heads) for t in (k, v))
    if log_forget is not None:
        options["score_mod"] = _forget_score_mod(log_forget)
    out, aux = run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                   block_mask=block_mask(layout, heads, q.shape[1], k.shape[1]), scale=scale,
                   enable_gqa=heads != k.shape[2], return_aux=AuxRequest(lse=True), **options)
    if sink is not None:
        out = _rescale_by_sink_body(out, aux.lse, sink)
    return out.transpose(1, 2).to(v.dtype)
