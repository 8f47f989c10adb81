"""Softmax self-attention: Megatron's SelfAttention with our core attention.

Megatron's local core (``DotProductAttention``) materialises the ``[b, heads, s, s]`` score
matrix. :class:`SDPACoreAttention` hands the same query/key/value to
``torch.nn.functional.scaled_dot_product_attention`` instead, which runs flash / cuDNN /
memory-efficient kernels on CUDA and a fused math path on the CPU. It keeps the core-attention
contract of ``SelfAttention`` (``[s, b, heads, d]`` in, ``[s, b, heads * d]`` out; ``thd``
packed sequences as ``[t, heads, d]``), so it drops into Megatron's own attention layer.

The options every softmax layer of ours takes (this core and the sparse ones of
:mod:`megatron_ext.mixers.sparse_attention`) live in :class:`SoftmaxCoreAttention`:

- sliding window: Megatron's ``window_size`` ``(left, right)`` on the layers that
  ``window_attn_skip_freq`` picks;
- sink: Megatron's ``softmax_type``: "learnable" is one logit per head added to the softmax
  denominator (``softmax_offset``, as in Megatron's local core, drawn at full size and sharded
  over TP with the heads), "off-by-one" the same logit fixed at 0;
- exclusive self attention (``ExtConfig.attention_xsa``; Zhai 2026): the output loses its
  component along the token's own value, per head.

Output gating and QK-norm are SelfAttention's own (``attention_output_gate``, ``qk_layernorm``):
they act on the projections around the core, for every core. A window or a sink moves this core
from SDPA to :func:`megatron_ext.kernels.sparse.softmax_attention` (on CUDA, torch's
FlashAttention-2 kernels with the sink applied through their log-sum-exp, or FlexAttention for
what they do not cover, such as an extra mask).
Under context parallelism the SDPA core gathers keys and values over the CP group
(:mod:`megatron_ext.parallel.attention` says why); the other cores refuse CP by name.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.kernels import sparse
from megatron_ext.mixers.common import HeadShardedModule, cannot_decode
from megatron_ext.parallel import ContextParallel
from megatron_ext.parallel.attention import gather_keys_values


class SoftmaxCoreAttention(HeadShardedModule):
    """What every core attention of ours shares: Megatron's core contract, the layout change to
    the kernels' ``[b, s, heads, d]``, the sink, the layer's window and XSA.

    Subclasses implement :meth:`attend`. Masks follow Megatron's convention:
    ``attention_mask`` is boolean with True where a query must NOT attend. A core that needs
    inputs besides the query, key and value (a sparse core's indexer outputs, gates or
    compressed entries) takes them as keyword arguments of :meth:`forward`, which hands them to
    :meth:`attend`; its layer passes them with :func:`core_inputs`.
    """

    # Whether attend() takes an extra attention mask besides the mask type.
    takes_attention_mask = True
    # Whether attend() applies attention dropout (only the plain SDPA path does).
    applies_dropout = False
    # Whether attend() runs under context parallelism (only the plain SDPA path does).
    supports_context_parallel = False

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str = "self", attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection=None, ext: ExtConfig | None = None, k_channels: int | None = None,
                 v_channels: int | None = None):
        # k_channels / v_channels (MLA passes them): the head sizes come from the tensors.
        super().__init__(config=config, submodules=None, pg_collection=pg_collection)
        self.ext = ext if ext is not None else ExtConfig()
        self.cp = ContextParallel.of(config, pg_collection)
        if self.cp is not None and not self.supports_context_parallel:
            raise NotImplementedError(
                f"context_parallel_size={config.context_parallel_size} is not supported by "
                f"{type(self).__name__}; context parallelism covers '*' attention (SDPA core) "
                "and the linear mixers")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # apply_query_key_layer_scaling only guards fp16 overflow in the unfused path; we
        # accumulate in fp32, so the plain 1/sqrt(d) scale is the same function.
        self.softmax_scale = softmax_scale
        self.heads = config.num_attention_heads // self.tp_size
        self.window = (tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None)
        self.fixed_sink = None
        if config.softmax_type == "learnable":
            full = torch.empty(config.num_attention_heads)
            if config.perform_initialization:
                config.init_method(full)
            self.sharded_parameter("softmax_offset", full)
        elif config.softmax_type == "off-by-one":
            self.fixed_sink = 0.0
        plain = self.applies_dropout and self.window is None and config.softmax_type == "vanilla"
        if self.dropout_p > 0 and not plain:
            raise NotImplementedError(
                f"attention_dropout={self.dropout_p} is not supported with a sliding window, a "
                "sink or sparse attention; set attention_dropout=0")

    def sink(self, device) -> torch.Tensor | None:
        """The sink logits of this rank's heads ``[heads]``, or None."""
        if self.fixed_sink is not None:
            return torch.full((self.heads,), self.fixed_sink, device=device)
        return getattr(self, "softmax_offset", None)

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params, **inputs):
        """q ``[b, s, hq, d]``, k/v ``[b, s, hkv, d]`` -> ``[b, s, hq, d]``; ``inputs``: the
        core's own inputs, as given to :meth:`forward`."""
        raise NotImplementedError

    def cached_keys(self, sq: int, sk: int, device) -> tuple[int, torch.Tensor]:
        """Decoding with Megatron's KV cache: the queries are the last ``sq`` of the ``sk``
        cached tokens; each sees the keys before it within its window. Returns the first cached
        key any query sees (with a window, only the keys from there on are read, so that a
        decoding step costs O(window), not O(tokens so far); Megatron's static cache still holds
        every token) and the bool mask ``[sq, sk - first]`` of the keys each query sees."""
        windowed = self.window is not None and self.window[0] >= 0
        first = max(sk - sq - self.window[0], 0) if windowed else 0
        query_at = torch.arange(sk - sq, sk, device=device)[:, None]
        key_at = torch.arange(first, sk, device=device)[None, :]
        allowed = key_at <= query_at
        if windowed:
            allowed &= key_at >= query_at - self.window[0]
        return first, allowed

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None,
                attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None, **inputs) -> torch.Tensor:
        """query ``[sq, b, hq, d]``, key/value ``[sk, b, hkv, d]`` -> ``[sq, b, hq * d]``;
        ``inputs``: the keyword inputs of the subclass's :meth:`attend`.

        With ``thd`` packing the batch dimension is absent (``[t, h, d]``) and sequences are
        separated by ``packed_seq_params.cu_seqlens_q``.
        """
        if attention_bias is not None:
            raise NotImplementedError(f"attention_bias is not supported by {type(self).__name__}")
        if attention_mask is not None and not self.takes_attention_mask:
            raise NotImplementedError(
                f"{type(self).__name__} takes no attention_mask beyond its causal mask type; "
                "build batches without one (create_attention_mask=False)")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        q, k, v = (x.transpose(0, 1) for x in (query, key, value))  # [b, s, h, d]
        out = self.attend(q, k, v, attention_mask, mask_type, packed_seq_params, **inputs)
        if self.ext.attention_xsa:
            out = sparse.exclusive_self_attention(out, v)
        out = out.transpose(0, 1)  # [sq, b, hq, d]
        if packed:
            return out.reshape(out.shape[0], -1)
        return out.reshape(out.shape[0], out.shape[1], -1)


