"""Chunks of packed sequences for the chunkwise Triton kernels (delta_rule/triton.py,
decay/triton.py): where each chunk lies along the flattened token axis, as tables on the device,
and the Triton helper that finds a chunk's tokens in them.

The tokens are flattened to ``[B * T]``: B rows of T tokens, or sequences packed along T by
cu_seqlens (:func:`.common.sequence_bounds`). Each sequence is cut into chunks of C tokens from
its first token (its last chunk may be short; an empty sequence has none), numbered over all
sequences in order. :class:`ChunkLayout` holds, int32 on the device:

    cu          [N + 1]   sequence n spans tokens cu[n] .. cu[n + 1] - 1
    seq_chunks  [N + 1]   sequence n's chunks are seq_chunks[n] .. seq_chunks[n + 1] - 1
    chunks      [NC, 2]   chunk c spans tokens chunks[c, 0] .. chunks[c, 1] - 1

A kernel parallel over chunks finds its chunk's tokens with :func:`chunk_rows`: row i of the
chunk is token start + i, a row at or past the chunk's count is padding (each family loads it as
a token that changes nothing). A kernel that walks a sequence's chunks in order takes them from
seq_chunks and the sequence's tokens from cu, each chunk's with :func:`sequence_chunk_rows`.

A walk may also be cut into segments of whole chunks (:func:`segment_layout`): the segments'
ChunkLayout is the sequences' with each sequence cut every ``segment_chunks`` chunks, so its
chunks are the sequences' chunks, numbered the same.
"""
import functools
import itertools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["ChunkLayout", "chunk_layout", "chunk_rows", "segment_layout", "sequence_chunk_rows"]


class ChunkLayout(NamedTuple):
    """Where the sequences and their chunks lie along the flattened token axis (B * T)."""

    cu: torch.Tensor  # [N + 1] int32: sequence n spans tokens cu[n] .. cu[n + 1] - 1
    seq_chunks: torch.Tensor  # [N + 1] int32: sequence n's chunks are seq_chunks[n] .. seq_chunks[n + 1] - 1
    chunks: torch.Tensor  # [NC, 2] int32: chunk c spans tokens chunks[c, 0] .. chunks[c, 1] - 1
    num_seqs: int
    num_chunks: int


@functools.lru_cache(maxsize=32)
def chunk_layout(bounds: tuple[int, ...], chunk_size: int, device: torch.device) -> ChunkLayout:
    """The chunks of ``chunk_size`` tokens of the sequences of ``bounds`` (their first tokens and
    the end, :func:`.common.sequence_bounds`). Built once per layout and device and then shared
    by every call (read-only): no host-to-device copy, and no wait for the GPU, per call."""
    bounds = list(bounds)
    spans = list(zip(bounds, bounds[1:]))
    seq_chunks = list(itertools.accumulate((-(-(end - start) // chunk_size) for start, end in spans), initial=0))
    chunks = [edge for start, end in spans for first in range(start, end, chunk_size)
              for edge in (first, min(first + chunk_size, end))]
    cu, seq_chunks_t, chunks_t = _int32_tables(device, bounds, seq_chunks, chunks)
    return ChunkLayout(cu, seq_chunks_t, chunks_t.view(-1, 2), len(spans), seq_chunks[-1])


def _int32_tables(device: torch.device, *parts: list[int]) -> list[torch.Tensor]:
    """``parts`` as int32 tensors on ``device``, in one host-to-device copy; each part padded to
    16 entries in it, so that every part is as aligned as the whole and Triton compiles one kernel
    whatever the number of sequences and chunks."""
    padded = [part + [0] * (-len(part) % 16) for part in parts]
    table = torch.tensor(list(itertools.chain(*padded)), dtype=torch.int32).to(device)
    return [part[:len(values)] for part, values in zip(table.split([len(part) for part in padded]), parts)]


@functools.lru_cache(maxsize=32)
def segment_layout(bounds: tuple[int, ...], chunk_size: int, segment_chunks: int,
                   device: torch.device) -> tuple[ChunkLayout, torch.Tensor]:
    """The sequences of ``bounds`` cut into segments of ``segment_chunks`` chunks (a sequence's
    last segment may be shorter; an empty sequence is one empty segment): the segments'
    :class:`ChunkLayout` (its ``cu`` and ``seq_chunks`` by segment, its chunks those of
    ``chunk_layout(bounds, chunk_size, device)``) and ``seq_segments`` [N + 1] int32 on the
    device: sequence n's segments are seq_segments[n] .. seq_segments[n + 1] - 1."""
    step = chunk_size * segment_chunks
    cuts, seq_segments = [bounds[0]], [0]
    for start, end in zip(bounds, bounds[1:]):
        cuts += [*range(start + step, end, step), end]
        seq_segments.append(len(cuts) - 1)
    return chunk_layout(tuple(cuts), chunk_size, device), _int32_tables(device, seq_segments)[0]


@triton.jit
def chunk_rows(chunks_ptr, c, C: tl.constexpr):
    """Chunk c of a :class:`ChunkLayout`'s ``chunks`` table: its first token (int64), its number
    of tokens, its rows 0..C-1 and which of them are tokens."""
    start = tl.load(chunks_ptr + 2 * c)
    count = tl.load(chunks_ptr + 2 * c + 1) - start
    rows = tl.arange(0, C)
    return start.to(tl.int64), count, rows, rows < count


@triton.jit
def sequence_chunk_rows(bos, eos, j, C: tl.constexpr):
    """Chunk j of the sequence spanning tokens bos .. eos - 1, from its bounds (a kernel walking a
    sequence's chunks in order loads nothing per chunk to find them, so its loads of the chunks'
    tiles can be issued ahead): as :func:`chunk_rows`, its first token (int64), its number of
    tokens, its rows 0..C-1 and which of them are tokens."""
    start = bos + j * C
    count = tl.minimum(eos - start, C)
    rows = tl.arange(0, C)
    return start.to(tl.int64), count, rows, rows < count
