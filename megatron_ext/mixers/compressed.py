"""DeepSeek-V4's compressed attentions: CSA ('C', Compressed Sparse Attention) and HCA ('H',
Heavily Compressed Attention). DeepSeek-AI, "DeepSeek-V4: Towards Highly Efficient Million-Token
Context Intelligence" (arXiv 2606.19348), sec. 2.3.

Both are Megatron's SelfAttention (QKV projection, RoPE, QK-norm, output gate, output
projection, TP over heads, SP) plus a compressor, whose core attends, in one softmax with a
sink, to the last ``*_window`` raw tokens of the query's sequence and to compressed entries,
one per block of ``*_compress_rate`` tokens. The compressor (:class:`KVCompressor`) projects
each token to values and per-channel weight logits; an entry is the weighted sum over its
block, the weights a softmax over the block's tokens per channel of the logits plus a learned
bias per position in the block, then RMSNorm (``kernels.sparse.compress_kv`` has the formula):

- HCA: rate m' = 128, one block per entry; a query attends to every entry it sees;
- CSA: rate m = 4, each entry mixes its block with the one before it (two value / logit
  series, one softmax over the 2m slots); a lightning indexer (:class:`CompressedIndexer`,
  DSA's, with its keys compressed the same way) picks the ``csa_top_k`` entries each query
  attends to.

A query sees an entry once the entry's block is complete: query t at position p of its
sequence sees entry i iff ``(i + 1) * rate - 1 <= p`` (V4's rule). The window must cover the
rest (``*_window >= rate - 1``; the config checks it). Packed (``thd``) sequences are
compressed and attended sequence by sequence.

Adapted from the paper, whose attention is MQA with one shared key/value head per layer (from
MLA's latent), to Megatron's grouped-query attention:

- There is one compressed entry per key/value head (``num_query_groups`` of ``kv_channels``);
  the window's raw tokens keep the layer's own keys and values. The paper shares K = V for
  both; here an entry still serves as key and value, but, as Megatron's keys and values, only
  its key side gets RoPE (at the position of the first token of its block, as V4 does), so
  the paper's de-rotation of the output (RoPE at -t on its rotary dims) has nothing to undo.
- The sink is part of the layer: with ``softmax_type="vanilla"`` the core adds a learnable
  one (zero-initialised, like Megatron's V4 prototype); "learnable" and "off-by-one" are
  Megatron's own.
- V4's query path (low-rank query with per-head RMSNorm) and grouped output projection are
  left to Megatron's settings (``qk_layernorm``; ``linear_proj``); its fp8 / fp4 storage and
  the indexer's Hadamard rotation serve its kernels only and are left out. CSA's indexer
  queries come from the normalised input, as DSA's do here.

Training CSA's indexer (V4 sec. 4.2.2: "inherited from DSA"): the same KL loss as DSA, between
the indexer's scores and the main attention over the compressed entries alone (as Megatron's
CSA prototype does), on the detached input, through DSA's :class:`IndexerLoss`, in the stage of
``ExtConfig.dsa_stage``: "dense_warmup" attends to every entry a query sees (HCA's attention
with CSA's entries) and trains only the indexers (:func:`freeze_all_but_indexers` covers
CSA's); "sparse" attends to the top-k and restricts the loss to them.

Tensor parallelism: the compressor is per key/value head and split with the heads: its
projection is column-parallel (head-major: each rank gets its heads' values and logits), its
position biases and norm weights are sharded over the key/value heads, so each rank compresses
exactly the heads it attends with, with no communication beyond the SP gather that any
column-parallel projection does. The sink is sharded over the query heads. CSA's indexer is
replicated like DSA's and for the same reason (every rank must pick the same entries; its loss
target is all-reduced over the ranks' heads; under context parallelism each CP rank computes
the loss of its own tokens, whose target is reduce-scattered from the CP ranks' heads).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention

from megatron_ext.config import ConfigError
from megatron_ext.kernels import sparse
from megatron_ext.mixers.attention import HeadSplitCoreAttention, core_inputs
from megatron_ext.mixers.common import (HeadShardedModule, LinearMixerSubmodules, cannot_decode,
                                        packed_cu_seqlens)
from megatron_ext.mixers.dsa import (DSACoreAttention, IndexerLoss, LightningIndexer,
                                    refuse_core_recompute)
from megatron_ext.parallel.context import packed_layout


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, in fp32, times ``weight``; in x's dtype."""
    y = x.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def _split_compression(projected: torch.Tensor, heads: int):
    """``[s, b, heads * 2 * C]`` (head-major: values, then logits) -> kv, gate
    ``[b, s, heads, C]``."""
    s, b = projected.shape[:2]
    kv, gate = projected.transpose(0, 1).reshape(b, s, heads, 2, -1).unbind(3)
    return kv, gate


