"""Context parallelism of softmax attention: all-gather of keys and values.

Each rank keeps its queries (Megatron's load-balanced chunks r and 2CP-1-r), gathers the keys
and values of the whole sequence in global order, and masks with the global positions: query
at position p may see key position j iff ``j <= p``. Backward is the all-gather's:
a reduce-scatter of dK and dV. (Plain causal attention skips the mask: the SDPA core runs each
local chunk against the keys up to its end with a lower-right causal mask, see
``SDPACoreAttention._attend_chunks_causally``; packed sequences, windows and sinks take the mask
built here.)

Why an all-gather for this mixer (rather than all-to-all or a ring):

- keys and values are the small side of grouped-query attention (``hkv <= hq``): a rank
  receives ``2 (CP-1)/CP * T * hkv * d`` values, while all-to-all moves q, k, v and the output
  (``(CP-1)/CP * T/CP * (2 hq + 2 hkv) d``, four tensors) and needs the heads divisible by TP*CP;
  with hkv much smaller than hq and moderate CP the two are close, and the gather has no head
  constraint;
- the load-balanced layout already gives every rank the same causal work, and one collective
  per direction keeps the CPU/gloo path simple; a ring (overlapping the transfer with the
  blocks' compute) is what to add when T is long enough that the gathered K/V
  (``T * hkv * d`` per rank) do not fit or the transfer cannot hide behind compute;
- masks of any shape (causal, packed documents, sliding windows) apply unchanged to the
  gathered keys, because they are written in global positions; a sink is a per-head logit and
  needs nothing from the other ranks.
"""

from __future__ import annotations

import torch

from megatron_ext.parallel.context import ContextParallel, packed_layout


def gather_keys_values(cp: ContextParallel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       cu_seqlens: torch.Tensor | None = None, window: tuple[int, int] | None = None):
    """q ``[b, 2L, hq, d]``, k/v ``[b, 2L, hkv, d]`` (this rank's chunks) -> k, v of the whole
    sequence ``[b, T, hkv, d]`` and the causal mask of the local queries ``[2L, T]`` (True =
    may attend). With packed sequences (``cu_seqlens``, global; b = 1; Megatron's per-document
    split) the mask is also block-diagonal: a query sees the earlier keys of its document. A
    sliding ``window`` ``(left, right)`` (Megatron's convention, -1 unbounded) narrows it:
    query p sees keys p - left .. p + right."""
    if cu_seqlens is None:
        local_length = cp.check_local_length(q.shape[1]) * 2
        query_positions = cp.positions(local_length, device=q.device)
        packed = None
    else:
        packed = packed_layout(cp, cu_seqlens)
        query_positions = packed.global_index(cp.rank)
    k, v = cp.gather_sequence(k, packed), cp.gather_sequence(v, packed)
    key_positions = torch.arange(k.shape[1], device=q.device)
    allowed = key_positions[None, :] <= query_positions[:, None]
    if packed is not None:
        boundaries = packed.cu_seqlens[1:].to(key_positions.device)
        document = lambda positions: torch.searchsorted(boundaries, positions, right=True)  # noqa: E731
        allowed &= document(query_positions)[:, None] == document(key_positions)[None, :]
    if window is not None:
        offset = query_positions[:, None] - key_positions[None, :]  # p - j
        left, right = window
        if left >= 0:
            allowed &= offset <= left
        if right >= 0:
            allowed &= -offset <= right
    return k, v, allowed
