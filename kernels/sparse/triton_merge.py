"""The Triton kernels of a block selection (flash.py: MoBA, NSA's selected branch): its plan
(:func:`plan_pairs`), the forward's merge of its two attention calls by log-sum-exp, the
backward's sum of the query gradients, the gathers of the rows of the pairs' call (up to three
tensors a launch), and the sum of the key (or value) gradients of the chunks where that call
ran on cuDNN (:func:`add_block_gradients`).

flash.py splits each query's softmax over disjoint sets of keys: its own block (one call over
all rows) and each earlier block it chose (one call over the (row, block) pairs, the rows
gathered). A row is a token and selection head; it carries the G query heads of that selection
head. Given the own call's output ``o_0`` and log-sum-exp ``L_0`` and the pairs' ``o_p``, ``L_p``
(``pairs [R, S]``: the row's pairs, -1 for none), the merge is, per row and query head,

    L = m + log(exp(L_0 - m) + sum_p exp(L_p - m) + exp(sink - m)),   m the largest of them,
    o = exp(L_0 - L) o_0 + sum_p exp(L_p - L) o_p,

in fp32, o written in the outputs' dtype and L in fp32 (each call's backward then takes the
merged o and L: flash.py's docstring). The backward's query gradient is the own call's plus the
row's pairs': ``dq = dq_0 + sum_p dq_p``, summed in fp32 and written once.

In PyTorch the same merge takes a dozen kernels over ``[R, G, D]`` fp32 copies (index_reduce,
index_add, exp, casts) and the sum an fp32 copy and an index_add; here each reads its inputs
once. Layouts: ``o_0``, dq_0 ``[N, Hq, D]`` (tokens N, read as ``[R, G, D]`` with R = N Hs),
``L_0 [Hq, N]``, ``o_p``, ``dq_p [P, G, D]``, ``L_p [G, P]`` (FlashAttention's), made
contiguous (as the kernels return them); D up to 256. One program per block of BLOCK_R rows
and one query head; S, G and the padded D are compile-time constants (not tuned). CUDA
tensors, or CPU tensors under Triton's interpreter (tests/ops/test_triton_interpret_merge.py).

The pairs' call reads its queries (and in backward the output gradients, queries and merged
outputs) as rows gathered from the token-major ones: ``x[rows]`` for ``x [R, G, D]``.
:func:`gather_rows` copies BLOCK_P whole rows per program, where PyTorch's indexing kernel moves
these 256-byte rows far below the memory's bandwidth.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["merge_forward", "sum_query_gradients", "gather_rows", "add_block_gradients",
           "plan_pairs"]

BLOCK_R = 32
BLOCK_P = 32  # gather_rows: rows per program
_LAUNCH = dict(num_warps=4)


@triton.jit
def _merge_kernel(own_o, own_lse, sel_o, sel_lse, pairs, sink, out, out_lse,
                  rows, num_pairs, tokens, selection_heads, dim,
                  G: tl.constexpr, S: tl.constexpr, HAS_SINK: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    live = r < rows
    cols = live[:, None] & (d < dim)[None, :]
    head = (r % selection_heads) * G + g
    lse_0 = tl.load(own_lse + head.to(tl.int64) * tokens + r // selection_heads, mask=live,
                    other=0.0)
    top = lse_0
    for s in tl.static_range(S):
        p = tl.load(pairs + r.to(tl.int64) * S + s, mask=live, other=-1)
        lse_p = tl.load(sel_lse + g.to(tl.int64) * num_pairs + p, mask=p >= 0,
                        other=float("-inf"))
        top = tl.maximum(top, lse_p)
    if HAS_SINK:
        sink_h = tl.load(sink + head, mask=live, other=float("-inf"))
        top = tl.maximum(top, sink_h)
    total = tl.exp(lse_0 - top)
    for s in tl.static_range(S):
        p = tl.load(pairs + r.to(tl.int64) * S + s, mask=live, other=-1)
        lse_p = tl.load(sel_lse + g.to(tl.int64) * num_pairs + p, mask=p >= 0,
                        other=float("-inf"))
        total += tl.exp(lse_p - top)
    if HAS_SINK:
        total += tl.exp(sink_h - top)
    lse = top + tl.log(total)
    row_offset = (r.to(tl.int64) * G + g) * dim
    acc = tl.exp(lse_0 - lse)[:, None] * tl.load(own_o + row_offset[:, None] + d[None, :],
                                                   mask=cols, other=0.0).to(tl.float32)
    for s in tl.static_range(S):
        p = tl.load(pairs + r.to(tl.int64) * S + s, mask=live, other=-1)
        chosen = p >= 0
        lse_p = tl.load(sel_lse + g.to(tl.int64) * num_pairs + p, mask=chosen,
                        other=float("-inf"))
        pair_offset = (p.to(tl.int64) * G + g) * dim
        o_p = tl.load(sel_o + pair_offset[:, None] + d[None, :],
                      mask=chosen[:, None] & cols, other=0.0).to(tl.float32)
        acc += tl.exp(lse_p - lse)[:, None] * o_p
    tl.store(out + row_offset[:, None] + d[None, :], acc.to(out.dtype.element_ty), mask=cols)
    tl.store(out_lse + r.to(tl.int64) * G + g, lse, mask=live)


@triton.jit
def _sum_kernel(own, sel, pairs, out, rows, dim,
                G: tl.constexpr, S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    live = r < rows
    cols = live[:, None] & (d < dim)[None, :]
    row_offset = (r.to(tl.int64) * G + g) * dim
    acc = tl.load(own + row_offset[:, None] + d[None, :], mask=cols, other=0.0).to(tl.float32)
    for s in tl.static_range(S):
        p = tl.load(pairs + r.to(tl.int64) * S + s, mask=live, other=-1)
        pair_offset = (p.to(tl.int64) * G + g) * dim
        acc += tl.load(sel + pair_offset[:, None] + d[None, :],
                       mask=(p >= 0)[:, None] & cols, other=0.0).to(tl.float32)
    tl.store(out + row_offset[:, None] + d[None, :], acc.to(out.dtype.element_ty), mask=cols)


def _launch(rows: int, group: int, dim: int):
    return (triton.cdiv(rows, BLOCK_R), group), dict(BLOCK_R=BLOCK_R,
                                                      BLOCK_D=max(16, triton.next_power_of_2(dim)))


def merge_forward(own_out, own_lse, sel_out, sel_lse, pairs, sink, selection_heads: int):
    """``own_out [N, Hq, D]``, ``own_lse [Hq, N]`` (fp32), ``sel_out [P, G, D]``, ``sel_lse
    [G, P]`` (fp32), ``pairs [R, S]`` int32 (R = N * selection_heads), ``sink [Hq]`` fp32 or
    None -> the merged ``o [R, G, D]`` in own_out's dtype and ``L [R, G]`` fp32."""
    own_out, own_lse, sel_out, sel_lse, pairs = (
        x.contiguous() for x in (own_out, own_lse, sel_out, sel_lse, pairs))
    tokens, heads, dim = own_out.shape
    group = heads // selection_heads
    rows, slots = pairs.shape
    out = torch.empty(rows, group, dim, dtype=own_out.dtype, device=own_out.device)
    out_lse = torch.empty(rows, group, dtype=torch.float32, device=own_out.device)
    grid, blocks = _launch(rows, group, dim)
    _merge_kernel[grid](own_out, own_lse, sel_out, sel_lse, pairs,
                        own_lse if sink is None else sink, out, out_lse, rows, sel_out.shape[0],
                        tokens, selection_heads, dim, G=group, S=slots, HAS_SINK=sink is not None,
                        **blocks, **_LAUNCH)
    return out, out_lse


