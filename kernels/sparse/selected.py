"""DSA's per-token selection run in PyTorch, by chunks of queries; any device, autograd gives
the backward.

- :func:`select_keys`: the lightning indexer's scores and the top-k keys of each query, without
  gradient. A chunk of queries scores the keys up to its last query only, never a ``[T, T]``
  matrix at once: on CUDA in one Triton kernel (triton_indexer.py's ``index_scores``), ``[B, c,
  S]`` values at a time; elsewhere in PyTorch, ``[B, c, HI, S]`` products at a time.
- :func:`selected_attention`: a chunk gathers its queries' K keys and values
  (``[B, c, K, Hkv, D]``) and takes one softmax over them: memory O(T K), not O(T^2).
- :func:`indexer_loss`: the indexer's KL loss, chunk by chunk, over the selected keys (gathered)
  or, for the dense warm-up, over every causal key; with :class:`QueryShares`, one process's
  share of it (context parallelism: the target reduce-scattered by query rows). Where
  triton.py's kernels run, its sparse stage is theirs, without chunks.

Which keys a query may choose is a :class:`Keys`: for DSA the causal ones (:func:`causal_keys`),
for DeepSeek-V4's CSA the compressed entries whose blocks are complete (compressed.py).

A chunk holds at most ``gathered.max_scores(device)`` fp32 values. With gradients, each chunk is
recomputed in the backward pass (activation checkpointing), so that what is kept for backward
is the inputs and the outputs, linear in T (and, in the sparse loss whose target is reduced over
processes, that target, ``[B, T, K]`` or its share, so that backward repeats no collective).
"""
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.checkpoint import checkpoint

from .. import registry
from . import gathered
from .gathered import _softmax_with_sink
from .layout import MaskMod, both, document_rule, window_rule
from .routing import indexer_facts, indexer_kernels_refusal
from .reference import indexer_kl, lightning_index_scores, top_k_keys

__all__ = ["Keys", "QueryShares", "causal_keys", "select_keys", "selected_attention",
           "indexer_loss"]


