"""Sparse softmax attention layers: MoBA ('B') and NSA ('S'), and the Forgetting Transformer
('F'); DSA ('D', in :mod:`megatron_ext.mixers.dsa`) and DeepSeek-V4's CSA and HCA ('C', 'H', in
:mod:`megatron_ext.mixers.compressed`) are built here too.

Each is Megatron's SelfAttention (QKV projection, RoPE, QK-norm, output gate, output
projection, TP over heads, SP) with a core of ours in place of the dense one; every option of
:class:`~megatron_ext.mixers.attention.SoftmaxCoreAttention` (sink, XSA, and for MoBA and FoX
the sliding window) applies.

- MoBA, Lu et al., "MoBA: Mixture of Block Attention for Long-Context LLMs" (2025): no
  parameters; each query head picks its key blocks by ``q . mean(K_block)``.
- NSA, Yuan et al., "Native Sparse Attention: Hardware-Aligned and Natively Trainable Sparse
  Attention" (2025): compressed, selected and sliding-window branches over the layer's one set
  of keys and values (as fla-org's implementation does; the paper gives each branch its own),
  mixed by per-token sigmoid gates ``sigmoid(X W_g)`` from the layer input. The compression is a
  learned weighted pooling per key/value head and block position (initialised to the mean,
  which is what fla-org's implementation fixes it to); the paper uses a small MLP.
- FoX, Lin et al., "Forgetting Transformer: Softmax Attention with a Forget Gate" (ICLR 2025):
  per head a forget gate ``f_t = sigmoid(x_t W_f + b_f)``, and the logit of query i and key
  j <= i biased by ``sum_{j < l <= i} log f_l`` (a data-dependent ALiBi); the "Pro" block's
  output gate and QK-norm are SelfAttention's own options.

Under TP every parameter here is per head and split with the heads: the NSA gate projection and
FoX's forget-gate projection are column-parallel (head-major, 3 gates per head for NSA), the
compression weights are sharded over the key/value heads, the sink over the query heads.
Selections are per head (MoBA) or per key/value group (NSA), so they never cross ranks. Under
CP all three split their heads further, by all-to-all
(:class:`_SparseCore`).
"""

from __future__ import annotations

import copy
import functools
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec, build_module

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse.reference import masked_attention
from megatron_ext.mixers.attention import (HeadSplitCoreAttention, SoftmaxCoreAttention,
                                           core_inputs)
from megatron_ext.mixers.common import cannot_decode, packed_cu_seqlens
from megatron_ext.mixers.compressed import (CSACoreAttention, CSASelfAttention,
                                           HCACoreAttention, HCASelfAttention)
from megatron_ext.mixers.dsa import DSACoreAttention, DSASelfAttention
from megatron_ext.parallel.context import packed_layout


def _check_blocks(top_k_name: str, top_k: int, block_name: str, block: int, seq_len: int):
    blocks = math.ceil(seq_len / block)
    if top_k > blocks:
        raise ConfigError(
            f"{top_k_name}={top_k} is more than the {blocks} blocks of {block_name}={block} in a "
            f"sequence of {seq_len} tokens; lower {top_k_name} or {block_name}")


class _DocumentRows:
    """Packed (thd) sequences as the rows of a zero-padded batch, and back: ``[1, T, ...]`` ->
    ``[N, L, ...]`` (L the longest sequence) and ``[N, L, ...]`` -> ``[1, T, ...]``. For a
    causal op this is exact: a row's padding comes after its tokens, so no token sees it."""

    def __init__(self, cu_seqlens: torch.Tensor, device):
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.long)
        starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        self.tokens, self.longest = int(cu_seqlens[-1]), max(int(lengths.max()), 1)
        offsets = torch.arange(self.longest, device=device)
        real = offsets[None, :] < lengths[:, None]
        # Where each row position reads from; padding reads an appended zero token.
        self.source = torch.where(real, starts[:, None] + offsets[None, :], self.tokens)
        self.real = real.flatten().nonzero().squeeze(1)  # the tokens, in order, in the rows

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        flat = torch.cat([x[0], x.new_zeros(1, *x.shape[2:])])
        return flat[self.source]

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        return y.flatten(0, 1)[self.real].unsqueeze(0)