class KVCompressor(HeadShardedModule):
    """The layer's compressor, per key/value head of this rank: ``x [s, b, h]`` (the normalised
    layer input; under SP this rank's slice) -> ``[b, N, heads, kv_channels]`` (RMSNorm'ed, no
    RoPE). Parameters: ``linear_compress`` (column-parallel), ``position_bias
    [heads, rate, C]`` and ``norm_weight [heads, D]`` (sharded over TP with the heads)."""

    def __init__(self, config, linear, rate: int, overlap: bool, pg_collection):
        super().__init__(config, LinearMixerSubmodules(column_linear=linear), pg_collection)
        heads, dim = config.num_query_groups, config.kv_channels
        self.heads, self.rate, self.overlap = heads // self.tp_size, rate, overlap
        channels = (2 if overlap else 1) * dim
        self.linear_compress = self.column("compress", config.hidden_size, heads * 2 * channels)
        self.sharded_parameter("position_bias", torch.zeros(heads, rate, channels),
                               no_weight_decay=True)
        self.sharded_parameter("norm_weight", torch.ones(heads, dim), no_weight_decay=True)

    def forward(self, x, cu_seqlens=None, backend="auto", cp=None, packed=None):
        """-> the entries ``[b, N, heads, D]`` of the whole sequence, and where they lie
        (``kernels.sparse.compressed.Entries``). Under context parallelism (``cp``; ``packed``
        its layout of packed sequences), the projections go from this rank's tokens of every
        head to every token of this rank's head group (all-to-all), whose entries are returned."""
        projected, _ = self.linear_compress(x)
        kv, gate = _split_compression(projected, self.heads)
        position_bias, norm_weight = self.position_bias, self.norm_weight
        if cp is not None:
            kv, gate = cp.sequence_to_heads(kv, packed), cp.sequence_to_heads(gate, packed)
            position_bias, norm_weight = cp.heads_of_rank(position_bias), cp.heads_of_rank(norm_weight)
        compressed = sparse.compress_kv(kv, gate, position_bias, rate=self.rate,
                                        overlap=self.overlap, cu_seqlens=cu_seqlens,
                                        backend=backend)
        entries = sparse.compressed_entries(kv.shape[1], self.rate, cu_seqlens, x.device)
        return _rms_norm(compressed, norm_weight, self.config.layernorm_epsilon), entries


class CompressedIndexer(LightningIndexer):
    """CSA's indexer: DSA's lightning indexer (replicated over TP) whose keys are one per
    compressed entry, from a compressor of its own like :class:`KVCompressor` (one head of
    ``csa_indexer_dim``, overlapping blocks), RMSNorm'ed, with RoPE at the entries' positions:
    ``index_k [b, N, DI]``."""

    dim_setting = "csa_indexer_dim"

    def _build_keys(self, rate: int):
        self.rate = rate
        self.linear_compress = self._linear(2 * 2 * self.dim)
        self.position_bias = torch.nn.Parameter(
            torch.zeros(1, rate, 2 * self.dim, dtype=self.config.params_dtype))
        self.position_bias._no_weight_decay = True
        self.key_norm = torch.nn.RMSNorm(self.dim, eps=self.config.layernorm_epsilon,
                                         dtype=self.config.params_dtype)

    def _rope(self, x, freqs, cu_seqlens, cp_group):
        """RoPE on ``x``, which holds whole sequences (under context parallelism too: the indexer
        runs on the gathered input), with ``freqs`` the table of a sequence's positions: each
        token at its position in its own sequence, with no CP split."""
        if cu_seqlens is not None:
            tokens = torch.arange(x.shape[0], device=x.device)
            freqs = freqs[tokens - sparse.compressed.first_tokens(x.shape[0], cu_seqlens, x.device)]
        return super()._rope(x, freqs, None, cp_group)

    def keys(self, x, rotary_pos_emb, cu_seqlens, cp_group):
        kv, gate = _split_compression(self.linear_compress(x), 1)
        entries = sparse.compress_kv(kv, gate, self.position_bias, rate=self.rate, overlap=True,
                                     cu_seqlens=cu_seqlens)
        index_k = self.key_norm(entries).transpose(0, 1)  # [N, b, 1, DI]
        if rotary_pos_emb is not None:  # at each entry's position in its sequence
            positions = sparse.compressed_entries(x.shape[0], self.rate, cu_seqlens,
                                                  x.device).positions
            index_k = self._rope(index_k, rotary_pos_emb[1][positions], None, cp_group)
        return index_k.squeeze(2).transpose(0, 1)


