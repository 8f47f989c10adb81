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
- :meth:`ContextParallel.reduce_scatter`: a reduce-scatter without gradient (the DSA and CSA
  indexer loss's target, summed over the ranks' heads, each rank getting that of its own
  tokens: :meth:`ContextParallel.query_shares`).

Packed sequences (``qkv_format='thd'``, one batch row): Megatron splits each document on its
own (``get_batch_on_this_cp_rank`` with ``cu_seqlens``: Transformer Engine's
``thd_get_partitioned_indices``): document i, of a length divisible by ``2 * CP``, is cut into
``2 * CP`` chunks of ``n_i / (2 CP)`` tokens and rank r holds, document after document, chunk r
then chunk ``2 CP - 1 - r``; ``cu_seqlens`` stays global. :class:`PackedLayout` describes that:
the local sequence is ``2 * documents`` pieces (document i's two chunks), which play the role of
the ``2B`` chunk-batched rows above, and every method takes it as ``packed=``.
"""

from __future__ import annotations

import functools

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


class PackedLayout:
    """This rank's part of ``thd``-packed sequences under CP (see the module docstring).

    ``cu_seqlens``: the global cumulative document lengths (Megatron's PackedSeqParams; read
    once to the host, where the layout is worked out). ``local_cu_seqlens`` ``[2D + 1]`` (on
    cu_seqlens' device): the pieces of the local sequence (document i's two chunks at 2i and
    2i + 1), for the ops' ``cu_seqlens``; ``piece_lengths`` ``[2D]`` (host).
    """

    def __init__(self, cp: "ContextParallel", cu_seqlens: torch.Tensor, min_chunk: int = 1):
        self.device = cu_seqlens.device
        cu_seqlens = cu_seqlens.detach().to("cpu", torch.long)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        parts = 2 * cp.size
        bad = [n for n in lengths.tolist() if n % parts]
        if bad:
            raise ConfigError(
                f"packed sequences of lengths {bad} are not divisible by 2 * context_parallel_size"
                f" = {parts} (Megatron cuts each document into that many chunks under CP); pad "
                "each document to a multiple of it")
        chunk = lengths // parts
        self.cp, self.cu_seqlens, self.chunk = cp, cu_seqlens, chunk
        self.check_chunks(min_chunk)
        self.piece_lengths = chunk.repeat_interleave(2)
        self.local_cu_seqlens = torch.cat([cu_seqlens.new_zeros(1),
                                           self.piece_lengths.cumsum(0)]).to(self.device)
        self.documents = len(chunk)

    def check_chunks(self, min_chunk: int) -> None:
        """ConfigError if a document's CP chunks are shorter than ``min_chunk`` tokens."""
        if int(self.chunk.min()) < min_chunk:
            lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
            raise ConfigError(
                f"a packed document of {int(lengths[self.chunk.argmin()])} tokens gives CP chunks "
                f"of {int(self.chunk.min())} tokens, fewer than the {min_chunk} this layer needs "
                "(its convolution reaches that far back); use longer documents or a smaller "
                "context_parallel_size")

    def global_index(self, rank: int) -> torch.Tensor:
        """Global token positions of ``rank``'s local sequence, in its local order."""
        pieces = []
        for start, chunk in zip(self.cu_seqlens[:-1].tolist(), self.chunk.tolist()):
            for c in self.cp.chunks_of(rank):
                pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        return torch.cat(pieces).to(self.device)

    @functools.cached_property
    def rank_major_order(self) -> torch.Tensor:
        """Global positions of every rank's local tokens, rank after rank."""
        return torch.cat([self.global_index(rank) for rank in range(self.cp.size)])

    @functools.cached_property
    def to_global_order(self) -> torch.Tensor:
        """The permutation that puts rank-major tokens (:attr:`rank_major_order`) in global order."""
        return torch.argsort(self.rank_major_order)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``[1, local, ...]`` -> the pieces, ``[1, piece_length, ...]`` each."""
        return list(x.split(self.piece_lengths.tolist(), dim=1))


_last_layout: tuple = (None, None, None)  # (cu_seqlens, CP size, its PackedLayout)


def packed_layout(cp: "ContextParallel", cu_seqlens: torch.Tensor, min_chunk: int = 1) -> PackedLayout:
    """:class:`PackedLayout` of these packed sequences, worked out once per ``cu_seqlens`` tensor
    (every layer of a forward passes the same one, and each layout costs a copy to the host),
    checked for chunks of at least ``min_chunk`` tokens."""
    global _last_layout
    tensor, size, layout = _last_layout
    if tensor is not cu_seqlens or size != cp.size:
        layout = PackedLayout(cp, cu_seqlens)
        _last_layout = (cu_seqlens, cp.size, layout)
    layout.check_chunks(min_chunk)
    return layout


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
        self.chunks = self.chunks_of(self.rank)

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The global chunks ``rank`` holds: ``rank`` and ``2 CP - 1 - rank``."""
        return rank, 2 * self.size - 1 - rank

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
        return self.before_tails(chunked[:, chunked.shape[1] - count:])

    def before_tails(self, tails: torch.Tensor) -> torch.Tensor:
        """Given the last tokens of each local chunk or piece, ``[2B, count, C]`` (chunk-batched
        rows, or a packed layout's pieces), the last tokens of the chunk before each (zeros
        for a sequence's first chunk): ``[2B, count, C]``."""
        ordered = self.gather_chunks(tails.unflatten(0, (tails.shape[0] // 2, 2)))
        before = torch.cat([torch.zeros_like(ordered[:1]), ordered[:-1]])  # chunk c -> c - 1's tail
        return self.mine(before)

    def sequence_to_heads(self, x: torch.Tensor, packed: PackedLayout | None = None) -> torch.Tensor:
        """Sequence-sharded ``[B, 2L, H, ...]`` -> head-sharded ``[B, T, H / CP, ...]`` with
        the whole sequence in global order (this rank gets head group ``rank``)."""
        if x.shape[2] % self.size:
            raise ConfigError(f"{x.shape[2]} heads per rank cannot be split over "
                              f"context_parallel_size={self.size} for all-to-all CP")
        send = x.unflatten(2, (self.size, -1)).movedim(2, 0)  # [CP (head group), B, 2L, h, ...]
        received = all_to_all(self.group, send.contiguous())  # [CP (source rank), B, 2L, h, ...]
        if packed is not None:  # B = 1: put the ranks' tokens at their global positions
            return received.movedim(0, 1).flatten(1, 2)[:, packed.to_global_order]
        per_rank = received.unflatten(2, (2, -1)).movedim(2, 1)  # [CP, 2, B, L, h, ...]
        return self._global_order(per_rank).movedim(0, 1).flatten(1, 2)

    def heads_to_sequence(self, y: torch.Tensor, packed: PackedLayout | None = None) -> torch.Tensor:
        """Inverse of :meth:`sequence_to_heads`: ``[B, T, H / CP, ...]`` -> ``[B, 2L, H, ...]``."""
        if packed is not None:
            send = y[:, packed.rank_major_order].unflatten(1, (self.size, -1)).movedim(1, 0)
            # [CP (dest), 1, 2L, h, ...]
        else:
            ordered = y.unflatten(1, (2 * self.size, -1)).movedim(1, 0)  # [2CP, B, L, h, ...]
            send = self._by_rank(ordered).movedim(1, 2).flatten(2, 3)  # [CP (dest), B, 2L, h, ...]
        received = all_to_all(self.group, send.contiguous())  # [CP (head group), B, 2L, h, ...]
        return received.movedim(0, 2).flatten(2, 3)

    def gather_sequence(self, x: torch.Tensor, packed: PackedLayout | None = None) -> torch.Tensor:
        """Sequence-sharded ``[B, 2L, ...]`` -> the whole ``[B, T, ...]`` in global order."""
        if packed is not None:  # B = 1
            gathered = _AllGather.apply(x.transpose(0, 1).contiguous(), self.group)  # [CP 2L, 1, ...]
            return gathered[packed.to_global_order].transpose(0, 1)
        ordered = self.gather_chunks(x.unflatten(1, (2, -1)))  # [2CP, B, L, ...]
        return ordered.movedim(0, 1).flatten(1, 2)

    def positions(self, local_length: int, device=None, rank: int | None = None) -> torch.Tensor:
        """Global token positions of the local sequence ``[2L]`` (of ``rank``'s, default this
        rank's)."""
        chunk = local_length // 2
        chunks = self.chunks_of(self.rank if rank is None else rank)
        return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                          for c in chunks])

    def rank_positions(self, seq_len: int, packed: PackedLayout | None = None,
                       device=None) -> torch.Tensor:
        """``[CP, T / CP]``: the global positions of every rank's local tokens, in local order,
        rank after rank (row r: rank r's :meth:`positions`)."""
        if packed is not None:
            return packed.rank_major_order.view(self.size, -1)
        return torch.stack([self.positions(seq_len // self.size, device, rank)
                            for rank in range(self.size)])

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """``[CP, ...]`` on every rank -> ``[...]``: the sum over the ranks of their
        ``x[rank]`` (one reduce-scatter; no gradient)."""
        out = x.new_empty(x.shape[1:])
        dist.reduce_scatter_tensor(out, x.detach().flatten(0, 1).contiguous(), group=self.group)
        return out

    def query_shares(self, seq_len: int, packed: PackedLayout | None = None, device=None):
        """The indexer loss's :class:`~megatron_ext.kernels.sparse.QueryShares` of a sequence
        held whole by every rank for its head group: each rank's share is its own local tokens
        (those of Megatron's load-balanced layout, so the ranks' shares of a causal loss cost
        alike), whose summed target reaches it by :meth:`reduce_scatter`."""
        from megatron_ext.kernels.sparse import QueryShares

        return QueryShares(self.rank_positions(seq_len, packed, device), self.rank,
                           self.reduce_scatter)

    def heads_of_rank(self, per_head: torch.Tensor) -> torch.Tensor:
        """This rank's head group of a per-head constant ``[H, ...]`` (all-to-all CP)."""
        return per_head.chunk(self.size)[self.rank]