def sum_query_gradients(own_dq, sel_dq, pairs, selection_heads: int):
    """``own_dq [N, Hq, D]`` + each row's pairs' ``sel_dq [P, G, D]`` -> ``[N, Hq, D]`` in
    own_dq's dtype, summed in fp32."""
    own_dq, sel_dq, pairs = (x.contiguous() for x in (own_dq, sel_dq, pairs))
    tokens, heads, dim = own_dq.shape
    group = heads // selection_heads
    rows, slots = pairs.shape
    out = torch.empty_like(own_dq)
    grid, blocks = _launch(rows, group, dim)
    _sum_kernel[grid](own_dq, sel_dq, pairs, out, rows, dim, G=group, S=slots, **blocks,
                      **_LAUNCH)
    return out


@triton.jit
def _gather_kernel(x0, x1, x2, rows, out0, out1, out2, count, width, SOURCES: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_W: tl.constexpr):
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    live = p < count
    row = tl.load(rows + p, mask=live, other=0).to(tl.int64)
    source = row * width
    target = p.to(tl.int64) * width
    w = tl.arange(0, BLOCK_W)
    for w0 in range(0, width, BLOCK_W):
        cols = live[:, None] & ((w0 + w) < width)[None, :]
        load = cols & (row >= 0)[:, None]
        at, to = source[:, None] + w0 + w[None, :], target[:, None] + w0 + w[None, :]
        tl.store(out0 + to, tl.load(x0 + at, mask=load, other=0.0), mask=cols)
        if SOURCES > 1:
            tl.store(out1 + to, tl.load(x1 + at, mask=load, other=0.0), mask=cols)
        if SOURCES > 2:
            tl.store(out2 + to, tl.load(x2 + at, mask=load, other=0.0), mask=cols)