class HCACoreAttention(HeadSplitCoreAttention):
    """HCA's core (and the base of CSA's): attention over the window and the compressed
    entries ``compressed`` (keys, values), which :class:`HCASelfAttention` passes to it."""

    rate_setting, window_setting = "hca_compress_rate", "hca_window"

    def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        if self.window is not None:
            raise ConfigError(
                f"window_size={self.window} applies to '*' and MoBA layers; CSA and HCA layers "
                f"have their own window ({self.window_setting}). Use window_attn_skip_freq to "
                "leave them out, or drop window_size")
        if config.softmax_type == "vanilla":  # V4's sink is part of the layer
            self.sharded_parameter("softmax_offset", torch.zeros(config.num_attention_heads))
        self.rate = getattr(self.ext, self.rate_setting)
        self.compressed_window = getattr(self.ext, self.window_setting)

    def _options(self, q, packed_seq_params):
        sink = self.sink(q.device)
        return dict(window=self.compressed_window,
                    sink=sink if self.cp is None else self.cp_heads(sink),
                    scale=self.softmax_scale, cu_seqlens=packed_cu_seqlens(packed_seq_params),
                    backend=self.ext.sparse_backend)

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params, **inputs):
        """Under context parallelism, all-to-all over heads (as MoBA, NSA and DSA): q, k, v go
        from a sequence split to a head split around the op; the compressor has already
        produced this rank's head group's entries of the whole sequence. ``inputs`` go to
        :meth:`compressed_attend`."""
        if self.cp is None:
            return self.compressed_attend(q, k, v, packed_seq_params, **inputs)
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        packed = None if cu_seqlens is None else packed_layout(self.cp, cu_seqlens)
        q, k, v = (self.cp.sequence_to_heads(x, packed) for x in (q, k, v))
        out = self.compressed_attend(q, k, v, packed_seq_params, **inputs)
        return self.cp.heads_to_sequence(out, packed)

    def compressed_attend(self, q, k, v, packed_seq_params, compressed):
        keys, values = compressed
        return sparse.compressed_attention(q, k, v, keys, values, rate=self.rate,
                                           **self._options(q, packed_seq_params))


class CSACoreAttention(HCACoreAttention):
    """CSA's core: top-k (in the dense warm-up: all) compressed entries plus the window, and
    the indexer loss attached to its output, from the indexer's outputs ``index`` that
    :class:`CSASelfAttention` passes to it with the entries."""

    rate_setting, window_setting = "csa_compress_rate", "csa_window"
    # The loss target over all TP ranks' heads, and under CP each rank's share of the loss.
    _sum_over_heads = DSACoreAttention._sum_over_heads
    _indexer_loss_options = DSACoreAttention._indexer_loss_options

    def compressed_attend(self, q, k, v, packed_seq_params, compressed, index):
        """As HCA's, plus the selection and the indexer loss; under context parallelism the
        indexer ran on the whole sequence on every rank, and each rank computes the loss of its
        own tokens (their rows of index_q and index_weights), as DSA's do: the ranks' losses
        sum to the whole one."""
        keys, values = compressed
        index_q, index_k, index_weights = index
        ext, options = self.ext, self._options(q, packed_seq_params)
        selected = lse = None
        if ext.dsa_stage == "sparse":
            selected = sparse.csa_select(index_q, index_k, index_weights, rate=self.rate,
                                         top_k=ext.csa_top_k, cu_seqlens=options["cu_seqlens"],
                                         backend=ext.sparse_backend)
            out, lse = sparse.csa_attention(q, k, v, keys, values, selected, rate=self.rate,
                                            return_lse=True, **options)
        else:
            out = sparse.compressed_attention(q, k, v, keys, values, rate=self.rate, **options)
        if index_q.requires_grad and ext.dsa_indexer_loss_coeff > 0:
            del options["window"]
            cu_seqlens = options["cu_seqlens"]
            packed = None
            if self.cp is not None and cu_seqlens is not None:
                packed = packed_layout(self.cp, cu_seqlens)
            shared = self._indexer_loss_options(q.shape[1], packed, q.device)
            if shared["shares"] is not None:  # this rank's queries
                mine = shared["shares"].mine.to(q.device)
                index_q, index_weights = index_q[:, mine], index_weights[:, mine]
            loss = sparse.csa_indexer_loss(
                q, keys, index_q, index_k, index_weights, rate=self.rate, selected=selected,
                lse=lse, **shared, **options)
            out = IndexerLoss.apply(out, ext.dsa_indexer_loss_coeff * loss)
        return out


