"""Softmax attention with a sliding window and a learnable sink, and attention over chosen
blocks of keys (MoBA, NSA's selected branch), on torch's FlashAttention-2 kernels:
``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``, called in their
packed ("varlen") form, as ``torch.nn.attention.varlen`` calls them.

They cover what a window or a sink needs and SDPA cannot pass them: a causal and/or sliding
window ``(left, right)`` (FlashAttention's ``window_size``, the same convention as ours), packed
sequences (``cu_seqlens``; a batch is packed as B sequences of T tokens), grouped heads, on CUDA
GPUs of compute capability 8.0 or more, with fp16 or bf16 q, k, v of one head dim (a multiple
of 8, at most 256) and keys as long as the queries. No extra mask: calls with ``allowed`` go
to FlexAttention (the ops' declarations in the backend registry decide; their rule,
``routing.flash_refusal``, says why).

The sink. The kernels return each query's log-sum-exp ``L`` of its scaled scores (natural
log). A sink ``s_h`` adds ``exp(s_h)`` to the softmax denominator, so with
``L' = logaddexp(L, s_h)`` the output is ``o' = o * exp(L - L')``. The backward kernel
recomputes each row's probabilities as ``exp(score - L)`` and uses ``D = rowsum(dO * O)``;
given ``L'`` and ``o'`` instead, those are the sink softmax's own probabilities ``p'`` and its
``D``, and the kernel's ``dS = p' * (dO . v - D)`` is that softmax's exact gradient (the sink
is one more column, with a zero value vector). The sink's own gradient is
``d s_h = -sum over the rows of head h of exp(s_h - L') * D``.

The same identity splits one softmax over disjoint sets of keys: run each set as its own
attention, merge the outputs with weights ``exp(L_i - L)`` where ``L`` is the log-sum-exp over
all sets (and the sink), and in the backward give each set's kernel the merged output and ``L``.
:func:`block_selection_attention` does so for attention over chosen blocks of keys, causal
inside the query's own block: every block attends to itself causally (one packed call, all
heads; where every block is full, one call of cuDNN's fused attention instead, torch's SDPA
backend, on the blocks as a batch: faster there on Hopper), and every (batch, key/value head,
chosen earlier block) is one packed sequence of the (query, selection head) rows that chose it
against that block's keys (one call; with grouped heads the selection heads of a group share
their key/value head's sequence, so no key is copied per selection head). From blocks of
``CUDNN_MIN_EARLIER_BLOCK`` keys that call runs on cuDNN too, its sequences cut into chunks of
``CUDNN_CHUNK`` rows, each chunk with its block's keys gathered: a batch of equal dense
attentions, which cuDNN runs faster than FlashAttention-2 runs the packed call. MoBA (Lu et
al., "MoBA: Mixture of Block Attention for Long-Context LLMs", 2025, whose own implementation
also splits the own block from the selected ones) chooses per query head; NSA's selected
branch (Yuan et al., "Native Sparse Attention", 2025) per key/value head, so that each row of
that call carries the query heads of a group. The work is then that of the chosen blocks,
where a block mask over 128-query tiles covers the union of what every query of the tile
chose. NSA's sliding-window branch is :func:`flash_attention`; its compressed branch keeps the
block layout. Where Triton runs (CUDA), the merge of the two calls' outputs, the sum of their
query gradients, the gathers of the pairs' rows (and of the chunks' keys) and the sum of the
chunks' key and value gradients run in Triton kernels (triton_merge.py), each reading its
inputs once; elsewhere in PyTorch.

The kernels run only after a first-use check per device and dtype (:func:`check`, run once by
:func:`checked`, the verifier of the sparse ops' flash backends in the backend registry;
``megatron-ext doctor`` shows its errors): small calls (a window, a sink,
grouped heads, packed sequences; MoBA with a partial last block; blocks chosen per key/value
head), forward and backward, against the fp32 reference; a failure is logged once and "auto"
keeps FlexAttention. cuDNN's calls have a check of their own (:func:`check_cudnn`, MoBA with
full blocks, DSA's and CSA's attention, run once by :func:`cudnn_checked`): where it fails,
FlashAttention-2 runs every block and the rest of the path stays, and DSA's and CSA's
attention keep their other backends.

DSA's attention over keys chosen per query (:func:`causal_selection_attention`, each key at
or before its query) is one cuDNN call, causal, with the selection as an additive bias; the
sink and a query that chose no key are handled through the log-sum-exp as above.

CSA's attention (:func:`compressed_selection_attention`, DeepSeek-V4's window of raw tokens
plus the compressed entries each query selected) is the same identity over two disjoint key
sets: the window in one FlashAttention-2 call (causal, ``window_size`` = window - 1), the
entries on cuDNN with the selection as a bias, in chunks of ``CSA_QUERY_CHUNK`` queries each
against only the entries its last query can see (an entry is complete once its block of
``rate`` tokens is), merged with the sink through their log-sum-exps.
``benchmarks/sparse_attention.py --ops csa/flash,csa/flex`` compares it with FlexAttention over
the window and entries' bitmap.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from ..first_use import passes_first_use_check, relative_error
from .layout import moba_chosen
from .reference import (OP, csa_attention_reference, dsa_attention_reference,
                        moba_attention_reference, softmax_attention_reference)

__all__ = ["flash_attention", "block_selection_attention", "moba_attention",
           "causal_selection_attention", "compressed_selection_attention", "check", "checked",
           "check_cudnn", "cudnn_checked"]

_log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
# Relative error (Frobenius norm) the first-use check allows on the output and each gradient:
# bf16 rounding of q, k, v, o and the kernels' P gives a few 1e-3. At the check's packed call,
# measured with the reference: a window one token off gives 0.15 to 0.19, a scale 10% off 0.08
# to 0.14 (output and gradients).
CHECK_TOLERANCE = 2e-2


def _kernel_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, left, right, scale):
    """FlashAttention-2 forward on packed ``[total, H, D]`` inputs: ``(o, lse [H, total_q])``."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale,
        window_size_left=left, window_size_right=right)
    if lse.shape != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"{OP}: FlashAttention returned a log-sum-exp of shape "
                           f"{tuple(lse.shape)}, expected [H, total] = {[q.shape[1], q.shape[0]]}")
    return out, lse


