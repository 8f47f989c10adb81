"""Dense fp32 definitions of the windowed, sink and sparse softmax attentions: the oracles.

Each function writes out the boolean mask of the keys every query may attend to, as a full
``[B, H, T, S]`` tensor, and runs one masked softmax over it. They are written for clarity, not
speed; every efficient path in this package is tested against them.

Layout: q ``[B, T, Hq, D]``, k and v ``[B, S, Hkv, D]`` with Hq a multiple of Hkv (query head h
reads key/value head ``h // (Hq / Hkv)``); query t and key t are the same token. Results come
back in v's dtype. A query that may attend to no key gets a zero output.

Sliding windows follow Megatron's (and FlashAttention's) ``(left, right)`` convention: query t
sees keys ``t - left .. t + right``; -1 means unbounded; causal attention caps right at 0.

DSA selects keys per token, not per block: ``selected [B, T, K]`` (int32; the largest tensor
DSA keeps for backward) lists the keys of each query (-1: none), shared by all heads.

DeepSeek-V4's CSA and HCA attend to compressed entries, one per block of ``rate`` tokens of
each sequence, besides a sliding window of raw tokens: the entries are extra keys (and values)
after the T raw ones, entry i visible once its block is complete.
"""
import math

import torch

__all__ = [
    "OP", "check_qkv", "masked_attention", "window_mask", "document_mask",
    "softmax_attention_reference", "moba_attention_reference", "compress_reference",
    "nsa_attention_reference", "exclusive_self_attention", "chosen_blocks", "causal_mask",
    "lightning_index_scores", "top_k_keys", "selected_mask", "dsa_select_reference",
    "dsa_attention_reference", "indexer_kl", "dsa_indexer_loss_reference",
    "compress_kv_reference", "compressed_visibility", "compressed_attention_reference",
    "csa_select_reference", "csa_attention_reference", "csa_indexer_loss_reference",
    "keys_with_entries",
]

OP = "sparse attention"