def gather_rows(x, rows: torch.Tensor):
    """``x[rows]`` for ``x [R, ...]`` and ``rows [P]`` (integers in [0, R), unchecked; -1
    gives a row of zeros), as a new contiguous tensor; or, for a list of up to 3 tensors of
    one shape and dtype, the list of theirs, in one launch."""
    sources = [y.contiguous() for y in (x if isinstance(x, (list, tuple)) else [x])]
    if not 0 < len(sources) <= 3:
        raise ValueError(f"gather_rows takes 1 to 3 tensors, got {len(sources)}")
    shape, dtype = sources[0].shape, sources[0].dtype
    if any(y.shape != shape or y.dtype != dtype for y in sources):
        raise ValueError("gather_rows takes tensors of one shape and dtype")
    outs = [torch.empty((rows.numel(), *shape[1:]), dtype=y.dtype, device=y.device)
            for y in sources]
    width = math.prod(shape[1:])
    if outs[0].numel():
        padded = sources + sources[:1] * (3 - len(sources))
        _gather_kernel[(triton.cdiv(rows.numel(), BLOCK_P),)](
            *padded[:3], rows, *(outs + outs[:1] * (3 - len(outs)))[:3], rows.numel(), width,
            SOURCES=len(sources), BLOCK_P=BLOCK_P,
            BLOCK_W=min(256, triton.next_power_of_2(width)), **_LAUNCH)
    return outs if isinstance(x, (list, tuple)) else outs[0]