def _kernel_backward(d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, left, right,
                     scale):
    """FlashAttention-2 backward: ``(dq, dk, dv)`` from the output and log-sum-exp given."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, rng_state, unused,
        scale=scale, window_size_left=left, window_size_right=right)


# cuDNN's fused attention (torch's SDPA backend) takes the own blocks of a block selection where
# every block is full (they are then a batch of equal causal sequences), where it outruns
# FlashAttention-2 on Hopper (``benchmarks/sparse_attention.py --ops moba/flash,nsa/flash``
# measures both). cuDNN's SDPA backward on Hopper takes head dims up to 128.
CUDNN_MAX_HEAD_DIM = 128
# The earlier blocks' call runs on cuDNN too, as a batch of chunks: CUDNN_CHUNK pair rows of one
# (batch, key/value head, block) sequence against that block's keys, gathered per chunk
# (:class:`_SelectionPlan`), from blocks of CUDNN_MIN_EARLIER_BLOCK keys: MoBA's blocks (512)
# gain from it, NSA's selected blocks of 64 would lose, hence the
# minimum block (``benchmarks/sparse_attention.py --ops moba/flash,nsa/flash``). It costs memory
# while it runs, the chunks' gathered keys and values and the padded slots, still flat in T at a
# fixed B T (benchmarks/results/sparse_attention_h200.json has the peaks).
CUDNN_CHUNK = 512
CUDNN_MIN_EARLIER_BLOCK = 128


def _on_cudnn(q: torch.Tensor) -> bool:
    """Whether cuDNN's fused attention can take q's device and head dim (its rule in the
    backend registry, ``routing.cudnn_refusal``)."""
    from ..registry import Facts
    from .routing import cudnn_refusal

    return cudnn_refusal(Facts(device=q.device, dtype=q.dtype, key_dim=q.shape[-1])) is None


def _own_blocks_on_cudnn(q: torch.Tensor, block_len: int) -> bool:
    """Whether a block selection's own blocks of ``block_len`` run on cuDNN where it runs (see
    above): every block full."""
    return q.shape[1] % block_len == 0


def _earlier_blocks_on_cudnn(q: torch.Tensor, block_len: int) -> bool:
    """Whether a block selection's earlier blocks of ``block_len`` run on cuDNN where it runs
    (see above)."""
    return block_len >= CUDNN_MIN_EARLIER_BLOCK


def _cudnn_forward(q, k, v, scale, causal=True, bias=None):
    """cuDNN's attention forward on ``[N, H, L, D]`` (views of any strides; k, v may have
    fewer heads and another length; ``bias`` an additive ``[N, 1, L, S]`` or None):
    ``(o, lse, state)``, ``lse`` ``[N, H, L]`` fp32 natural log, ``state`` the rest its
    backward takes."""
    out, lse, *state, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, 0.0, causal, False, scale=scale)
    return out, lse.reshape(q.shape[:3]), (lse.shape, *state)


def _cudnn_backward(d_out, q, k, v, out, lse, state, scale, causal=True, bias=None):
    """cuDNN's backward, ``(dq, dk, dv)``, from the output and ``lse [N, H, L]`` given (d_out
    of out's strides; ``bias`` the forward's)."""
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        d_out, q, k, v, out, lse.reshape(lse_shape), seed, offset, bias, cum_q, cum_k, max_q,
        max_k, 0.0, causal, scale=scale)


def _as_blocks(rows: torch.Tensor, block_len: int) -> torch.Tensor:
    """Rows ``[B * T, H, D]`` (contiguous) as the blocks ``[B * T / block_len, H, block_len, D]``
    (a view)."""
    return rows.view(-1, block_len, *rows.shape[1:]).transpose(1, 2)


def _own_blocks_cudnn_forward(q_rows, k_rows, v_rows, block_len, scale):
    """Each block of ``block_len`` rows attending to itself causally, on cuDNN: ``(o [B * T, H,
    D], lse [H, B * T] as FlashAttention's, the state for the backward)``."""
    out, lse, state = _cudnn_forward(*(_as_blocks(x, block_len) for x in (q_rows, k_rows, v_rows)),
                                     scale)
    heads = q_rows.shape[1]
    out = out.transpose(1, 2).reshape(q_rows.shape)
    return out, lse.transpose(0, 1).reshape(heads, -1), state


def _own_blocks_cudnn_backward(d_out, q_rows, k_rows, v_rows, out, full_lse, block_len, scale,
                               state):
    """The own blocks' ``(dq, dk, dv)`` as rows, from the merged output ``[B * T, H, D]`` and
    log-sum-exp ``full_lse [B * T, H]`` (the module docstring's identity)."""
    blocks = [_as_blocks(x.contiguous(), block_len) for x in (d_out, q_rows, k_rows, v_rows, out)]
    lse = full_lse.view(-1, block_len, q_rows.shape[1]).permute(0, 2, 1).contiguous()
    grads = _cudnn_backward(*blocks, lse, state, scale)
    return [g.transpose(1, 2).reshape(x.shape) for g, x in zip(grads, (q_rows, k_rows, v_rows))]


def _as_chunks(slots: torch.Tensor, chunks: int) -> torch.Tensor:
    """The earlier blocks' slots ``[chunks * C, G, D]`` (contiguous) as ``[chunks, G, C, D]``
    (a view)."""
    return slots.view(chunks, -1, *slots.shape[1:]).transpose(1, 2)


def _chunk_keys(k_rows, v_rows, key_rows, chunks: int, block_len: int):
    """The keys and values of each chunk's block, ``[chunks, 1, block_len, D]`` each, gathered
    from the token-major rows ``[B * T, Hkv, D]``."""
    dim = k_rows.shape[-1]
    gathered = _merge_kernels().gather_rows([k_rows.view(-1, 1, dim), v_rows.view(-1, 1, dim)],
                                            key_rows)
    return [x.view(chunks, block_len, 1, dim).transpose(1, 2) for x in gathered]


def _chunks_forward(q_slots, k_rows, v_rows, plan, scale):
    """The earlier blocks on cuDNN (:class:`_SelectionPlan`'s chunks): each chunk's slots of
    ``q_slots [chunks * C, G, D]`` attend to all of its block's keys. ``(o [chunks * C, G, D],
    lse [G, chunks * C] as FlashAttention's, the state for the backward)``."""
    k, v = _chunk_keys(k_rows, v_rows, plan.key_rows, plan.chunks, plan.block_len)
    out, lse, state = _cudnn_forward(_as_chunks(q_slots, plan.chunks), k, v, scale, causal=False)
    group = q_slots.shape[1]
    return (out.transpose(1, 2).reshape(q_slots.shape), lse.permute(1, 0, 2).reshape(group, -1),
            state)


def _chunks_backward(d_slots, q_slots, k_rows, v_rows, out_slots, lse_slots, dk_own, dv_own,
                     chunk_cu, key_rows, sizes, scale, state):
    """The earlier blocks' backward on cuDNN from the merged output and log-sum-exp of the slots
    (``lse_slots [chunks * C, G]``): ``(dq [chunks * C, G, D], dk, dv)``, dk and dv ``dk_own``
    and ``dv_own`` (``[B, T, Hkv, D]``) plus each block's chunks' shares."""
    block_len, chunk, chunks = sizes
    k, v = _chunk_keys(k_rows, v_rows, key_rows, chunks, block_len)
    lse = lse_slots.view(chunks, chunk, -1).permute(0, 2, 1).contiguous()
    dq, dk, dv = _cudnn_backward(_as_chunks(d_slots, chunks), _as_chunks(q_slots, chunks), k, v,
                                 _as_chunks(out_slots, chunks), lse, state, scale, causal=False)
    add = _merge_kernels().add_block_gradients
    return (dq.transpose(1, 2).reshape(q_slots.shape),
            add(dk_own, dk.reshape(chunks, block_len, -1), chunk_cu, block_len),
            add(dv_own, dv.reshape(chunks, block_len, -1), chunk_cu, block_len))


def _sink_gradient(sink, d_out, out, lse_rows):
    """``d s_h = -sum exp(s_h - L') * rowsum(dO * o')`` over the rows ``[rows, H, D]`` of head h
    (``lse_rows [rows, H]``, the log-sum-exp with the sink)."""
    wide = torch.promote_types(out.dtype, torch.float32)
    delta = (d_out.to(wide) * out.to(wide)).sum(-1)
    return -(torch.exp(sink.float() - lse_rows) * delta).sum(0).to(sink.dtype)


class _FlashAttention(torch.autograd.Function):
    """Packed ``[total, H, D]`` q, k, v (and an fp32 sink ``[Hq]`` or None) -> o; see the
    module docstring for the sink."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens, max_len, causal, left, right, scale):
        options = (cu_seqlens, cu_seqlens, max_len, max_len, causal, left, right, scale)
        out, lse = _kernel_forward(q, k, v, *options)
        if sink is not None:
            with_sink = torch.logaddexp(lse, sink.float()[:, None])
            wide = torch.promote_types(out.dtype, torch.float32)
            out = (out.to(wide) * torch.exp(lse - with_sink).t()[..., None]).to(out.dtype)
            lse = with_sink
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, sink = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq, dk, dv = _kernel_backward(d_out, q, k, v, out, lse, *ctx.options)
        d_sink = None
        if sink is not None and ctx.needs_input_grad[3]:
            d_sink = _sink_gradient(sink, d_out, out, lse.t())
        return dq, dk, dv, d_sink, None, None, None, None, None, None


def flash_attention(q, k, v, *, causal=True, window=None, sink=None, scale=None,
                    cu_seqlens=None):
    """``softmax_attention`` (same arguments, no ``allowed``) on the FlashAttention kernels.
    Call only where ``routing.flash_refusal`` allows."""
    batch, seq_len, heads, dim = q.shape
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32,
                                  device=q.device)
        max_len = seq_len
    else:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    packed = [x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v)]
    out = _FlashAttention.apply(*packed, sink, cu_seqlens, max_len, causal, left, right, scale)
    return out.view(batch, seq_len, heads, dim)


@dataclasses.dataclass
class _SelectionPlan:
    """Where the two kernel calls of a block selection read and write (module docstring).

    ``chosen [B, Hs, T, n]`` picks blocks per query and selection head; each selection head
    serves ``Hq / Hs`` query heads (MoBA: one; NSA: a key/value group), and each key/value head
    ``Hs / Hkv`` selection heads. Own blocks: ``own_cu`` cuts the B * T tokens into blocks
    (causal, all heads at once). Earlier blocks: the pairs (query and selection head, block) with
    the block before the query's own, sorted by (batch, key/value head, block) and then selection
    head and token; ``rows`` is each pair's row in the token-major ``[B * T * Hs]`` order (each
    row the ``Hq / Hs`` query heads of a selection head); ``pairs_cu`` cuts the pairs into one
    sequence per (batch, key/value head, block), and ``keys_cu`` cuts the key/value-head-major
    ``[B * Hkv * T]`` keys into the same blocks. ``max_pairs`` bounds the longest sequence.
    ``pairs_of_row``, only where the Triton merge runs (else None): ``[B * T * Hs, S]`` int32,
    the pairs of each row (-1 for none), S the most a row may have. ``own_on_cudnn``: the own
    blocks run on cuDNN (:func:`_own_blocks_on_cudnn`), not in the packed call.

    Where the Triton merge runs (CUDA), the plan is made in Triton too
    (``triton_merge.plan_pairs``) and nothing is read back to the host: the lists have room for
    every pair the bound on a row's blocks allows, and the pairs past ``pairs_cu[-1]`` are
    padding (row -1) that the kernels leave alone; ``max_pairs`` is the most rows a block can
    have: the tokens after it times its key/value head's selection heads. Elsewhere the padding
    is cut off.

    ``chunk`` > 0: the earlier blocks run on cuDNN (:func:`_earlier_blocks_on_cudnn`, with the
    Triton merge only) as a batch of ``chunks`` dense chunks of ``chunk`` slots: sequence s's
    pairs fill chunks ``chunk_cu[s]`` on in order, ``chunk`` to a chunk, so that a chunk's rows
    all meet one block. ``rows`` then lists each slot's row (-1 for the slots no pair fills:
    gathered as zeros, so that in the backward, with a zero output gradient, they add nothing
    to the keys' gradients; nothing reads their outputs), ``pairs_of_row`` names slots,
    ``key_rows`` lists the keys of each chunk's block as rows of the token-major
    ``[B * T * Hkv]`` keys (block 0's for the chunks past ``chunk_cu[-1]``), ``pairs_cu`` is
    ``chunk_cu``, and ``keys_cu``, ``max_pairs`` go unused."""
    own_cu: torch.Tensor
    block_len: int
    rows: torch.Tensor
    pairs_cu: torch.Tensor
    keys_cu: torch.Tensor
    max_pairs: int
    pairs_of_row: torch.Tensor | None = None
    own_on_cudnn: bool = False
    chunk: int = 0
    chunks: int = 0
    chunk_cu: torch.Tensor | None = None
    key_rows: torch.Tensor | None = None


# The device types whose block selections merge in Triton (triton_merge.py); tests add "cpu"
# under Triton's interpreter.
MERGE_DEVICE_TYPES = {"cuda"}


@functools.lru_cache(maxsize=4)
def _plan_constants(batch: int, heads: int, seq_len: int, num_blocks: int, block_size: int,
                    top_k: int, kv_heads: int, merge: bool, device: torch.device) -> dict:
    """What a plan of these sizes needs that does not depend on the choice (cached: it is the
    same at every layer and step, and each would be a small launch of its own; the largest,
    the PyTorch plan's ``earlier``, is T n bytes)."""
    starts = torch.arange(num_blocks, device=device) * block_size
    lengths = (seq_len - starts).clamp(max=block_size)
    zero = torch.zeros(1, dtype=torch.long, device=device)
    # Room for the most pairs there can be: a token of block i has min(top_k - 1, i) of them.
    per_row = max(top_k - 1, 0)
    capacity = batch * heads * sum(min(per_row, i) * min(block_size, seq_len - i * block_size)
                                   for i in range(num_blocks))
    sequences = batch * kv_heads * num_blocks
    const = dict(
        per_row=per_row, capacity=capacity, sequences=sequences,
        own_cu=torch.cat([zero, lengths.repeat(batch).cumsum(0)]).int(),
        keys_cu=torch.cat([zero, lengths.repeat(batch * kv_heads).cumsum(0)]).int())
    if not merge:  # the PyTorch plan's
        own_block = torch.arange(seq_len, device=device) // block_size
        const.update(
            earlier=torch.arange(num_blocks, device=device)[None, :] < own_block[:, None],
            sequence_ids=torch.arange(sequences + 1, device=device))
    return const


def _selection_plan(chosen: torch.Tensor, block_size: int, top_k: int, kv_heads: int,
                    own_on_cudnn: bool = False, earlier_on_cudnn: bool = False) -> _SelectionPlan:
    """The plan of a selection ``chosen [B, Hs, T, n]`` over ``kv_heads`` key/value heads that
    includes each query's own block and at most ``top_k`` blocks a query; the earlier blocks
    on cuDNN where asked and the Triton merge runs."""
    batch, heads, seq_len, num_blocks = chosen.shape
    repeat = heads // kv_heads  # selection heads per key/value head
    device = chosen.device
    merge = device.type in MERGE_DEVICE_TYPES
    chunk = CUDNN_CHUNK if earlier_on_cudnn and merge else 0
    const = _plan_constants(batch, heads, seq_len, num_blocks, block_size, top_k, kv_heads,
                            merge, device)
    sizes = dict(own_cu=const["own_cu"], block_len=min(block_size, seq_len),
                 keys_cu=const["keys_cu"], max_pairs=repeat * max(seq_len - block_size, 0),
                 own_on_cudnn=own_on_cudnn)
    if merge:
        # room for the most chunks there can be: each sequence's last may be part full
        capacity = const["capacity"]
        chunks = -(-capacity // chunk) + const["sequences"] if chunk and capacity else 0
        cu, rows, pairs_of_row, *key_rows = _merge_kernels().plan_pairs(
            chosen, block_size, kv_heads, const["per_row"], chunks * chunk if chunk else capacity,
            chunk)
        if not chunk:
            return _SelectionPlan(rows=rows, pairs_cu=cu, pairs_of_row=pairs_of_row, **sizes)
        return _SelectionPlan(rows=rows, pairs_cu=cu, pairs_of_row=pairs_of_row, chunk=chunk,
                              chunks=chunks, chunk_cu=cu, key_rows=key_rows[0], **sizes)
    # (b, key/value head g, j, r, t) with selection head h = g * repeat + r, sorted as listed;
    # -1 past the pairs there are
    pairs = (chosen & const["earlier"]).view(batch, kv_heads, repeat, seq_len, num_blocks)
    b, g, j, r, t = torch.nonzero_static(pairs.permute(0, 1, 4, 2, 3), size=const["capacity"],
                                         fill_value=-1).unbind(1)
    chose = t >= 0
    sequence = torch.where(chose, (b * kv_heads + g) * num_blocks + j, const["sequences"])
    pairs_cu = torch.searchsorted(sequence, const["sequence_ids"]).int()
    rows = ((b * seq_len + t) * heads + g * repeat + r)[chose]
    return _SelectionPlan(rows=rows, pairs_cu=pairs_cu, **sizes)


def _merge_kernels():
    from . import triton_merge

    return triton_merge


def _gather_for(in_triton: bool):
    """How the pairs' call gathers its rows (of a tensor, or of each of a list of tensors): in
    Triton where the merge runs there (the plan has ``pairs_of_row``), else by PyTorch's
    indexing."""
    if in_triton:
        return _merge_kernels().gather_rows
    return lambda x, rows: [y[rows] for y in x] if isinstance(x, list) else x[rows]


def _merge(pieces, sink, tokens: int, group: int, dtype):
    """The PyTorch merge: ``pieces`` ``(out, lse, rows)`` (rows None: every row, in order),
    each ``out [rows, group, D]``, ``lse [rows, group]``, and the sink -> ``(out [R, group, D]
    in dtype, lse [R, group] fp32)`` (the module docstring's identity)."""
    sink_rows = None if sink is None else sink.float().view(-1, group).repeat(tokens, 1)
    # L = logsumexp over the pieces (and the sink), per row and head.
    top = pieces[0][1].clone()
    for _, piece_lse, at in pieces[1:]:
        top.index_reduce_(0, at, piece_lse, "amax")
    if sink_rows is not None:
        top = torch.maximum(top, sink_rows)
    total = torch.zeros_like(top) if sink_rows is None else torch.exp(sink_rows - top)
    for _, piece_lse, at in pieces:
        weight = torch.exp(piece_lse - (top if at is None else top[at]))
        total = total + weight if at is None else total.index_add(0, at, weight)
    full_lse = top + torch.log(total)
    wide = torch.promote_types(dtype, torch.float32)
    out = torch.zeros(*pieces[0][0].shape, dtype=wide, device=top.device)
    for piece_out, piece_lse, at in pieces:
        weight = torch.exp(piece_lse - (full_lse if at is None else full_lse[at]))[..., None]
        piece = piece_out.to(wide) * weight
        out = out + piece if at is None else out.index_add(0, at, piece)
    return out.to(dtype), full_lse


class _FlashBlockSelection(torch.autograd.Function):
    """Attention over chosen blocks on the kernels: q ``[B, T, Hq, D]``, k, v
    ``[B, T, Hkv, D]``, an fp32 sink ``[Hq]`` or None, the plan of a selection over ``Hs``
    selection heads -> o ``[B, T, Hq, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, sink, plan, selection_heads, scale):
        batch, seq_len, heads, dim = q.shape
        kv_heads, group = k.shape[2], heads // selection_heads
        q_rows, k_rows, v_rows = (x.reshape(batch * seq_len, x.shape[2], dim).contiguous()
                                  for x in (q, k, v))
        own = (plan.own_cu, plan.own_cu, plan.block_len, plan.block_len, True, -1, 0, scale)
        own_state = cudnn_state = None
        if plan.own_on_cudnn:
            out_own, lse_own, own_state = _own_blocks_cudnn_forward(q_rows, k_rows, v_rows,
                                                                    plan.block_len, scale)
        else:
            out_own, lse_own = _kernel_forward(q_rows, k_rows, v_rows, *own)
        # The earlier blocks' call, on rows of `group` query heads (one selection head each):
        # [B * T * Hs, group].
        selected = (plan.pairs_cu, plan.keys_cu, plan.max_pairs, plan.block_len, False, -1, -1,
                    scale)
        rows = plan.rows
        out_sel, lse_sel = out_own, lse_own  # (stand-ins when no query chose an earlier block)
        k_heads = v_heads = None
        if rows.numel():  # the rows of the pairs' call (or chunks)
            q_pairs = _gather_for(plan.pairs_of_row is not None)(q_rows.view(-1, group, dim), rows)
        if rows.numel() and plan.chunk:
            out_sel, lse_sel, cudnn_state = _chunks_forward(q_pairs, k_rows, v_rows, plan, scale)
        elif rows.numel():
            # keys and values key/value-head-major, one head
            k_heads, v_heads = (x.transpose(1, 2).reshape(-1, 1, dim).contiguous()
                                for x in (k, v))
            out_sel, lse_sel = _kernel_forward(q_pairs, k_heads, v_heads, *selected)
        if plan.pairs_of_row is not None:
            out, full_lse = _merge_kernels().merge_forward(
                out_own, lse_own, out_sel, lse_sel, plan.pairs_of_row,
                None if sink is None else sink.float(), selection_heads)
        else:
            pieces = [(out_own.reshape(-1, group, dim), lse_own.t().reshape(-1, group), None)]
            if rows.numel():
                pieces.append((out_sel, lse_sel.t(), rows))
            out, full_lse = _merge(pieces, sink, batch * seq_len, group, q.dtype)
        ctx.save_for_backward(q_rows, k_rows, v_rows, k_heads, v_heads, out, full_lse, rows, sink,
                              plan.pairs_of_row, plan.chunk_cu, plan.key_rows)
        ctx.options = (own, selected, (batch, seq_len, heads, kv_heads, selection_heads, dim))
        ctx.plan_sizes = (plan.block_len, plan.chunk, plan.chunks)
        ctx.own_state, ctx.cudnn_state = own_state, cudnn_state
        return out.view(batch, seq_len, heads, dim)

    @staticmethod
    def backward(ctx, d_out):
        (q_rows, k_rows, v_rows, k_heads, v_heads, out, full_lse, rows, sink, pairs_of_row,
         chunk_cu, key_rows) = ctx.saved_tensors
        own, selected, (batch, seq_len, heads, kv_heads, selection_heads, dim) = ctx.options
        group = heads // selection_heads
        shaped = (batch * seq_len, heads, dim)
        d_out = d_out.reshape(shaped).contiguous()
        # Each call's kernel gets the merged output and log-sum-exp: its gradients are then those
        # of the one softmax over all the query's keys, restricted to the call's keys.
        scale = own[-1]
        if ctx.own_state is not None:
            dq, dk, dv = _own_blocks_cudnn_backward(d_out, q_rows, k_rows, v_rows, out.view(shaped),
                                                    full_lse.view(batch * seq_len, heads),
                                                    ctx.plan_sizes[0], scale, ctx.own_state)
        else:
            dq, dk, dv = _kernel_backward(d_out, q_rows, k_rows, v_rows, out.view(shaped),
                                          full_lse.view(batch * seq_len, heads).t().contiguous(),
                                          *own)
        dk, dv = (x.reshape(batch, seq_len, kv_heads, dim) for x in (dk, dv))
        dq_pairs = None
        if rows.numel():  # the rows of the pairs' call (or chunks)
            d_pairs, q_pairs, out_pairs = _gather_for(pairs_of_row is not None)(
                [x.reshape(-1, group, dim) for x in (d_out, q_rows, out)], rows)
        if rows.numel() and ctx.cudnn_state is not None:
            dq_pairs, dk, dv = _chunks_backward(
                d_pairs, q_pairs, k_rows, v_rows, out_pairs, full_lse[rows], dk, dv, chunk_cu,
                key_rows, ctx.plan_sizes, scale, ctx.cudnn_state)
        elif rows.numel():
            dq_pairs, dk_heads, dv_heads = _kernel_backward(
                d_pairs, q_pairs, k_heads, v_heads, out_pairs, full_lse[rows].t().contiguous(),
                *selected)
            dk, dv = (own + per_head.view(batch, kv_heads, seq_len, dim).transpose(1, 2)
                      for own, per_head in ((dk, dk_heads), (dv, dv_heads)))
        if dq_pairs is not None and pairs_of_row is not None:
            dq = _merge_kernels().sum_query_gradients(dq, dq_pairs, pairs_of_row, selection_heads)
        elif dq_pairs is not None:
            wide = torch.promote_types(q_rows.dtype, torch.float32)
            dq = dq.reshape(-1, group, dim).to(wide).index_add(0, rows, dq_pairs.to(wide))
            dq = dq.to(q_rows.dtype)
        d_sink = None
        if sink is not None and ctx.needs_input_grad[3]:
            d_sink = _sink_gradient(sink, d_out, out.view(shaped),
                                    full_lse.view(batch * seq_len, heads))
        return dq.view(batch, seq_len, heads, dim), dk, dv, d_sink, None, None, None


def block_selection_attention(q, k, v, chosen, block_size, top_k, *, sink=None, scale=None,
                              cudnn=None):
    """Attention of each query to the keys of its chosen blocks, causally (keys s <= t):
    ``chosen [B, Hs, T, n]`` (bool, per query and selection head; Hs divides Hq and is a
    multiple of Hkv) must include each query's own block and at most ``top_k`` blocks a query.
    ``cudnn``: whether blocks may run on cuDNN where it takes them (None: where it passed its
    first-use check, :func:`cudnn_checked`, on this device in q's dtype). Call only where
    ``routing.flash_refusal`` allows."""
    block_len = min(block_size, q.shape[1])
    if cudnn is None:
        cudnn = _on_cudnn(q) and cudnn_checked(q.device, q.dtype)
    else:
        cudnn = cudnn and _on_cudnn(q)
    plan = _selection_plan(chosen, block_size, top_k, k.shape[2],
                           cudnn and _own_blocks_on_cudnn(q, block_len),
                           cudnn and _earlier_blocks_on_cudnn(q, block_len))
    return _FlashBlockSelection.apply(q, k, v, sink, plan, chosen.shape[1], scale)


def moba_attention(q, k, v, *, block_size, top_k, sink=None, scale=None, cudnn=None):
    """``moba_attention`` (same arguments, no window or ``allowed``) on the FlashAttention
    kernels (``cudnn`` as in :func:`block_selection_attention`). Call only where
    ``routing.flash_refusal`` allows."""
    with torch.no_grad():
        chosen = moba_chosen(q, k, block_size, top_k)
    return block_selection_attention(q, k, v, chosen, block_size, top_k, sink=sink, scale=scale,
                                     cudnn=cudnn)


# DSA's attention over each query's selected keys (:func:`causal_selection_attention`) runs on
# cuDNN's fused attention, causal, with the selection as an additive bias ``[B, 1, T, T']`` in
# q's dtype (T' = T rounded up to 8 keys; triton_select.selection_bias), made again in the
# backward rather than kept from the forward: 2 B T^2 bytes, 1 GiB at B = 2, T = 16384. The causal
# flag lets cuDNN skip the tiles above the diagonal, which the bias alone would not; against
# FlexAttention over the selection's bitmap it trades a little peak memory for speed
# (``benchmarks/dsa_stages.py --attention flash,flex``, ``benchmarks/sparse_attention.py --ops
# dsa/flash,dsa/flex`` measure both).
_BIAS_ALIGN = 8


def _selection_bias(selected: torch.Tensor, key_len: int, dtype: torch.dtype) -> torch.Tensor:
    """The selection ``[B, L, K]`` (of keys below ``key_len``) as cuDNN's bias ``[B, 1, L,
    key_len]`` in ``dtype`` (a view of rows padded to ``_BIAS_ALIGN`` keys)."""
    width = -(-key_len // _BIAS_ALIGN) * _BIAS_ALIGN
    from . import triton_select

    return triton_select.selection_bias(selected, width, dtype)[:, None, :, :key_len]


class _CausalSelection(torch.autograd.Function):
    """q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]``, an fp32 sink ``[Hq]`` or None, the keys
    ``selected [B, T, K]`` (each at or before its query; -1 none) -> o ``[B, T, Hq, D]`` and
    (no gradient) the log-sum-exp ``[B, T, Hq]`` fp32, the sink included. A query that lists
    no key has no output (the sink's value vector is zero) and, without a sink, a log-sum-exp
    of +inf, so that the backward gives its row probabilities of 0."""

    @staticmethod
    def forward(ctx, q, k, v, sink, selected, scale):
        q, k, v = (x.contiguous() for x in (q, k, v))
        out, lse, state = _cudnn_forward(*(x.transpose(1, 2) for x in (q, k, v)), scale,
                                         causal=True,
                                         bias=_selection_bias(selected, q.shape[1], q.dtype))
        listed = (selected >= 0).any(-1)[:, None]  # [B, 1, T]
        wide = torch.promote_types(q.dtype, torch.float32)
        out = torch.where(listed[..., None], out.to(wide), 0.0)
        lse = torch.where(listed, lse, float("-inf"))
        if sink is not None:
            with_sink = torch.logaddexp(lse, sink.float()[:, None])
            out = out * torch.exp(lse - with_sink)[..., None]
            lse = with_sink
        else:
            lse = torch.where(listed, lse, float("inf"))
        out = out.to(q.dtype).transpose(1, 2).contiguous()
        ctx.save_for_backward(q, k, v, out, lse, sink, selected)
        ctx.state, ctx.scale = state, scale
        token_lse = lse.transpose(1, 2).contiguous()
        ctx.mark_non_differentiable(token_lse)
        return out, token_lse

    @staticmethod
    def backward(ctx, d_out, _):
        q, k, v, out, lse, sink, selected = ctx.saved_tensors
        d_out = d_out.contiguous()
        grads = _cudnn_backward(*(x.transpose(1, 2) for x in (d_out, q, k, v, out)), lse,
                                ctx.state, ctx.scale, causal=True,
                                bias=_selection_bias(selected, q.shape[1], q.dtype))
        d_sink = None
        if sink is not None and ctx.needs_input_grad[3]:
            heads, dim = q.shape[2:]
            d_sink = _sink_gradient(sink, d_out.view(-1, heads, dim), out.view(-1, heads, dim),
                                    lse.transpose(1, 2).reshape(-1, heads))
        return *(g.transpose(1, 2) for g in grads), d_sink, None, None


def causal_selection_attention(q, k, v, selected, *, sink=None, scale=None, return_lse=False):
    """DSA's attention (``dsa_attention``: each query over the keys it lists in ``selected
    [B, T, K]``, -1 none) where every listed key is at or before its query, on cuDNN (see
    above): o ``[B, T, Hq, D]``; with ``return_lse``, ``(o, lse)``, lse ``[B, T, Hq]`` fp32 the
    log-sum-exp of each query head's scaled scores over its keys and the sink (+inf for a
    query with neither), without gradient. Call only where
    ``routing.flash_refusal`` and ``routing.cudnn_refusal`` allow."""
    out, lse = _CausalSelection.apply(q, k, v, sink, selected, scale)
    return (out, lse) if return_lse else out


# CSA's attention (:func:`compressed_selection_attention`): its selected entries run on cuDNN
# in chunks of this many queries, each chunk against the entries its last query can see, so
# that about half of the [T, N] tiles, where no entry is complete yet, are not computed; each
# chunk's bias (2 B L N' bytes) is made when it runs, forward and again backward.
CSA_QUERY_CHUNK = 2048


class _CompressedSelection(torch.autograd.Function):
    """CSA's attention: q ``[B, T, Hq, D]`` over the last ``window`` tokens of k, v ``[B, T,
    Hkv, D]`` (FlashAttention-2, causal with a window) and over the entries ``ck``, ``cv``
    ``[B, N, Hkv, D]`` each query lists in ``selected [B, T, K]`` (cuDNN with the selection as
    a bias, in chunks of ``query_chunk`` queries against the entries ``visible(last query)`` can
    see), merged through the log-sum-exps with the sink (module docstring); and (no gradient)
    the log-sum-exp ``[B, T, Hq]`` fp32 over the selected entries and the sink alone (+inf for
    a query with neither), as :func:`causal_selection_attention`'s."""

    @staticmethod
    def forward(ctx, q, k, v, ck, cv, sink, selected, window, visible, scale, cu_seqlens,
                max_len, query_chunk):
        batch, seq_len, heads, _ = q.shape
        rows = [x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v)]
        flash = (cu_seqlens, cu_seqlens, max_len, max_len, True, window - 1, 0, scale)
        out_w, lse_w = _kernel_forward(*rows, *flash)
        q_t = rows[0].view(batch, seq_len, heads, -1).transpose(1, 2)
        entries = [x.contiguous().transpose(1, 2) for x in (ck, cv)]
        wide = torch.promote_types(q.dtype, torch.float32)
        out_e = torch.zeros_like(q_t)
        lse_e = torch.full((batch, heads, seq_len), float("-inf"), dtype=wide, device=q.device)
        chunks = []
        for start in range(0, seq_len, query_chunk):
            stop = min(start + query_chunk, seq_len)
            count = visible(stop - 1)
            if count == 0:
                continue
            bias = _selection_bias(selected[:, start:stop], count, q.dtype)
            o, lse, state = _cudnn_forward(q_t[:, :, start:stop],
                                           *(x[:, :, :count] for x in entries), scale,
                                           causal=False, bias=bias)
            out_e[:, :, start:stop], lse_e[:, :, start:stop] = o, lse
            chunks.append((start, stop, count, state))
        listed = (selected >= 0).any(-1)[:, None]  # [B, 1, T]: a query without entries
        lse_e = torch.where(listed, lse_e, float("-inf"))
        lse_w_t = lse_w.view(heads, batch, seq_len).transpose(0, 1)
        lse = torch.logaddexp(lse_w_t, lse_e)
        if sink is not None:
            lse = torch.logaddexp(lse, sink.float()[:, None])
        out_w_t = out_w.view(batch, seq_len, heads, -1).transpose(1, 2)
        out = (out_w_t.to(wide) * torch.exp(lse_w_t - lse)[..., None]
               + torch.where(listed[..., None], out_e.to(wide), 0.0)
               * torch.exp(lse_e - lse)[..., None])
        out = out.to(q.dtype).transpose(1, 2).contiguous()  # [B, T, Hq, D]
        ctx.save_for_backward(*rows, *entries, out, lse, sink, selected)
        ctx.flash, ctx.chunks, ctx.scale = flash, chunks, scale
        if sink is not None:
            lse_e = torch.logaddexp(lse_e, sink.float()[:, None])
        else:
            lse_e = torch.where(listed, lse_e, float("inf"))
        entries_lse = lse_e.transpose(1, 2).contiguous()
        ctx.mark_non_differentiable(entries_lse)
        return out, entries_lse

    @staticmethod
    def backward(ctx, d_out, _):
        q, k, v, ck, cv, out, lse, sink, selected = ctx.saved_tensors
        batch, heads, seq_len = lse.shape
        d_out = d_out.contiguous()
        d_rows, out_rows = (x.view(-1, *x.shape[2:]) for x in (d_out, out))
        lse_rows = lse.transpose(0, 1).reshape(heads, -1)
        dq, dk, dv = _kernel_backward(d_rows, q, k, v, out_rows, lse_rows, *ctx.flash)
        dq_t = dq.view(batch, seq_len, heads, -1).transpose(1, 2)
        q_t, d_t, out_t = (x.view(batch, seq_len, heads, -1).transpose(1, 2)
                           for x in (q, d_out, out))
        d_entries = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in (ck, cv)]
        for start, stop, count, state in ctx.chunks:
            part = slice(start, stop)
            bias = _selection_bias(selected[:, part], count, q.dtype)
            dq_c, dk_c, dv_c = _cudnn_backward(
                d_t[:, :, part], q_t[:, :, part], ck[:, :, :count], cv[:, :, :count],
                out_t[:, :, part], lse[:, :, part].contiguous(), state, ctx.scale, causal=False,
                bias=bias)
            dq_t[:, :, part] += dq_c
            d_entries[0][:, :, :count] += dk_c
            d_entries[1][:, :, :count] += dv_c
        d_sink = None
        if sink is not None and ctx.needs_input_grad[5]:
            d_sink = _sink_gradient(sink, d_rows, out_rows, lse_rows.t())
        dck, dcv = (d.to(x.dtype).transpose(1, 2) for d, x in zip(d_entries, (ck, cv)))
        shape = (batch, seq_len, heads, -1)
        return (dq.view(shape), dk.view(batch, seq_len, *k.shape[1:]),
                dv.view(batch, seq_len, *v.shape[1:]), dck, dcv, d_sink, *([None] * 7))