def _query_chunks(seq_len: int, batch: int, per_query: int, device: torch.device):
    """``(start, end)`` ranges of queries of at most ``gathered.max_scores(device)`` values, at
    ``per_query`` values per query of each batch row."""
    step = max(1, gathered.max_scores(device) // max(1, batch * per_query))
    return [(start, min(start + step, seq_len)) for start in range(0, seq_len, step)]


@dataclass(frozen=True)
class Keys:
    """Which keys each query may choose: ``rule(b, h, t, s)`` (layout.py's convention), and
    ``reach(end)``, how many leading keys the queries before ``end`` can see (none of them sees
    a key after those)."""

    rule: MaskMod
    reach: Callable[[int], int]


def causal_keys(cu_seqlens, seq_len: int) -> Keys:
    """DSA's keys: the query's own token and those before it, in its sequence of a pack."""
    rule = window_rule(True, None)
    if cu_seqlens is not None:
        rule = both(rule, document_rule(cu_seqlens, seq_len))
    return Keys(rule, lambda end: end)


def _allowed(rule, start: int, end: int, key_len: int, device) -> torch.Tensor:
    """``[1, c, key_len]`` bool: the rule for queries ``start .. end - 1``."""
    queries = torch.arange(start, end, device=device)[:, None]
    return rule(0, 0, queries, torch.arange(key_len, device=device))[None]


def _gather(x: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``x [B, S, ...]`` at ``selected [B, c, K]`` -> ``[B, c, K, ...]``; -1 reads key 0, which
    the caller masks."""
    rows = torch.arange(x.shape[0], device=x.device).view(-1, 1, 1)
    return x[rows, selected.clamp(min=0)]


def _probs(q, keys, allowed, sink, scale):
    """Softmax (with the sink) over each query's allowed keys, fp32 ``[B, c, Hkv, G, S]``.
    q ``[B, c, Hq, D]``; keys shared by the chunk ``[B, S, Hkv, D]`` or gathered per query
    ``[B, c, S, Hkv, D]``; allowed ``[B | 1, c, S]``."""
    batch, chunk, heads, dim = q.shape
    kv_heads = keys.shape[-2]
    group = heads // kv_heads
    pattern = "bcngd,bsnd->bcngs" if keys.dim() == 4 else "bcngd,bcsnd->bcngs"
    scores = torch.einsum(pattern, q.float().view(batch, chunk, kv_heads, group, dim),
                          keys.float()) * scale
    if sink is not None:
        sink = sink.float().view(1, 1, kv_heads, group, 1)
    return _softmax_with_sink(scores, allowed[:, :, None, None, :], sink)


def _maybe_checkpoint(fn, *args):
    """``fn(*args)``, recomputed in backward when a tensor argument requires grad."""
    if torch.is_grad_enabled() and any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in args):
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


# The fp32 values a query's chunk holds per key with the fused scores: the scores (masked in
# place) and what top_k_keys makes of them, at most a copy and the int64 keys of every row where
# a tie crosses its threshold (in PyTorch, the [B, c, HI, S] products bound the chunk).
_FUSED_VALUES = 8


def _triton_index_scores(*args, **kwargs):
    """triton_indexer.py's ``index_scores`` (imported on first use)."""
    from . import triton_indexer

    return triton_indexer.index_scores(*args, **kwargs)


# The indexer's scores: triton_indexer.py's kernel, "auto" on CUDA (tests add the CPU under
# Triton's interpreter) where it takes the indexer's tensors; else lightning_index_scores.
registry.declare(registry.Op(
    "index_scores",
    backends={"pytorch": registry.Backend("pytorch", lightning_index_scores),
              "triton": registry.Backend("triton", _triton_index_scores,
                                         unsupported=indexer_kernels_refusal, auto_devices=("cuda",))},
    auto=("triton", "pytorch"),
    facts=lambda index_q, index_k, *args: registry.Facts(
        device=index_q.device, dtype=index_q.dtype, extra=indexer_facts(index_q, index_k)),
))


def _scores_function(index_q, index_k):
    """The function of the indexer scores' backend that "auto" runs these tensors on
    (``index_scores``): ``triton_indexer.index_scores``, or ``lightning_index_scores`` (the
    same scores, with ``[B, c, HI, S]`` products in PyTorch)."""
    facts = registry.get("index_scores").facts(index_q, index_k)
    if registry.choose("index_scores", registry.AUTO, facts) == "triton":
        from . import triton_indexer

        return triton_indexer.index_scores
    return lightning_index_scores


@torch.no_grad()
def select_keys(index_q, index_k, index_weights, *, top_k, cu_seqlens=None,
                keys: Keys | None = None) -> torch.Tensor:
    """Same contract as ``dsa_select_reference``: ``[B, T, min(top_k, S)]``, -1 for no key;
    ``keys`` (default: :func:`causal_keys`) says which of the S keys of index_k each query
    may choose."""
    batch, seq_len, index_heads, _ = index_q.shape
    count = min(top_k, index_k.shape[1])
    keys = causal_keys(cu_seqlens, seq_len) if keys is None else keys
    selected = torch.empty(batch, seq_len, count, dtype=torch.int32, device=index_q.device)
    if count == 0:
        return selected
    scores_of = _scores_function(index_q, index_k)
    per_query = index_k.shape[1] * (_FUSED_VALUES if scores_of is not lightning_index_scores
                                    else index_heads)
    for start, end in _query_chunks(seq_len, batch, per_query, index_q.device):
        key_len = max(keys.reach(end), count)  # keys beyond the chunk's reach are never chosen
        scores = scores_of(index_q[:, start:end], index_k[:, :key_len],
                           index_weights[:, start:end])
        allowed = _allowed(keys.rule, start, end, key_len, index_q.device)
        selected[:, start:end] = top_k_keys(scores.masked_fill_(~allowed, float("-inf")), count)
    return selected


def _attention_chunk(q, k, v, selected, sink, scale):
    probs = _probs(q, _gather(k, selected), selected >= 0, sink, scale)
    out = torch.einsum("bcngs,bcsnd->bcngd", probs, _gather(v, selected).float())
    return out.flatten(2, 3)


def selected_attention(q, k, v, selected, *, sink=None, scale=None) -> torch.Tensor:
    """Same contract as ``dsa_attention_reference``."""
    batch, seq_len, heads, dim = q.shape
    kv_heads = k.shape[2]
    scale = dim ** -0.5 if scale is None else scale
    per_query = selected.shape[-1] * (heads + 2 * kv_heads * dim)
    outputs = [_maybe_checkpoint(_attention_chunk, q[:, start:end], k, v,
                                 selected[:, start:end], sink, scale)
               for start, end in _query_chunks(seq_len, batch, per_query, q.device)]
    return torch.cat(outputs, dim=1).to(v.dtype)


@dataclass(frozen=True)
class QueryShares:
    """The indexer loss's queries split among R processes that hold the whole sequence, each
    for its own group of the heads (context parallelism by all-to-all over heads), so that the
    loss's target, the attention summed over every head, is reduce-scattered by query rows
    rather than all-reduced: each process gets the summed target of its own share of the
    queries only and computes the loss of those.

    ``positions [R, n]``: the positions in the sequence of each process's n queries, the same
    on every process; ``rank``: this process's row. ``reduce_scatter(x [R, B, c, S])`` ->
    ``[B, c, S]``: the sum over the processes of their ``x[rank]`` (no gradient)."""

    positions: torch.Tensor
    rank: int
    reduce_scatter: Callable[[torch.Tensor], torch.Tensor]

    @property
    def mine(self) -> torch.Tensor:
        """``[n]``: the positions of this process's queries."""
        return self.positions[self.rank]


def _chunk_target(q, k, queries, selected, rule, sink, scale, shares, reduce_heads,
                  mass_kernel=None, lse=None):
    """The loss target of a chunk, without gradient: the main attention's mass over the keys,
    summed over the heads of every process, ``[B, c, S]`` for this process's ``c`` queries of
    the chunk. ``queries [R, c]``: the chunk's queries of every process (R = 1 without
    ``shares``); keys: the selected ones (by ``mass_kernel`` when given, with the attention's
    ``lse [B, T, Hq]`` where given, else gathered), else those of k that ``rule`` allows."""
    rows = queries.flatten()
    if selected is None:
        allowed = rule(0, 0, rows[:, None], torch.arange(k.shape[1], device=q.device))[None]
    else:
        chosen = selected[:, rows]
    with torch.no_grad():
        if selected is not None and mass_kernel is not None:
            mass = mass_kernel(q[:, rows], k, chosen, sink=sink, scale=scale,
                               lse=None if lse is None else lse[:, rows])
        else:
            if selected is not None:
                allowed, k = chosen >= 0, _gather(k, chosen)
            mass = _probs(q[:, rows], k, allowed, sink, scale).sum((2, 3))  # [B, R c, S]
        if shares is not None:  # each process's rows: the sum over the processes' heads
            mass = shares.reduce_scatter(mass.unflatten(1, queries.shape).movedim(1, 0))
        if reduce_heads is not None:
            mass = reduce_heads(mass)
    return mass


def _chunk_kl(target, positions, index_q, index_k, index_weights, selected, rule):
    """Summed KL of the queries at ``positions [c]`` (``index_q``, ``index_weights``: theirs)
    to their ``target``: over their selected keys, or, with ``selected`` None, over the keys
    ``rule`` allows among those of index_k."""
    if selected is None:
        keys = torch.arange(index_k.shape[1], device=index_k.device)
        allowed = rule(0, 0, positions[:, None], keys)[None]
    else:
        allowed, index_k = selected >= 0, _gather(index_k, selected)
    logits = lightning_index_scores(index_q, index_k, index_weights)
    return indexer_kl(target, logits, allowed.expand_as(logits))


def _loss_chunk(q, k, queries, selected, rule, sink, scale, shares, reduce_heads, index_q,
                index_k, index_weights):
    """:func:`_chunk_target` then :func:`_chunk_kl`: the chunk's loss from its inputs (the
    target recomputed, with its collectives, when checkpointing reruns it in backward)."""
    target = _chunk_target(q, k, queries, selected, rule, sink, scale, shares, reduce_heads)
    mine = queries[0 if shares is None else shares.rank]
    chosen = None if selected is None else selected[:, mine]
    return _chunk_kl(target, mine, index_q, index_k, index_weights, chosen, rule)


def indexer_loss(q, k, index_q, index_k, index_weights, *, selected=None, cu_seqlens=None,
                 sink=None, scale=None, reduce_heads=None, keys: Keys | None = None,
                 shares: QueryShares | None = None, kernels=None, lse=None) -> torch.Tensor:
    """Same contract as ``dsa_indexer_loss_reference``; without ``selected``, over the keys
    that ``keys`` (default: :func:`causal_keys`) allows.

    With ``shares`` (q, k, selected: the whole sequence, for this process's heads), this
    process's share of that loss (the shares sum to it): index_q and index_weights are those of
    its queries, ``shares.mine``, and the target of those is reduce-scattered from every
    process's heads (then summed by ``reduce_heads`` too, if given).

    The sparse stage keeps each chunk's target for backward when it was reduced over
    processes (``shares`` or ``reduce_heads``), so that backward repeats no collective: it
    costs ``[B, n, K]`` fp32, a fraction of ``selected``. The dense warm-up's target, over up
    to every key, is recomputed in backward with the chunk, and with it its collectives.

    ``kernels`` (triton.py's module, where its kernels run the call) computes the sparse stage
    without chunks: the target of every query at once with its ``selected_mass`` (``[B, n, K]``
    fp32, kept for backward), then the loss over it with its ``selected_indexer_kl``; ``lse``
    (``[B, T, Hq]``, the attention's log-sum-exp where it gave one) spares that target's kernel
    computing it again. The other paths do not use it."""
    batch, seq_len, heads, dim = q.shape
    q, k = q.detach(), k.detach()
    sink = None if sink is None else sink.detach()
    scale = dim ** -0.5 if scale is None else scale
    index_heads, index_dim = index_q.shape[2:]
    keys = causal_keys(cu_seqlens, seq_len) if keys is None else keys
    if shares is None:
        positions = torch.arange(seq_len, device=q.device)[None]
    else:
        positions = shares.positions.to(q.device)
        shares = QueryShares(positions, shares.rank, shares.reduce_scatter)
    processes, count = positions.shape
    if kernels is not None and selected is not None:
        target = _chunk_target(q, k, positions, selected, keys.rule, sink, scale, shares,
                               reduce_heads, kernels.selected_mass, lse)
        mine = positions[0 if shares is None else shares.rank]
        return kernels.selected_indexer_kl(target, index_q, index_k, index_weights,
                                           selected[:, mine]) / (batch * seq_len)
    if selected is None:
        per_query = k.shape[1] * (processes * heads + index_heads)
    else:
        per_query = selected.shape[-1] * (processes * (heads + k.shape[2] * dim)
                                          + index_heads + index_dim)
    hold = selected is not None and (shares is not None or reduce_heads is not None)
    if selected is None:  # on the host, once: the last query of each column of positions
        last = positions.amax(0).tolist()
    total = q.new_zeros((), dtype=torch.float32)
    for start, end in _query_chunks(count, batch, per_query, q.device):
        queries = positions[:, start:end]
        # The dense warm-up's chunk reads the keys within its reach; the sparse one gathers.
        reach = slice(None)
        if selected is None:
            reach = slice(0, keys.reach(max(last[start:end]) + 1))
        if reach.stop == 0:  # no key for any query of the chunk: nothing to learn
            continue
        own = (index_q[:, start:end], index_k[:, reach], index_weights[:, start:end])
        if hold:
            target = _chunk_target(q, k, queries, selected, keys.rule, sink, scale, shares,
                                   reduce_heads)
            mine = queries[0 if shares is None else shares.rank]
            total = total + _maybe_checkpoint(_chunk_kl, target, mine, own[0], own[1], own[2],
                                              selected[:, mine], keys.rule)
        else:
            total = total + _maybe_checkpoint(_loss_chunk, q, k[:, reach], queries, selected,
                                              keys.rule, sink, scale, shares, reduce_heads, *own)
    return total / (batch * seq_len)
