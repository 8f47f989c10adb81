"""Megatron's load-balanced context-parallel layout, and the collectives every CP method uses.

Megatron (``megatron.core.utils.get_batch_on_this_cp_rank``) cuts a sequence of T tokens into
``2 * CP`` chunks of ``L = T / (2 CP)`` tokens; rank r holds chunk r then chunk ``2 CP - 1 - r``
(so every rank has the same causal work). A mixer therefore sees ``[B, 2L, ...]`` tensors made
of two chunks that are not neighbours. :class:`ContextParallel` names those chunks, moves
between that layout and the global order, and runs the three collectives of our CP methods,
each differentiable:

- :meth:`ContextParallel.gather_chunks`: an all-gather of a per-chunk tensor whose size does not
  grow with T (recurrent-state summaries, convolution halos), returned in global chunk order.
  Backward: a reduce-scatter of the gradients (each rank gets the sum over ranks of the
  gradient of its own contribution).
- :meth:`ContextParallel.sequence_to_heads` / :meth:`ContextParallel.heads_to_sequence`: the
  all-to-all between sequence-sharded and head-sharded tensors (Ulysses: Jacobs et al.,
  "DeepSpeed Ulysses", 2023); the backward of one is the other.
- :meth:`ContextParallel.gather_sequence`: the all-gather of a whole sequence-sharded tensor
  (keys and values of softmax attention), in global token order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import all_to_all

from megatron_ext.config import ConfigError


class _AllGather(torch.autograd.Function):
    """``[n, ...]`` per rank -> ``[CP * n, ...]`` (rank-major); backward: reduce-scatter."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        tensor = tensor.contiguous()
        out = tensor.new_empty(group.size() * tensor.shape[0], *tensor.shape[1:])
        dist.all_gather_into_tensor(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[0] // ctx.group.size(), *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None


class ContextParallel:
    """The CP group of a layer and this rank's place in Megatron's load-balanced layout.

    ``chunks`` = ``(rank, 2 * size - 1 - rank)``: the global chunks this rank holds, in its
    local order. Local tensors are ``[B, 2L, ...]`` (sequence dim 1); "chunk-batched" tensors
    are ``[2B, L, ...]`` with row ``2 b + j`` = local chunk j of batch row b.
    """

    def __init__(self, group):
        self.group = group
        self.size = group.size()
        self.rank = group.rank()
        self.chunks = (self.rank, 2 * self.size - 1 - self.rank)

    @classmethod
    def of(cls, config, pg_collection) -> "ContextParallel | None":
        """The layer's CP, or None when ``context_parallel_size`` is 1."""
        if config.context_parallel_size == 1:
            return None
        group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if group is None:
            from megatron.core import parallel_state

            group = parallel_state.get_context_parallel_group()
        return cls(group)

    # ---------------------------------------------------------------- layout
    def check_local_length(self, local_length: int, min_chunk: int = 1) -> int:
        """The chunk length L of a local sequence of ``local_length`` tokens (raises if the
        global sequence is not ``2 * CP`` chunks of at least ``min_chunk`` tokens)."""
        total = local_length * self.size
        if local_length % 2:
            raise ConfigError(
                f"sequence length {total} is not divisible by 2 * context_parallel_size = "
                f"{2 * self.size} (Megatron's load-balanced CP layout cuts it into that many "
                "chunks); pad or choose seq_length accordingly")
        if local_length // 2 < min_chunk:
            raise ConfigError(
                f"sequence length {total} gives CP chunks of {local_length // 2} tokens, fewer "
                f"than the {min_chunk} this layer needs (its convolution reaches that far back); "
                "use a longer sequence or a smaller context_parallel_size")
        return local_length // 2

    @staticmethod
    def split_chunks(x: torch.Tensor) -> torch.Tensor:
        """``[B, 2L, ...]`` -> chunk-batched ``[2B, L, ...]``."""
        return x.unflatten(1, (2, x.shape[1] // 2)).flatten(0, 1)

    @staticmethod
    def merge_chunks(x: torch.Tensor) -> torch.Tensor:
        """Chunk-batched ``[2B, L, ...]`` -> ``[B, 2L, ...]``."""
        return x.unflatten(0, (x.shape[0] // 2, 2)).flatten(1, 2)

    def _global_order(self, per_rank: torch.Tensor) -> torch.Tensor:
        """``[CP, 2, ...]`` (rank, local chunk) -> ``[2 CP, ...]`` in global chunk order."""
        # Chunk c < CP is rank c's first; chunk 2 CP - 1 - r is rank r's second.
        return torch.cat([per_rank[:, 0], per_rank[:, 1].flip(0)])

    def _by_rank(self, ordered: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`_global_order`: ``[2 CP, ...]`` -> ``[CP, 2, ...]``."""
        return torch.stack([ordered[: self.size], ordered[self.size:].flip(0)], dim=1)

    # ---------------------------------------------------------------- collectives
    def gather_chunks(self, local: torch.Tensor) -> torch.Tensor:
        """Per local chunk ``[B, 2, ...]`` -> every chunk of every rank ``[2 CP, B, ...]`` in
        global order (one all-gather; backward one reduce-scatter)."""
        gathered = _AllGather.apply(local.transpose(0, 1).contiguous(), self.group)
        return self._global_order(gathered.unflatten(0, (self.size, 2)))

    def mine(self, ordered: torch.Tensor) -> torch.Tensor:
        """``[2 CP, B, ...]`` in global chunk order -> this rank's chunks, chunk-batched
        ``[2B, ...]``."""
        return torch.stack([ordered[c] for c in self.chunks], dim=1).flatten(0, 1)

    def previous_tokens(self, chunked: torch.Tensor, count: int) -> torch.Tensor:
        """The ``count`` tokens before each local chunk (zeros before the sequence start), from
        chunk-batched ``[2B, L, C]``: ``[2B, count, C]``. This is the halo of a causal
        convolution of width ``count + 1``; needs ``L >= count``."""
        tails = chunked[:, chunked.shape[1] - count:]
        ordered = self.gather_chunks(tails.unflatten(0, (tails.shape[0] // 2, 2)))
        before = torch.cat([torch.zeros_like(ordered[:1]), ordered[:-1]])  # chunk c -> c - 1's tail
        return self.mine(before)

    def sequence_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence-sharded ``[B, 2L, H, ...]`` -> head-sharded ``[B, T, H / CP, ...]`` with
        the whole sequence in global order (this rank gets head group ``rank``)."""
        if x.shape[2] % self.size:
            raise ConfigError(f"{x.shape[2]} heads per rank cannot be split over "
                              f"context_parallel_size={self.size} for all-to-all CP")
        send = x.unflatten(2, (self.size, -1)).movedim(2, 0)  # [CP (head group), B, 2L, h, ...]
        received = all_to_all(self.group, send.contiguous())  # [CP (source rank), B, 2L, h, ...]
        per_rank = received.unflatten(2, (2, -1)).movedim(2, 1)  # [CP, 2, B, L, h, ...]
        return self._global_order(per_rank).movedim(0, 1).flatten(1, 2)

    def heads_to_sequence(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`sequence_to_heads`: ``[B, T, H / CP, ...]`` -> ``[B, 2L, H, ...]``."""
        ordered = y.unflatten(1, (2 * self.size, -1)).movedim(1, 0)  # [2CP, B, L, h, ...]
        send = self._by_rank(ordered).movedim(1, 2).flatten(2, 3)  # [CP (dest), B, 2L, h, ...]
        received = all_to_all(self.group, send.contiguous())  # [CP (head group), B, 2L, h, ...]
        return received.movedim(0, 2).flatten(2, 3)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence-sharded ``[B, 2L, ...]`` -> the whole ``[B, T, ...]`` in global order."""
        ordered = self.gather_chunks(x.unflatten(1, (2, -1)))  # [2CP, B, L, ...]
        return ordered.movedim(0, 1).flatten(1, 2)

    def positions(self, local_length: int, device=None) -> torch.Tensor:
        """Global token positions of the local sequence ``[2L]``."""
        chunk = local_length // 2
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                          for c in self.chunks])

    def heads_of_rank(self, per_head: torch.Tensor) -> torch.Tensor:
        """This rank's head group of a per-head constant ``[H, ...]`` (all-to-all CP)."""
        return per_head.chunk(self.size)[self.rank]