def check_qkv(op: str, q, k, v) -> None:
    """Raise ValueError, naming the argument and the expected shape, if q, k, v do not fit."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4 or not tensor.is_floating_point():
            raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)} and dtype "
                             f"{tensor.dtype}, expected a floating-point [B, T, H, D] tensor")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"{op}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"[B, S, Hkv, D] with B, D = {q.shape[0]}, {q.shape[3]} as in q")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{op}: q has {q.shape[2]} heads, not a multiple of the {k.shape[2]} "
                         "key/value heads")


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[B, S, Hkv, D]`` -> fp32 ``[B, heads, S, D]``, each key/value head repeated for its
    query heads."""
    return x.float().repeat_interleave(heads // x.shape[2], dim=2).transpose(1, 2)


def forget_bias(log_forget: torch.Tensor) -> torch.Tensor:
    """The Forgetting Transformer's logit bias ``[B, Hq, T, T]`` (fp32) from the log forget gates
    ``[B, T, Hq]``: ``D_ij = sum_{j < l <= i} log f_l = c_i - c_j`` with ``c = cumsum(log f)``
    (meaningful for keys j <= i; packed sequences may share one cumsum, since their queries see
    no key of another sequence)."""
    c = log_forget.float().cumsum(1).transpose(1, 2)  # [B, Hq, T]
    return c[..., :, None] - c[..., None, :]


def _masked_probs(q, k, allowed, sink, scale, bias=None):
    """fp32 attention probabilities ``[B, Hq, T, S]``, zero outside ``allowed``; with a sink,
    each row sums to less than 1; ``bias`` (broadcastable to the scores) is added to the
    scaled logits."""
    batch, seq_len, heads, dim = q.shape
    scale = dim ** -0.5 if scale is None else scale
    scores = q.float().transpose(1, 2) @ _heads(k, heads).transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias
    allowed = allowed.expand_as(scores)
    scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
    if sink is not None:  # one more logit per head in the denominator, with a zero value
        sink_column = sink.float().view(1, heads, 1, 1).expand(batch, heads, seq_len, 1)
        scores = torch.cat([scores, sink_column], dim=-1)
    return scores.softmax(-1)[..., : allowed.shape[-1]] * allowed


def _masked_attention_fp32(q, k, v, allowed, sink, scale, bias=None):
    probs = _masked_probs(q, k, allowed, sink, scale, bias)
    return (probs @ _heads(v, q.shape[2])).transpose(1, 2)  # [B, T, Hq, D]


def masked_attention(q, k, v, allowed, *, sink=None, scale=None, bias=None):
    """``softmax(q k^T * scale (+ bias) over the allowed keys) v``; with ``sink [Hq]``, the
    learnable sink of StreamingLLM / gpt-oss: ``exp(sink_h)`` joins each row's denominator,
    i.e. ``p_ts = exp(z_ts) / (sum_allowed exp(z_ts') + exp(sink_h))``. ``allowed``: bool,
    broadcastable to ``[B, Hq, T, S]``, as is ``bias`` (fp32). scale defaults to
    ``D ** -0.5``."""
    return _masked_attention_fp32(q, k, v, allowed, sink, scale, bias).to(v.dtype)


def window_mask(seq_len: int, key_len: int, *, causal: bool = True, window=None,
                device=None) -> torch.Tensor:
    """``[T, S]`` bool: which keys each query sees under a causal mask and/or a sliding window
    ``(left, right)``."""
    offset = (torch.arange(key_len, device=device)[None, :]
              - torch.arange(seq_len, device=device)[:, None])
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    allowed = torch.ones(seq_len, key_len, dtype=torch.bool, device=device)
    if left >= 0:
        allowed &= offset >= -left
    if right >= 0:
        allowed &= offset <= right
    return allowed


def document_mask(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[T, T]`` bool: query and key lie in the same of the sequences packed along T."""
    positions = torch.arange(total, device=cu_seqlens.device)
    ids = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    return ids[:, None] == ids[None, :]


def softmax_attention_reference(q, k, v, *, causal=True, window=None, sink=None, scale=None,
                                cu_seqlens=None, allowed=None, log_forget=None):
    """Softmax attention with an optional sliding window, sink, packed sequences
    (``cu_seqlens``, B == 1), extra mask ``allowed`` (bool ``[B | 1, Hq | 1, T, S]``) and the
    Forgetting Transformer's forget gates (``log_forget``, see :func:`forget_bias`)."""
    check_qkv(OP, q, k, v)
    mask = window_mask(q.shape[1], k.shape[1], causal=causal, window=window, device=q.device)
    if cu_seqlens is not None:
        mask = mask & document_mask(cu_seqlens, q.shape[1])
    if allowed is not None:
        mask = mask & allowed
    bias = None if log_forget is None else forget_bias(log_forget)
    return masked_attention(q, k, v, mask, sink=sink, scale=scale, bias=bias)


def chosen_blocks(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """bool mask of the ``top_k`` highest-scoring blocks per row; ``-inf`` marks a block that
    cannot be chosen, ``+inf`` one that must be."""
    # unsorted: the set is all that matters, and sorting it costs time
    top = scores.topk(min(top_k, scores.shape[-1]), dim=-1, sorted=False)
    chosen = torch.zeros_like(scores, dtype=torch.bool)
    return chosen.scatter(-1, top.indices, top.values > float("-inf"))


def moba_attention_reference(q, k, v, *, block_size, top_k, window=None, sink=None, scale=None,
                             allowed=None):
    """MoBA, Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs" (2025).

    The keys are cut into blocks of ``block_size`` tokens. Query t (per head) scores each block
    that ends before t's own block by ``q_t . mean(keys of the block)``, keeps the ``top_k - 1``
    best of them and always its own block, and attends causally to the tokens of the kept
    blocks (intersected with the sliding window and ``allowed``, when given).
    """
    check_qkv(OP, q, k, v)
    seq_len, heads = q.shape[1], q.shape[2]
    num_blocks = math.ceil(seq_len / block_size)
    block_means = torch.stack([k[:, j * block_size:(j + 1) * block_size].float().mean(1)
                               for j in range(num_blocks)], dim=1)  # [B, n, Hkv, D]
    gate = q.float().transpose(1, 2) @ _heads(block_means, heads).transpose(-1, -2)
    own_block = torch.arange(seq_len, device=q.device) // block_size  # [T]
    blocks = torch.arange(num_blocks, device=q.device)
    gate = gate.masked_fill(blocks[None, :] > own_block[:, None], float("-inf"))  # not yet done
    gate = gate.masked_fill(blocks[None, :] == own_block[:, None], float("inf"))  # own block
    chosen = chosen_blocks(gate, top_k)  # [B, Hq, T, n]
    mask = chosen[..., own_block] & window_mask(seq_len, seq_len, window=window, device=q.device)
    if allowed is not None:
        mask = mask & allowed
    return masked_attention(q, k, v, mask, sink=sink, scale=scale)


def compress_reference(x: torch.Tensor, weights: torch.Tensor, block: int, stride: int):
    """NSA's compressed tokens: ``x [B, T, H, D]`` -> ``[B, N, H, D]``, entry i the weighted sum
    ``sum_p weights[h, p] * x[i * stride + p]`` over the block of ``block`` tokens starting at
    ``i * stride``, for every block that fits in T."""
    count = (x.shape[1] - block) // stride + 1 if x.shape[1] >= block else 0
    pooled = [torch.einsum("bphd,hp->bhd", x[:, i * stride:i * stride + block].float(),
                           weights.float()) for i in range(count)]
    if not pooled:
        return x.new_zeros(x.shape[0], 0, x.shape[2], x.shape[3], dtype=torch.float32)
    return torch.stack(pooled, dim=1)


def nsa_attention_reference(q, k, v, gates, k_weights, v_weights, *, compress_block,
                            compress_stride, select_block, select_top_k, window, sink=None,
                            scale=None):
    """NSA, Yuan et al., "Native Sparse Attention: Hardware-Aligned and Natively Trainable
    Sparse Attention" (2025): three attention branches over one query, summed with per-token
    sigmoid gates ``gates [B, T, Hq, 3]`` (compressed, selected, window; already in (0, 1)).

    - compressed: keys and values pooled over blocks of ``compress_block`` tokens every
      ``compress_stride`` tokens with per-head position weights ``k_weights`` / ``v_weights``
      ``[Hkv, compress_block]`` (:func:`compress_reference`); query t sees the blocks that end
      at or before t.
    - selected: the keys are cut into blocks of ``select_block`` tokens. A block's importance
      for query t is the compressed branch's attention probability (no sink) of each compressed
      block, spread evenly over that block's tokens and summed over the block's tokens, then
      summed over the query heads of a key/value group, which share one selection (eq. 9 of the
      paper shares a compressed block's probability among the selection blocks it overlaps in
      the same proportion). The first block and the 2 blocks ending at t's (t's own
      and the one before) are always kept; the best others fill ``select_top_k`` blocks in all.
      Attention over their tokens is causal.
    - window: the last ``window`` tokens, t's own included.

    Every branch has its own softmax (with the sink, when given).
    """
    check_qkv(OP, q, k, v)
    batch, seq_len, heads, _ = q.shape
    kv_heads = k.shape[2]
    group = heads // kv_heads
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    positions = torch.arange(seq_len, device=q.device)

    compressed_k = compress_reference(k, k_weights, compress_block, compress_stride)
    compressed_v = compress_reference(v, v_weights, compress_block, compress_stride)
    starts = torch.arange(compressed_k.shape[1], device=q.device) * compress_stride
    ends = starts + compress_block - 1
    sees_compressed = ends[None, :] <= positions[:, None]  # [T, N]
    out_compressed = _masked_attention_fp32(q, compressed_k, compressed_v, sees_compressed, sink,
                                            scale)

    # Importance of the selection blocks, from the compressed branch's probabilities.
    scores = q.float().transpose(1, 2) @ _heads(compressed_k, heads).transpose(-1, -2) * scale
    scores = scores.masked_fill(~sees_compressed, torch.finfo(torch.float32).min)
    probs = scores.softmax(-1) * sees_compressed  # rows with nothing visible are all zero
    num_select = math.ceil(seq_len / select_block)
    token_share = torch.zeros(compressed_k.shape[1], seq_len, device=q.device)
    for i, start in enumerate(starts.tolist()):
        token_share[i, start:start + compress_block] = 1 / compress_block
    block_of_token = positions // select_block
    overlap = torch.zeros(seq_len, num_select, device=q.device)
    overlap[positions, block_of_token] = 1.0
    importance = probs @ token_share @ overlap  # [B, Hq, T, n]
    importance = importance.unflatten(1, (kv_heads, group)).sum(2)  # [B, Hkv, T, n]

    blocks = torch.arange(num_select, device=q.device)
    own = block_of_token[:, None]
    must = (blocks[None, :] == 0) | (blocks[None, :] == own) | (blocks[None, :] == own - 1)
    importance = importance.masked_fill(blocks[None, :] > own, float("-inf"))
    importance = importance.masked_fill(must & (blocks[None, :] <= own), float("inf"))
    chosen = chosen_blocks(importance, select_top_k)  # [B, Hkv, T, n]
    sees_selected = chosen[..., block_of_token] & window_mask(seq_len, seq_len, device=q.device)
    out_selected = _masked_attention_fp32(q, k, v, sees_selected.repeat_interleave(group, 1),
                                          sink, scale)

    sees_window = window_mask(seq_len, seq_len, window=(window - 1, 0), device=q.device)
    out_window = _masked_attention_fp32(q, k, v, sees_window, sink, scale)

    gates = gates.float()
    out = (gates[..., 0:1] * out_compressed + gates[..., 1:2] * out_selected
           + gates[..., 2:3] * out_window)
    return out.to(v.dtype)


def causal_mask(seq_len: int, cu_seqlens=None, device=None) -> torch.Tensor:
    """``[T, T]`` bool: causal, and within one sequence of a pack when ``cu_seqlens`` is given."""
    mask = window_mask(seq_len, seq_len, device=device)
    if cu_seqlens is not None:
        mask = mask & document_mask(cu_seqlens, seq_len)
    return mask


def lightning_index_scores(index_q, index_k, index_weights) -> torch.Tensor:
    """DSA's lightning indexer (DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large
    Language Models", arXiv 2512.02556, sec. 2.1): ``I[t, s] = sum_j w[t, j] relu(q[t, j] . k[s])``
    over the indexer heads j, in fp32.

    index_q ``[B, T, HI, DI]``, index_weights ``[B, T, HI]``; index_k ``[B, S, DI]`` (one key per
    token, shared by the heads and by every query) -> ``[B, T, S]``, or ``[B, T, S, DI]`` (the
    keys each query scores, already gathered) -> ``[B, T, S]``.
    """
    pattern = "bthd,bsd->bths" if index_k.dim() == 3 else "bthd,btsd->bths"
    dots = torch.einsum(pattern, index_q.float(), index_k.float()).relu()
    return torch.einsum("bths,bth->bts", dots, index_weights.float())


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """int32 that orders as the fp32 ``x`` does (-0.0 made +0.0, so that the two tie): the
    magnitude bits of negative floats flipped."""
    bits = (x.float() + 0.0).contiguous().view(torch.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


# A key never chosen. On the CPU by name: this module may first be imported under a default
# device such as "meta" (presets.parameter_count builds models there), where .item() fails.
_ORDERED_MINUS_INF = _ordered_bits(torch.tensor(float("-inf"), device="cpu")).item()


def top_k_keys(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """int32 indices ``[..., K]`` of the ``K = min(top_k, S)`` highest scores of each row, in no
    particular order (ties go to the earlier key, so that every path picks the same set); -1 in
    the slots of a row that has fewer than K keys that may be chosen (score above ``-inf``).

    One unsorted ``topk`` over the fp32 scores picks the set wherever no tie crosses its
    threshold (the K-th score): exactly K scores at or above it, or a row without K choosable
    keys. The rows where more scores equal the threshold than the set has room for (ReLU makes
    exact ties at 0 possible) take :func:`_ordered_top_k` instead, whose order is exact. On an
    H200, for 1024 queries of DSA's selection over 9216 keys (K = 2048, random indexer inputs, no
    tied row), :func:`_ordered_top_k` on every row takes about twice as long (the selection as a
    whole: ``benchmarks/dsa_stages.py``)."""
    key_len = scores.shape[-1]
    count = min(top_k, key_len)
    if count == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.int32, device=scores.device)
    values, indices = scores.topk(count, dim=-1, sorted=False)
    threshold = values.amin(-1, keepdim=True)
    chosen = indices.int().masked_fill(values == float("-inf"), -1)
    exact = (threshold == float("-inf")) | ((scores >= threshold).sum(-1, keepdim=True) == count)
    tied = ~exact.squeeze(-1)
    if tied.any():  # reads one flag back to the host
        chosen[tied] = _ordered_top_k(scores[tied], count)
    return chosen


def _ordered_top_k(scores: torch.Tensor, count: int) -> torch.Tensor:
    """:func:`top_k_keys` of rows ``[R, S]``, best first: one ``topk`` over int64 keys
    ``(ordered score bits << 32) | (S - 1 - index)``, distinct for every key of a row, so that
    the order, ties included, is exact and deterministic without a full stable sort."""
    key_len = scores.shape[-1]
    reverse = key_len - 1 - torch.arange(key_len, device=scores.device)
    keys = (_ordered_bits(scores).long() << 32) | reverse
    top = keys.topk(count, dim=-1).values
    indices = (key_len - 1 - (top & 0xFFFFFFFF)).int()
    return indices.masked_fill((top >> 32) == _ORDERED_MINUS_INF, -1)


def selected_mask(selected: torch.Tensor, key_len: int) -> torch.Tensor:
    """``[B, T, S]`` bool: the keys listed in ``selected [B, T, K]`` (-1: no key)."""
    index = torch.where(selected < 0, key_len, selected).long()  # -1: a column dropped below
    mask = torch.zeros(*selected.shape[:2], key_len + 1, dtype=torch.bool,
                       device=selected.device)
    return mask.scatter(-1, index, True)[..., :key_len]


def dsa_select_reference(index_q, index_k, index_weights, *, top_k, cu_seqlens=None):
    """DSA's selection ``[B, T, K]``: each query's ``top_k`` causal keys (its own sequence of a
    pack) by :func:`lightning_index_scores`; all of them and -1 in the other slots, when it has
    fewer (in no particular order: :func:`top_k_keys`)."""
    scores = lightning_index_scores(index_q, index_k, index_weights)
    allowed = causal_mask(index_q.shape[1], cu_seqlens, index_q.device)
    return top_k_keys(scores.masked_fill(~allowed, float("-inf")), top_k)


def dsa_attention_reference(q, k, v, selected, *, sink=None, scale=None):
    """DSA's sparse attention: each query attends to exactly its ``selected [B, T, K]`` keys
    (shared by all heads), with the sink and scale of :func:`masked_attention`."""
    check_qkv(OP, q, k, v)
    allowed = selected_mask(selected, k.shape[1])[:, None]
    return masked_attention(q, k, v, allowed, sink=sink, scale=scale)


def indexer_kl(attention_mass, index_logits, allowed, reduce_heads=None) -> torch.Tensor:
    """``sum_t KL(p_t || softmax(I_t))`` over the allowed keys of each query: p is the main
    attention's probability summed over heads (``attention_mass``, no gradient), summed over
    the heads held elsewhere by ``reduce_heads`` (tensor parallelism) and L1-normalised.
    ``attention_mass``, ``index_logits``, ``allowed``: ``[..., T, S]``."""
    if reduce_heads is not None:
        attention_mass = reduce_heads(attention_mass)
    target = attention_mass / attention_mass.sum(-1, keepdim=True).clamp_min(
        torch.finfo(torch.float32).tiny)
    # The most negative float, not -inf: a row with no allowed key (a CSA query before its first
    # complete block) then has finite log-probabilities, all masked, and a zero gradient.
    log_probs = index_logits.masked_fill(~allowed, torch.finfo(torch.float32).min).log_softmax(-1)
    return (torch.xlogy(target, target) - target * log_probs.masked_fill(~allowed, 0.0)).sum()


def _indexer_loss_reference(q, k, index_q, index_k, index_weights, allowed, sink, scale,
                            reduce_heads):
    """Mean over the B * T queries of ``KL(p_t || softmax(I_t))`` over the keys ``allowed``
    ``[B | 1, T, S]``; p the main attention of q, k (no gradient) summed over heads."""
    with torch.no_grad():
        mass = _masked_probs(q, k, allowed[:, None], sink, scale).sum(1)
    logits = lightning_index_scores(index_q, index_k, index_weights)
    allowed = allowed.expand_as(logits)
    return indexer_kl(mass, logits, allowed, reduce_heads) / (q.shape[0] * q.shape[1])


def dsa_indexer_loss_reference(q, k, index_q, index_k, index_weights, *, selected=None,
                               cu_seqlens=None, sink=None, scale=None, reduce_heads=None):
    """The indexer's training loss of DSA (arXiv 2512.02556, sec. 2.1), averaged over the
    queries: ``KL(p_t || softmax(I_t))`` with p the main attention (q, k, sink, scale; no
    gradient reaches them) summed over heads and L1-normalised. Dense warm-up
    (``selected=None``): over all causal keys; sparse training: over the selected keys only,
    where both distributions are renormalised."""
    check_qkv(OP, q, k, k)
    if selected is None:
        allowed = causal_mask(q.shape[1], cu_seqlens, q.device)[None]
    else:
        allowed = selected_mask(selected, k.shape[1])
    return _indexer_loss_reference(q, k, index_q, index_k, index_weights, allowed, sink, scale,
                                   reduce_heads)


# ---------------------------------------------------------------- DeepSeek-V4 CSA and HCA
def _sequences(seq_len: int, cu_seqlens) -> list[tuple[int, int]]:
    """``(first, end)`` token ranges of the sequences along T (one without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return [(0, seq_len)]
    bounds = [int(b) for b in cu_seqlens]
    return list(zip(bounds[:-1], bounds[1:]))


def compress_kv_reference(kv, gate, position_bias, *, rate, overlap, cu_seqlens=None):
    """DeepSeek-V4's token-level KV compression (DeepSeek-AI, "DeepSeek-V4: Towards Highly
    Efficient Million-Token Context Intelligence", arXiv 2606.19348, sec. 2.3.1): one entry per
    complete block of ``rate`` tokens of each sequence (``cu_seqlens``, B == 1: blocks counted
    from each sequence's start; the tokens after the last complete block give none).

    kv, gate ``[B, T, H, C]``: per token, the compression's values and its weight logits;
    position_bias ``[H, rate, C]``: a learned logit per position in the block. Entry i (block i,
    tokens ``i*rate .. (i+1)*rate - 1`` of its sequence), per head and channel:

    - ``overlap=False`` (HCA, C = D): ``c_i = sum_{j in block i} s_j kv_j`` with
      ``s = softmax_j(gate_j + bias[j - i*rate])`` over the block's ``rate`` tokens;
    - ``overlap=True`` (CSA, C = 2D): the entry mixes two adjacent blocks, ``c_i =
      sum_{j in block i} s^a_j kv^a_j + sum_{j in block i-1} s^b_j kv^b_j`` with ``[s^a; s^b]``
      one softmax over the 2 * rate slots of ``[gate^a + bias^a; gate^b + bias^b]``. Channels
      ``[D:]`` are the a series (of the entry's own block), ``[:D]`` the b series (what a block
      lends to the next block's entry), as in V4's code; the first block of a sequence has no
      block before it, whose slots are left out.

    The softmax runs over tokens separately for every channel. -> ``[B, N, H, D]``, the entries
    of all sequences in order, in kv's dtype.
    """
    dim = kv.shape[-1] // (2 if overlap else 1)
    bias = position_bias.float().transpose(0, 1)  # [rate, H, C]
    entries = []
    for first, end in _sequences(kv.shape[1], cu_seqlens):
        for i in range((end - first) // rate):
            own = slice(first + i * rate, first + (i + 1) * rate)
            logits = gate[:, own, :, -dim:].float() + bias[..., -dim:]
            values = kv[:, own, :, -dim:].float()
            if overlap and i > 0:
                before = slice(own.start - rate, own.start)
                logits = torch.cat([gate[:, before, :, :dim].float() + bias[..., :dim], logits], 1)
                values = torch.cat([kv[:, before, :, :dim].float(), values], 1)
            entries.append((logits.softmax(1) * values).sum(1))
    if not entries:
        return kv.new_zeros(kv.shape[0], 0, kv.shape[2], dim)
    return torch.stack(entries, dim=1).to(kv.dtype)


def compressed_visibility(seq_len: int, rate: int, cu_seqlens=None, device=None) -> torch.Tensor:
    """``[T, N]`` bool: which compressed entries (:func:`compress_kv_reference`) each query
    sees. Query t, at position p of its sequence, sees entry i of its own sequence iff the
    entry's block is complete at t: ``(i + 1) * rate - 1 <= p``, i.e. ``i < (p + 1) // rate``
    (V4's rule: the last token of a block already sees that block's entry)."""
    columns = []
    tokens = torch.arange(seq_len, device=device)[:, None]
    for first, end in _sequences(seq_len, cu_seqlens):
        ends = first + (torch.arange((end - first) // rate, device=device) + 1) * rate - 1
        columns.append((ends[None, :] <= tokens) & (tokens >= first) & (tokens < end))
    return torch.cat(columns, dim=1)


def _window_keys(seq_len: int, window: int, cu_seqlens, device) -> torch.Tensor:
    """``[T, T]`` bool: the last ``window`` tokens of each query's sequence, its own included."""
    mask = window_mask(seq_len, seq_len, window=(window - 1, 0), device=device)
    return mask if cu_seqlens is None else mask & document_mask(cu_seqlens, seq_len)


def keys_with_entries(k, v, compressed_k, compressed_v):
    """Raw keys and values followed by the compressed entries: ``[B, T + N, Hkv, D]`` each."""
    return (torch.cat([k, compressed_k.to(k.dtype)], dim=1),
            torch.cat([v, compressed_v.to(v.dtype)], dim=1))


def compressed_attention_reference(q, k, v, compressed_k, compressed_v, *, rate, window,
                                   sink=None, scale=None, cu_seqlens=None):
    """HCA's attention (arXiv 2606.19348, sec. 2.3.2), also CSA's in its dense warm-up: one
    softmax (with the sink) per query over the last ``window`` raw tokens of its sequence (its
    own included; keys k, values v) and every compressed entry it sees
    (:func:`compressed_visibility`; keys ``compressed_k``, values ``compressed_v``
    ``[B, N, Hkv, D]``, the same entries, the keys with RoPE where the layer has it)."""
    check_qkv(OP, q, k, v)
    seq_len = q.shape[1]
    mask = torch.cat([_window_keys(seq_len, window, cu_seqlens, q.device),
                      compressed_visibility(seq_len, rate, cu_seqlens, q.device)], dim=1)
    return masked_attention(q, *keys_with_entries(k, v, compressed_k, compressed_v), mask,
                            sink=sink, scale=scale)


def csa_select_reference(index_q, index_k, index_weights, *, rate, top_k, cu_seqlens=None):
    """CSA's selection (arXiv 2606.19348, sec. 2.3.1) ``[B, T, min(top_k, N)]``: each query's
    ``top_k`` visible compressed entries by the lightning indexer's score over the indexer's
    own compressed keys ``index_k [B, N, DI]``; all of them and -1 in the other slots, when it
    sees fewer (in no particular order)."""
    scores = lightning_index_scores(index_q, index_k, index_weights)
    allowed = compressed_visibility(index_q.shape[1], rate, cu_seqlens, index_q.device)
    return top_k_keys(scores.masked_fill(~allowed, float("-inf")), top_k)


def csa_attention_reference(q, k, v, compressed_k, compressed_v, selected, *, window, sink=None,
                            scale=None, cu_seqlens=None):
    """CSA's attention (arXiv 2606.19348, sec. 2.3.1): as
    :func:`compressed_attention_reference`, with the entries each query ``selected``
    ``[B, T, K]`` (-1: none) in place of all it sees."""
    check_qkv(OP, q, k, v)
    seq_len = q.shape[1]
    raw = _window_keys(seq_len, window, cu_seqlens, q.device).expand(q.shape[0], -1, -1)
    mask = torch.cat([raw, selected_mask(selected, compressed_k.shape[1])], dim=-1)
    return masked_attention(q, *keys_with_entries(k, v, compressed_k, compressed_v), mask[:, None],
                            sink=sink, scale=scale)


def csa_indexer_loss_reference(q, compressed_k, index_q, index_k, index_weights, *, rate,
                               selected=None, cu_seqlens=None, sink=None, scale=None,
                               reduce_heads=None):
    """CSA's indexer loss: DSA's (:func:`dsa_indexer_loss_reference`) over compressed entries,
    the target being the main attention of q over the entries' keys ``compressed_k`` alone
    (as Megatron's CSA prototype does): over every entry each query sees
    (``selected=None``, dense warm-up) or over its selected ones."""
    check_qkv(OP, q, compressed_k, compressed_k)
    if selected is None:
        allowed = compressed_visibility(q.shape[1], rate, cu_seqlens, q.device)[None]
    else:
        allowed = selected_mask(selected, compressed_k.shape[1])
    return _indexer_loss_reference(q, compressed_k, index_q, index_k, index_weights, allowed,
                                   sink, scale, reduce_heads)


def exclusive_self_attention(out: torch.Tensor, v: torch.Tensor, eps: float = 1e-6):
    """XSA, Zhai, "Exclusive Self Attention" (2026): remove from each head's attention output
    ``out [B, T, Hq, D]`` its component along the token's own value ``v [B, T, Hkv, D]`` (the
    value of the head's key/value group): ``z = y - (y . v) / (|v|^2 + eps) v``, in fp32."""
    y = out.float()
    own = v.float().repeat_interleave(out.shape[2] // v.shape[2], dim=2)
    coefficient = (y * own).sum(-1, keepdim=True) / (own.square().sum(-1, keepdim=True) + eps)
    return (y - coefficient * own).to(out.dtype)