def _cu_seqlens(packed_seq_params):
    """The packed sequences' bounds, or None; padded packs are refused (the entries' RoPE
    positions and Megatron's would differ)."""
    cu_seqlens = packed_cu_seqlens(packed_seq_params)
    padded = None if cu_seqlens is None else packed_seq_params.cu_seqlens_q_padded
    if padded is not None and not torch.equal(padded, cu_seqlens):
        raise NotImplementedError("CSA and HCA layers take packed (thd) sequences without "
                                  "padding (cu_seqlens_q_padded equal to cu_seqlens_q)")
    return cu_seqlens


def _whole_sequence_tables(cp, rotary):
    """Megatron's rotary tables ``(q, k)`` under context parallelism without packed sequences,
    ``[2L, 1, 1, dim]`` at this rank's positions, -> those of the whole sequence
    ``[T, 1, 1, dim]`` in global order (one all-gather per distinct table)."""
    def whole(table):
        return cp.gather_sequence(table.transpose(0, 1)).transpose(0, 1)

    q_table, k_table = rotary
    k_whole = whole(k_table)
    return (k_whole if q_table is k_table else whole(q_table)), k_whole


class HCASelfAttention(SelfAttention):
    """Megatron's SelfAttention plus the :class:`KVCompressor`, run on the layer's normalised
    input before the attention; the entries go to the core as its ``compressed`` argument
    (:func:`~megatron_ext.mixers.attention.core_inputs`).

    RoPE: Megatron's attention rotates this rank's queries and keys as usual. The compressor's
    entries and CSA's indexer cover whole sequences, under context parallelism too, so they read
    the rotary table at positions in the whole sequence; under CP Megatron's table holds only
    this rank's positions and is all-gathered first, except with packed sequences, for which
    Megatron passes the table of a whole sequence."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        refuse_core_recompute(self, "CSA and HCA", "the compressed entries")
        core = self.core_attention
        self.compressor = KVCompressor(config, submodules.linear_qkv, core.rate,
                                       overlap=isinstance(core, CSACoreAttention),
                                       pg_collection=self.pg_collection)

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None,
                **kwargs):
        if kwargs.get("inference_context") is not None:
            raise ConfigError(cannot_decode("CSA and HCA"))
        cu_seqlens = _cu_seqlens(packed_seq_params)
        rotary = rotary_pos_emb
        if self.config.no_rope_freq and self.config.no_rope_freq[self.layer_number - 1]:
            rotary = None  # as Megatron's attention skips RoPE on this layer
        if rotary is not None and not isinstance(rotary, tuple):
            rotary = (rotary, rotary)
        cp = self.core_attention.cp
        packed = None if cp is None or cu_seqlens is None else packed_layout(cp, cu_seqlens)
        if cp is not None and packed is None and rotary is not None:
            rotary = _whole_sequence_tables(cp, rotary)
        values, entries = self.compressor(hidden_states, cu_seqlens,
                                          self.core_attention.ext.sparse_backend, cp, packed)
        keys = values
        if rotary is not None:  # the keys' RoPE, at each entry's position in its sequence
            keys = apply_rotary_pos_emb(values.transpose(0, 1), rotary[1][entries.positions],
                                        config=self.config, cp_group=self.pg_collection.cp)
            keys = keys.transpose(0, 1)
        inputs = self._core_inputs(hidden_states, rotary, cu_seqlens, packed)
        with core_inputs(self.core_attention, compressed=(keys, values), **inputs):
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)

    def _core_inputs(self, hidden_states, rotary, cu_seqlens, packed) -> dict:
        """The core's inputs besides the entries (CSA: the indexer's outputs, ``index``)."""
        return {}


class CSASelfAttention(HCASelfAttention):
    """HCA's layer plus CSA's :class:`CompressedIndexer`, run on the detached input; its
    outputs go to the core as its ``index`` argument."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        ext = self.core_attention.ext
        self.indexer = CompressedIndexer(config, ext.csa_indexer_heads, ext.csa_indexer_dim,
                                         rate=ext.csa_compress_rate)

    def _core_inputs(self, hidden_states, rotary, cu_seqlens, packed) -> dict:
        x = hidden_states.detach()
        if self.config.sequence_parallel and self.world_size > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
        cp = self.core_attention.cp
        if cp is not None:  # the indexer, replicated, runs on the whole sequence
            x = cp.gather_sequence(x.transpose(0, 1), packed).transpose(0, 1)
        return {"index": self.indexer(x, rotary, cu_seqlens, self.pg_collection.cp)}