class _SparseCore(HeadSplitCoreAttention):
    """MoBA's, NSA's and FoX's core: causal self-attention over one sequence per batch row.

    Packed (thd) sequences become the rows of a padded batch around the op (exact for a causal
    op; the padding costs compute when the sequences' lengths differ much).

    Context parallelism: all-to-all (Ulysses, see the base class). The selections look at the
    whole sequence (MoBA's block means, NSA's compressed keys) and are per head or per key/value
    group; ``sparse_attend`` gets this rank's head group of per-head tensors through ``heads``,
    and the core's keyword ``inputs``."""

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params, **inputs):
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        packed = None if self.cp is None or cu_seqlens is None else packed_layout(self.cp, cu_seqlens)
        documents = None if cu_seqlens is None else _DocumentRows(cu_seqlens, q.device)

        def to_rows(x):
            """``[b, s, heads, ...]`` of this rank -> the op's rows: whole sequences (one per
            row), this rank's head group under CP."""
            if self.cp is not None:
                x = self.cp.sequence_to_heads(x, packed)
            return x if documents is None else documents.pad(x)

        def from_rows(y):
            if documents is not None:
                y = documents.unpad(y)
            return y if self.cp is None else self.cp.heads_to_sequence(y, packed)

        heads = (lambda t: t) if self.cp is None else self.cp_heads
        q, k, v = (to_rows(x) for x in (q, k, v))
        return from_rows(self.sparse_attend(q, k, v, heads=heads, to_rows=to_rows, **inputs))


class MoBACoreAttention(_SparseCore):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.window is not None and self.window[1] > 0:
            raise NotImplementedError(f"MoBA is causal; window_size={self.window} looks ahead")

    def sparse_attend(self, q, k, v, heads, to_rows):
        ext = self.ext
        _check_blocks("moba_top_k", ext.moba_top_k, "moba_block_size", ext.moba_block_size,
                      q.shape[1])
        return sparse.moba_attention(
            q, k, v, block_size=ext.moba_block_size, top_k=ext.moba_top_k, window=self.window,
            sink=heads(self.sink(q.device)), scale=self.softmax_scale, backend=ext.sparse_backend)


class NSACoreAttention(_SparseCore):
    """NSA's core; the logits of the branch gates, ``gate_logits`` ``[s, b, heads * 3]``, come
    from :class:`NSASelfAttention`."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.window is not None:
            raise ConfigError(
                f"window_size={self.window} applies to '*' and MoBA layers; NSA has its own "
                "sliding-window branch (nsa_window). Use window_attn_skip_freq to leave NSA "
                "layers out, or drop window_size")
        block = self.ext.nsa_compress_block
        mean = torch.full((config.num_query_groups, block), 1.0 / block)
        self.sharded_parameter("compress_k_weights", mean)
        self.sharded_parameter("compress_v_weights", mean.clone())

    def sparse_attend(self, q, k, v, heads, to_rows, gate_logits):
        ext = self.ext
        _check_blocks("nsa_select_top_k", ext.nsa_select_top_k, "nsa_select_block",
                      ext.nsa_select_block, q.shape[1])
        # [s, b, heads * 3] (head-major) -> [b, s, heads, 3], then laid out as q is
        gates = to_rows(torch.sigmoid(gate_logits.float()).transpose(0, 1).unflatten(-1, (-1, 3)))
        return sparse.nsa_attention(
            q, k, v, gates, heads(self.compress_k_weights), heads(self.compress_v_weights),
            compress_block=ext.nsa_compress_block, compress_stride=ext.nsa_compress_stride,
            select_block=ext.nsa_select_block, select_top_k=ext.nsa_select_top_k,
            window=ext.nsa_window, sink=heads(self.sink(q.device)), scale=self.softmax_scale,
            backend=ext.sparse_backend)


def _head_gate_projection(attention, config, submodules, per_head: int, name: str):
    """``X -> [heads * per_head]`` gate logits with a bias, head-major, built like the layer's
    ``linear_qkv`` (column-parallel, so split with the heads; under Transformer Engine with the
    input norm fused)."""
    return build_module(
        submodules.linear_qkv, config.hidden_size, per_head * config.num_attention_heads,
        config=config, init_method=config.init_method, gather_output=False, bias=True,
        skip_bias_add=False, is_expert=False, tp_comm_buffer_name=name,
        tp_group=attention.pg_collection.tp)


class NSASelfAttention(SelfAttention):
    """Megatron's SelfAttention plus NSA's gate projection ``X -> [heads, 3]`` logits, built like
    ``linear_qkv`` (column-parallel; under Transformer Engine with the input norm fused), whose
    output goes to the core as its ``gate_logits`` argument
    (:func:`~megatron_ext.mixers.attention.core_inputs`)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if config.num_query_groups % self.world_size:
            raise ConfigError(
                f"NSA shards its compression over the {config.num_query_groups} key/value heads: "
                "num_query_groups must be divisible by tensor_model_parallel_size="
                f"{self.world_size}")
        self.linear_branch_gate = _head_gate_projection(self, config, submodules, 3, "nsa_gate")

    def forward(self, hidden_states, *args, **kwargs):
        gate_logits, _ = self.linear_branch_gate(hidden_states)
        with core_inputs(self.core_attention, gate_logits=gate_logits):
            return super().forward(hidden_states, *args, **kwargs)