def compressed_selection_attention(q, k, v, compressed_k, compressed_v, selected, *, window,
                                   rate, sink=None, scale=None, cu_seqlens=None,
                                   query_chunk=None, return_lse=False):
    """CSA's attention (``csa_attention``: each query over the last ``window`` tokens of its
    sequence and the entries it lists in ``selected [B, T, K]``, -1 none, each complete at its
    query) with the window on FlashAttention-2 and the entries on cuDNN (see above); entries are
    one per complete block of ``rate`` tokens. With ``return_lse``, ``(o, lse)``: lse ``[B, T,
    Hq]`` fp32 the log-sum-exp of each query head's scaled scores over its selected entries and
    the sink (not the window: what CSA's indexer loss targets; +inf for a query with neither),
    without gradient. Call only where ``routing.flash_refusal`` and ``routing.cudnn_refusal`` allow."""
    batch, seq_len = q.shape[:2]
    num_entries = compressed_k.shape[1]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32,
                                  device=q.device)
        max_len = seq_len

        def visible(t):  # entries complete at token t
            return min(num_entries, (t + 1) // rate)
    else:  # entries of packed sequences: each chunk against all of them
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0

        def visible(t):
            return num_entries
    out, lse = _CompressedSelection.apply(q, k, v, compressed_k, compressed_v, sink, selected,
                                          window, visible, scale, cu_seqlens, max_len,
                                          query_chunk or CSA_QUERY_CHUNK)
    return (out, lse) if return_lse else out


@functools.cache
def checked(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels passed their first-use check (:func:`check`) on ``device`` in
    ``dtype``; run once, a failure logged once."""
    return passes_first_use_check(check, device, dtype, CHECK_TOLERANCE,
                                  "the FlashAttention kernels", "FlexAttention runs instead", _log)


@functools.cache
def cudnn_checked(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuDNN's attention passed its first-use check for block selections and DSA's
    and CSA's attention (:func:`check_cudnn`) on ``device`` in ``dtype``; run once, a failure
    logged once. Where it fails, FlashAttention-2 runs every block, and DSA's and CSA's
    attention run on their other backends (the rest of the flash path is checked apart)."""
    return passes_first_use_check(check_cudnn, device, dtype, CHECK_TOLERANCE,
                                  "cuDNN's attention for block selections, DSA and CSA",
                                  "FlashAttention-2 runs their blocks, and DSA's and CSA's "
                                  "attention their other backends, instead", _log)


@torch.inference_mode(False)  # a first use under inference mode checks as any other
def check(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The first-use check: the worst relative error (Frobenius norm) of the output ("o") and of
    each gradient ("grad_q", ...) over these calls in ``dtype`` against the fp32 reference on the
    same rounded values, 4 query heads on 2 key/value heads, D = 64: two packed sequences of 37
    and 64 tokens, causal, with a window of 17 and a sink; a batch of 2 x 70 tokens, not causal,
    without them; MoBA on 2 x 150 tokens in blocks of 32 (the last one partial), top 3, with a
    sink; and blocks of 32 chosen at random per key/value head (as NSA's), with a sink; nothing
    on cuDNN (:func:`check_cudnn` checks that)."""
    generator = torch.Generator(device=device).manual_seed(0)
    packed = torch.tensor([0, 37, 101], device=device)
    own = torch.arange(150, device=device) // 32
    chosen = torch.rand(2, 2, 150, 5, device=device, generator=generator) < 0.4
    chosen[:, :, torch.arange(150, device=device), own] = True
    chosen &= torch.arange(5, device=device)[None, :] <= own[:, None]
    allowed = chosen.repeat_interleave(2, dim=1)[..., own]
    return _check_calls(device, dtype, generator, [
        ((flash_attention, softmax_attention_reference), 1, 101,
         dict(causal=True, window=(17, 0), cu_seqlens=packed), True),
        ((flash_attention, softmax_attention_reference), 2, 70, dict(causal=False), False),
        ((functools.partial(moba_attention, cudnn=False), moba_attention_reference), 2, 150,
         dict(block_size=32, top_k=3), True),
        ((functools.partial(block_selection_attention, chosen=chosen, block_size=32, top_k=5,
                            cudnn=False),
          functools.partial(softmax_attention_reference, allowed=allowed)), 2, 150, {}, True),
    ])


@torch.inference_mode(False)
def check_cudnn(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """The first-use check of cuDNN's attention in block selections and in DSA's attention, as
    :func:`check`: MoBA with every block full, on 2 x 128 tokens in blocks of 32, top 3,
    without a sink (the own blocks on cuDNN), and on 2 x 4 blocks of
    ``CUDNN_MIN_EARLIER_BLOCK``, with one (the earlier blocks too, where the Triton merge
    runs); :func:`causal_selection_attention` on 2 x 75 tokens, 24 causal keys a query at
    random (all of them, then -1, for the first 23; one query with none), with and without a
    sink; :func:`compressed_selection_attention` on the same tokens, a window of 2 and up to 6
    entries a query at random (-1 where fewer are complete; one query with none) of the 18
    blocks of 4 (an entry: k and v at its block's last token), in 3 chunks of up to 32 queries,
    with and without a sink."""
    generator = torch.Generator(device=device).manual_seed(1)
    moba = (functools.partial(moba_attention, cudnn=True), moba_attention_reference)
    tokens = torch.arange(75, device=device)[:, None]
    keys = torch.rand(2, 75, 75, device=device, generator=generator).tril().topk(24).indices
    selected = torch.where(keys <= tokens, keys, -1)
    selected[1, 40] = -1
    dsa = (functools.partial(causal_selection_attention, selected=selected),
           functools.partial(dsa_attention_reference, selected=selected))
    rate = 4
    complete = torch.arange(rate - 1, 75, rate, device=device) <= tokens  # [T, N]
    entries = torch.rand(2, 75, complete.shape[1], device=device, generator=generator)
    entries = entries.masked_fill(~complete, -1.0).topk(6)
    chosen = torch.where(entries.values >= 0, entries.indices, -1)
    chosen[1, 40] = -1

    def csa(q, k, v, sink=None):
        return compressed_selection_attention(q, k, v, k[:, rate - 1::rate], v[:, rate - 1::rate],
                                              chosen, window=2, rate=rate, sink=sink,
                                              query_chunk=32)

    def csa_reference(q, k, v, sink=None):
        return csa_attention_reference(q, k, v, k[:, rate - 1::rate], v[:, rate - 1::rate],
                                       chosen, window=2, sink=sink)

    return _check_calls(device, dtype, generator, [
        (moba, 2, 128, dict(block_size=32, top_k=3), False),
        (moba, 2, 4 * CUDNN_MIN_EARLIER_BLOCK, dict(block_size=CUDNN_MIN_EARLIER_BLOCK, top_k=3),
         True),
        (dsa, 2, 75, {}, True),
        (dsa, 2, 75, {}, False),
        ((csa, csa_reference), 2, 75, {}, True),
        ((csa, csa_reference), 2, 75, {}, False),
    ])


def _check_calls(device, dtype, generator, calls) -> dict[str, float]:
    """The first-use checks' loop over ``calls``: ``((ours, the reference), batch, T, options,
    with a sink)`` each, 4 query heads on 2 key/value heads, D = 64; the worst error by name."""
    worst = {}
    with torch.autocast(device.type, enabled=False), torch.enable_grad():
        for runs, batch, seq_len, options, with_sink in calls:
            def randn(*shape):
                return torch.randn(*shape, device=device, generator=generator)

            # q, k, v rounded to dtype for both (MoBA's choice of blocks depends on them)
            leaves = {"q": randn(batch, seq_len, 4, 64), "k": randn(batch, seq_len, 2, 64),
                      "v": randn(batch, seq_len, 2, 64)}
            leaves = {key: x.to(dtype).float() for key, x in leaves.items()}
            if with_sink:
                leaves["sink"] = randn(4)
            grad = randn(batch, seq_len, 4, 64)
            results = []
            for run, cast in zip(runs, (dtype, torch.float32)):
                inputs = {key: (x.to(cast) if key != "sink" else x).requires_grad_()
                          for key, x in leaves.items()}
                out = run(inputs["q"], inputs["k"], inputs["v"], sink=inputs.get("sink"), **options)
                grads = torch.autograd.grad(out.float(), list(inputs.values()), grad)
                results.append([out.float(), *(g.float() for g in grads)])
            names = ["o", *(f"grad_{key}" for key in leaves)]
            for name, got, want in zip(names, *results):
                worst[name] = max(worst.get(name, 0.0), relative_error(got, want))
    return worst