@triton.jit
def _block_gradient_kernel(own, chunks, chunk_cu, out, seq_len, kv_heads, num_blocks,
                           block_len, dim, BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr):
    s = tl.program_id(0)  # the sequence (b, g, j), as in flash.py's plan
    l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    d = tl.arange(0, BLOCK_D)
    b = s // (kv_heads * num_blocks)
    g = (s // num_blocks) % kv_heads
    token = (s % num_blocks) * block_len + l
    live = (l < block_len) & (token < seq_len)
    cols = live[:, None] & (d < dim)[None, :]
    row = ((b * seq_len + token).to(tl.int64) * kv_heads + g) * dim
    acc = tl.load(own + row[:, None] + d[None, :], mask=cols, other=0.0).to(tl.float32)
    for c in range(tl.load(chunk_cu + s).to(tl.int64), tl.load(chunk_cu + s + 1)):
        at = (c * block_len + l) * dim
        acc += tl.load(chunks + at[:, None] + d[None, :], mask=cols, other=0.0).to(tl.float32)
    tl.store(out + row[:, None] + d[None, :], acc.to(out.dtype.element_ty), mask=cols)


def add_block_gradients(own: torch.Tensor, chunks: torch.Tensor, chunk_cu: torch.Tensor,
                        block_len: int) -> torch.Tensor:
    """The key (or value) gradient of a block selection whose earlier blocks ran as chunks
    (flash.py's cuDNN path): ``own [B, T, Hkv, D]`` plus, for each (batch, key/value head,
    block) sequence s, its chunks' gradients ``chunks[chunk_cu[s]:chunk_cu[s + 1]]``
    (``chunks [N, block_len, D]``, each over the block's keys), summed in fp32 in chunk order
    (deterministic) and written once in own's dtype."""
    own, chunks, chunk_cu = (x.contiguous() for x in (own, chunks, chunk_cu))
    batch, seq_len, kv_heads, dim = own.shape
    num_blocks = triton.cdiv(seq_len, block_len)
    out = torch.empty_like(own)
    grid = (batch * kv_heads * num_blocks, triton.cdiv(block_len, BLOCK_R))
    _block_gradient_kernel[grid](own, chunks, chunk_cu, out, seq_len, kv_heads, num_blocks,
                                 block_len, dim, BLOCK_L=BLOCK_R,
                                 BLOCK_D=max(16, triton.next_power_of_2(dim)), **_LAUNCH)
    return out


# The plan of a block selection's pairs (flash.py's _SelectionPlan, where the merge runs here):
# the pairs (row, earlier block) grouped by (batch, key/value head, block) sequence, in (selection
# head, token) order within one, as a dense count and a dense placement over ``chosen`` instead of
# a compaction and a sort: two launches and a cumsum (a third launch lists the chunks' keys) where
# PyTorch takes some 50 small ops, whose host time leaves the GPU idle.
_PLAN_ELEMENTS = 4096  # a program's tile of tokens x blocks


@triton.jit
def _earlier_chosen(chosen, seq_len, num_blocks, block_size, kv_heads, repeat,
                    BLOCK_T: tl.constexpr, NP: tl.constexpr):
    """A program's tile of the plan's kernels (grid [tiles of BLOCK_T tokens, B Hs]): its
    ``[BLOCK_T, NP]`` int32 flags (block j chosen by token t of selection row b Hs + h, and
    before t's own block), each token's row ``(b T + t) Hs + h``, each block's sequence
    ``(b, g, j)`` and the tile's place ``at`` in ``partial [sequences, repeat * tiles]``."""
    tile, bh = tl.program_id(0), tl.program_id(1)
    tiles = tl.num_programs(0)
    b, h = bh // (kv_heads * repeat), bh % (kv_heads * repeat)
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, NP)
    earlier = (t < seq_len)[:, None] & (j[None, :] < (t // block_size)[:, None])
    flags = tl.load(chosen + ((bh.to(tl.int64) * seq_len + t)[:, None] * num_blocks + j[None, :]),
                    mask=earlier, other=0).to(tl.int32)
    row = (b * seq_len + t).to(tl.int64) * (kv_heads * repeat) + h
    sequence = (b * kv_heads + h // repeat) * num_blocks + j
    at = sequence.to(tl.int64) * (repeat * tiles) + (h % repeat) * tiles + tile
    return flags, row, sequence, at


@triton.jit
def _pair_count_kernel(chosen, partial, seq_len, num_blocks, block_size, kv_heads, repeat,
                       BLOCK_T: tl.constexpr, NP: tl.constexpr):
    flags, _, _, at = _earlier_chosen(chosen, seq_len, num_blocks, block_size, kv_heads, repeat,
                                      BLOCK_T, NP)
    tl.store(partial + at, tl.sum(flags, 0), mask=tl.arange(0, NP) < num_blocks)


@triton.jit
def _pair_place_kernel(chosen, partial, inclusive, start, rows, pairs, seq_len, num_blocks,
                       block_size, kv_heads, repeat, per_row,
                       BLOCK_T: tl.constexpr, NP: tl.constexpr):
    flags, row, sequence, at = _earlier_chosen(chosen, seq_len, num_blocks, block_size, kv_heads,
                                               repeat, BLOCK_T, NP)
    real = tl.arange(0, NP) < num_blocks
    # the sequence's pairs before this tile's: its first slot, plus its earlier tiles' counts
    first = (tl.load(start + sequence, mask=real, other=0).to(tl.int64)
             + tl.load(inclusive + at, mask=real, other=0) - tl.load(partial + at, mask=real,
                                                                     other=0))
    slot = first[None, :] + (tl.cumsum(flags, 0) - flags)
    chosen_pair = flags > 0
    tl.store(rows + slot, tl.broadcast_to(row[:, None], (BLOCK_T, NP)), mask=chosen_pair)
    nth = tl.cumsum(flags, 1) - flags  # the pair's place among its row's
    tl.store(pairs + row[:, None] * per_row + nth, slot.to(tl.int32),
             mask=chosen_pair & (nth < per_row))


@triton.jit
def _chunk_keys_kernel(cu, key_rows, sequences, chunks, seq_len, kv_heads, num_blocks,
                       block_size, BLOCK_L: tl.constexpr):
    s = tl.program_id(0)  # a sequence (b, g, j), or past them: the chunks past the last
    l = tl.arange(0, BLOCK_L)
    b = s // (kv_heads * num_blocks)
    g = (s // num_blocks) % kv_heads
    first = ((b * seq_len + (s % num_blocks) * block_size) * kv_heads + g).to(tl.int64)
    first = tl.where(s < sequences, first, 0)  # block 0's keys for the padding chunks
    end = tl.where(s < sequences, tl.load(cu + s + 1, mask=s < sequences, other=0), chunks)
    for c in range(tl.load(cu + s).to(tl.int64), end):
        for start in range(0, block_size, BLOCK_L):
            key = start + l
            tl.store(key_rows + c * block_size + key, first + key * kv_heads,
                     mask=key < block_size)


def plan_pairs(chosen: torch.Tensor, block_size: int, kv_heads: int, per_row: int, slots: int,
               chunk: int):
    """The pairs of ``chosen [B, Hs, T, n]`` (bool; the pairs: block j chosen by token t of
    selection head h = g (Hs / kv_heads) + r, j before t's own block) in sequences s = (b, g,
    j), each listed in (r, t) order from its first slot: ``cu[s]``, or with ``chunk`` > 0
    ``chunk cu[s]`` (each sequence then fills whole chunks of that many slots). Returns ``(cu
    [S + 1] int32`` (the sequences' first pairs, or first chunks, ``cu[-1]`` the total),
    ``rows [slots]`` int64 (each slot's row (b T + t) Hs + h, -1 where no pair lands),
    ``pairs [B T Hs, max(per_row, 1)]`` int32 (each row's slots in block order, -1 past
    them))``, and with chunks a fourth, ``key_rows [slots / chunk * block_size]`` int64: each
    chunk's block's keys as rows of the token-major ``[B * T * kv_heads]`` keys (block 0's
    for the chunks past the last). No value is read back to the host; ``slots`` must hold
    every slot."""
    chosen = chosen.contiguous()
    batch, heads, seq_len, num_blocks = chosen.shape
    repeat = heads // kv_heads
    padded = max(16, triton.next_power_of_2(num_blocks))
    block_t = max(16, _PLAN_ELEMENTS // padded)
    tiles = triton.cdiv(seq_len, block_t)
    sequences = batch * kv_heads * num_blocks
    device = chosen.device
    partial = torch.empty(sequences, repeat * tiles, dtype=torch.int32, device=device)
    grid = (tiles, batch * heads)
    sizes = dict(BLOCK_T=block_t, NP=padded, **_LAUNCH)
    flags = chosen.view(torch.int8)
    _pair_count_kernel[grid](flags, partial, seq_len, num_blocks, block_size, kv_heads, repeat,
                             **sizes)
    inclusive = partial.cumsum(1, dtype=torch.int32)
    counts = inclusive[:, -1]
    if chunk:
        counts = (counts + chunk - 1) // chunk
    cu = torch.zeros(sequences + 1, dtype=torch.int32, device=device)
    torch.cumsum(counts, 0, out=cu[1:])
    start = cu[:-1] * chunk if chunk else cu
    rows = torch.full((slots,), -1, dtype=torch.int64, device=device)
    pairs = torch.full((batch * seq_len * heads, max(per_row, 1)), -1, dtype=torch.int32,
                       device=device)
    _pair_place_kernel[grid](flags, partial, inclusive, start, rows, pairs, seq_len, num_blocks,
                             block_size, kv_heads, repeat, max(per_row, 1), **sizes)
    if not chunk:
        return cu, rows, pairs
    chunks = slots // chunk
    key_rows = torch.empty(chunks * block_size, dtype=torch.int64, device=device)
    _chunk_keys_kernel[(sequences + 1,)](cu, key_rows, sequences, chunks, seq_len, kv_heads,
                                         num_blocks, block_size,
                                         BLOCK_L=min(1024, triton.next_power_of_2(block_size)),
                                         **_LAUNCH)
    return cu, rows, pairs, key_rows