class FoXCoreAttention(_SparseCore):
    """The Forgetting Transformer's core: causal softmax attention whose logits are biased by the
    log forget gates between key and query (``sparse.softmax_attention``'s ``log_forget``). Its
    inputs from :class:`FoXSelfAttention`: the gates' logits ``forget_logits`` ``[s, b,
    heads]``, and when decoding with Megatron's KV cache, the running sums ``c`` of the log
    gates of every cached token (``forget_sums``, ``[b, cached tokens, heads]``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.window is not None and self.window[1] > 0:
            raise NotImplementedError(f"FoX is causal; window_size={self.window} looks ahead")

    def forward(self, query, key, value, *args, **kwargs):
        if query.shape[0] != key.shape[0]:  # Megatron's KV cache: decoding
            return SoftmaxCoreAttention.forward(self, query, key, value, *args, **kwargs)
        return super().forward(query, key, value, *args, **kwargs)

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params, forget_logits,
               forget_sums=None):
        if q.shape[1] != k.shape[1]:
            return self._attend_cached(q, k, v, forget_sums)
        return super().attend(q, k, v, attention_mask, mask_type, packed_seq_params,
                              forget_logits=forget_logits)

    def _attend_cached(self, q, k, v, forget_sums):
        """The last ``sq`` of ``sk`` cached tokens attend to the keys before them
        (:meth:`cached_keys`), their logits biased by ``c_i - c_j`` from ``forget_sums`` (the
        dense fp32 reference: a decoding step is one query per sequence)."""
        sq, sk = q.shape[1], k.shape[1]
        first, allowed = self.cached_keys(sq, sk, q.device)
        c = forget_sums.transpose(1, 2)  # [b, heads, sk]
        return masked_attention(q, k[:, first:], v[:, first:], allowed[None, None],
                                sink=self.sink(q.device), scale=self.softmax_scale,
                                bias=c[..., sk - sq:, None] - c[..., None, first:])

    def sparse_attend(self, q, k, v, heads, to_rows, forget_logits):
        # [s, b, heads] -> log f [b, s, heads], laid out as q is
        log_forget = F.logsigmoid(forget_logits.float()).transpose(0, 1)
        log_forget = to_rows(log_forget.unsqueeze(-1)).squeeze(-1)
        return sparse.softmax_attention(
            q, k, v, causal=True, window=self.window, sink=heads(self.sink(q.device)),
            scale=self.softmax_scale, log_forget=log_forget, backend=self.ext.sparse_backend)


class FoXSelfAttention(SelfAttention):
    """Megatron's SelfAttention plus FoX's forget gate ``f = sigmoid(X W_f + b_f)``, one per head
    and token: a column-parallel projection to ``heads`` logits with a bias (zero at
    initialisation, the paper's default), built like ``linear_qkv``, whose output goes to the
    core as its ``forget_logits`` argument, with ``forget_sums`` when decoding
    (:func:`~megatron_ext.mixers.attention.core_inputs`)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.linear_forget_gate = _head_gate_projection(self, config, submodules, 1, "fox_gate")

    def forward(self, hidden_states, *args, **kwargs):
        logits, _ = self.linear_forget_gate(hidden_states)
        context = kwargs.get("inference_context")
        sums = None if context is None else self._forget_sums(logits, context, kwargs)
        with core_inputs(self.core_attention, forget_logits=logits, forget_sums=sums):
            return super().forward(hidden_states, *args, **kwargs)

    def _forget_sums(self, logits, context, kwargs) -> torch.Tensor:
        """``c`` ``[b, tokens so far, heads]``: the running sums of the log forget gates of every
        token of the sequences decoded so far (kept in Megatron's static inference context,
        restarted at sequence offset 0, a new prompt)."""
        if not context.is_static_batching():
            raise ConfigError(cannot_decode("FoX with dynamic batching") + "; use Megatron's "
                              "StaticInferenceContext")
        if packed_cu_seqlens(kwargs.get("packed_seq_params")) is not None:
            raise ConfigError(cannot_decode("FoX with packed (thd) sequences"))
        store, name = context.key_value_memory_dict, ("forget_sums", self.layer_number)
        sums = F.logsigmoid(logits.float()).transpose(0, 1).cumsum(1)
        before = store.get(name) if context.sequence_len_offset else None
        if before is not None:
            sums = torch.cat([before, before[:, -1:] + sums], dim=1)
        store[name] = sums
        return sums


# variant -> (core attention, attention layer)
_LAYERS = {"moba": (MoBACoreAttention, SelfAttention), "nsa": (NSACoreAttention, NSASelfAttention),
           "fox": (FoXCoreAttention, FoXSelfAttention),
           "dsa": (DSACoreAttention, DSASelfAttention),
           "csa": (CSACoreAttention, CSASelfAttention), "hca": (HCACoreAttention, HCASelfAttention)}


def sparse_attention_spec(attention: ModuleSpec, ext: ExtConfig, variant: str) -> ModuleSpec:
    """The ``self_attention`` spec of a sparse layer, from the '*' layer's spec ``attention``."""
    core, layer = _LAYERS[variant]
    spec = copy.deepcopy(attention)
    spec.submodules.core_attention = functools.partial(core, ext=ext)
    spec.module = layer
    return spec