@contextlib.contextmanager
def core_inputs(core: torch.nn.Module, **inputs):
    """Megatron's attention calls its core with a fixed set of arguments; within this context,
    that call also passes ``inputs`` as keyword arguments (a layer's inputs of its core that
    it computes itself, such as DSA's indexer outputs)."""
    def add_inputs(module, args, kwargs):
        return args, {**kwargs, **inputs}

    handle = core.register_forward_pre_hook(add_inputs, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


class HeadSplitCoreAttention(SoftmaxCoreAttention):
    """Base of the sparse cores (MoBA, NSA, DSA, CSA, HCA): causal, no attention_mask, and, under
    context parallelism, all-to-all over heads: their ops need every token of a sequence, so each
    rank runs them on the whole sequence for its group of heads (``cp.sequence_to_heads``) and
    takes that group of every per-head tensor (:meth:`cp_heads`). Needs the query and key/value
    heads per TP rank divisible by CP."""

    takes_attention_mask = False
    supports_context_parallel = True

    def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        if attn_mask_type != AttnMaskType.causal:
            raise NotImplementedError(f"{type(self).__name__} is causal; got {attn_mask_type}")
        groups = config.num_query_groups // self.tp_size
        if self.cp is not None and (self.heads % self.cp.size or groups % self.cp.size):
            raise ConfigError(
                f"{type(self).__name__} under context parallelism splits its heads over the CP "
                f"ranks (all-to-all): {self.heads} query and {groups} key/value heads per "
                f"tensor-parallel rank must be divisible by context_parallel_size={self.cp.size}")

    def forward(self, query, key, value, *args, **kwargs):
        if query.shape[0] != key.shape[0]:  # Megatron's KV cache: decoding
            raise ConfigError(cannot_decode(type(self).__name__.removesuffix("CoreAttention")))
        return super().forward(query, key, value, *args, **kwargs)

    def cp_heads(self, per_head: torch.Tensor | None) -> torch.Tensor | None:
        """This CP rank's head group of a per-head tensor ``[heads, ...]``."""
        return None if per_head is None else self.cp.heads_of_rank(per_head)


class SDPACoreAttention(SoftmaxCoreAttention):
    """Core attention of '*' layers: torch SDPA (causal or masked, grouped-query heads, packed
    sequences); with a sliding window or a sink, the windowed op of ``kernels.sparse``.

    With the causal mask type and no mask, SDPA's ``is_causal`` path is used, which is the one
    that reaches the flash kernels.
    """

    applies_dropout = True
    supports_context_parallel = True

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params):
        if self.cp is not None:
            return self._attend_context_parallel(q, k, v, attention_mask, mask_type,
                                                 packed_seq_params)
        sink = self.sink(q.device)
        if self.window is not None or sink is not None:
            if q.shape[1] != k.shape[1]:
                return self._attend_cached(q, k, v, sink)
            cu_seqlens = None
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                cu_seqlens = packed_seq_params.cu_seqlens_q
            return sparse.softmax_attention(
                q, k, v, causal=mask_type == AttnMaskType.causal, window=self.window, sink=sink,
                scale=self.softmax_scale, cu_seqlens=cu_seqlens,
                allowed=None if attention_mask is None else ~attention_mask.bool(),
                backend=self.ext.sparse_backend)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d]
        allowed = self._allowed_mask(q, k, attention_mask, mask_type, packed_seq_params)
        is_causal = allowed is None and mask_type == AttnMaskType.causal and q.shape[2] > 1
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)

    def _attend_cached(self, q, k, v, sink):
        """Decoding with Megatron's KV cache, with a window or a sink (:meth:`cached_keys`)."""
        first, allowed = self.cached_keys(q.shape[1], k.shape[1], q.device)
        k, v = k[:, first:], v[:, first:]
        return sparse.softmax_attention(q, k, v, causal=False, sink=sink,
                                        scale=self.softmax_scale, allowed=allowed[None, None],
                                        backend=self.ext.sparse_backend)

    def _attend_context_parallel(self, q, k, v, attention_mask, mask_type, packed_seq_params):
        """Causal attention of this rank's load-balanced chunks to the whole sequence, by an
        all-gather of keys and values (:mod:`megatron_ext.parallel.attention` says why)."""
        if attention_mask is not None or mask_type != AttnMaskType.causal:
            raise NotImplementedError(
                "context parallelism of '*' attention takes the causal mask type only, with no "
                "attention_mask (packed sequences are fine)")
        cu_seqlens = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q
        sink = self.sink(q.device)
        if cu_seqlens is None and self.window is None and sink is None:
            return self._attend_chunks_causally(q, k, v)
        k, v, allowed = gather_keys_values(self.cp, q, k, v, cu_seqlens, self.window)
        if self.window is not None or sink is not None:  # the mask carries the window
            return sparse.softmax_attention(q, k, v, causal=False, sink=sink, scale=self.softmax_scale,
                                            allowed=allowed[None, None], backend=self.ext.sparse_backend)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [b, h, s, d]
        dropout_p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(dropout_p):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout_p, scale=self.softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2)

    def _attend_chunks_causally(self, q, k, v):
        """Plain causal attention under CP: each of this rank's two chunks (L tokens, global
        chunk c) attends to the gathered keys 0 .. (c + 1) L - 1 with a causal mask aligned to
        the lower right, which SDPA runs in its flash / memory-efficient kernels. No ``[2L, T]``
        mask, and no work on the keys after a chunk (half of a full ``2L x T`` product)."""
        length = self.cp.check_local_length(q.shape[1])
        k, v = self.cp.gather_sequence(k), self.cp.gather_sequence(v)
        dropout_p = self.dropout_p if self.training else 0.0
        outputs = []
        with self._dropout_rng(dropout_p):
            for half, chunk in enumerate(self.cp.chunks):
                end = (chunk + 1) * length
                q_chunk, k_seen, v_seen = (x.transpose(1, 2) for x in (
                    q[:, half * length:(half + 1) * length], k[:, :end], v[:, :end]))
                out = F.scaled_dot_product_attention(
                    q_chunk, k_seen, v_seen, attn_mask=causal_lower_right(length, end),
                    dropout_p=dropout_p, scale=self.softmax_scale,
                    enable_gqa=q_chunk.shape[1] != k_seen.shape[1])
                outputs.append(out.transpose(1, 2))
        return torch.cat(outputs, dim=1)

    @staticmethod
    def _allowed_mask(q, k, attention_mask, mask_type, packed_seq_params):
        """SDPA's boolean mask (True = may attend), or None for the plain causal fast path."""
        sq, sk = q.shape[2], k.shape[2]
        allowed = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # Block-diagonal: a token attends only within its own sequence of the pack.
            seq_q = _sequence_ids(packed_seq_params.cu_seqlens_q, sq)
            seq_k = _sequence_ids(packed_seq_params.cu_seqlens_kv, sk)
            allowed = seq_q[:, None] == seq_k[None, :]
        if attention_mask is not None:
            not_masked = ~attention_mask.bool()
            allowed = not_masked if allowed is None else allowed & not_masked
        if allowed is not None and mask_type == AttnMaskType.causal:
            allowed = allowed & torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        return allowed

    def _dropout_rng(self, dropout_p: float):
        """Dropout under TP must draw from the model-parallel RNG stream, as Megatron's core does."""
        if dropout_p > 0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()


def _sequence_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[0, 3, 5]`` with total 5 -> ``[0, 0, 0, 1, 1]``."""
    positions = torch.arange(total, device=cu_seqlens.device)
    return torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
