"""DeepSeek Sparse Attention ('D'): DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open
Large Language Models" (arXiv 2512.02556; first published as the DeepSeek-V3.2-Exp report).

A DSA layer is Megatron's SelfAttention (QKV projection, RoPE, QK-norm, output gate, output
projection, TP over heads, SP) whose core attends, per query, to the ``dsa_top_k`` earlier keys
that a lightning indexer ranks highest (all heads share the choice), plus that indexer::

    q_I = W_q x  [HI, DI],   k_I = LayerNorm(W_k x)  [DI],   w = W_w x / sqrt(HI * DI)  [HI]
    I[t, s] = sum_j w[t, j] relu(q_I[t, j] . k_I[s])

with the model's RoPE on the first rotary dims of q_I and k_I. In the paper q_I comes from
MLA's query latent; a GQA layer has none, so here q_I, like k_I and w, is projected from the
layer's normalised input x (which is why the layer keeps its input norm separate even under
Transformer Engine). ``ExtConfig.dsa_attention_type: mla`` makes the 'D' layers MLA layers
whose indexer reads the query latent as the paper's does
(:class:`megatron_ext.mixers.mla.MLADSASelfAttention`). The paper's Hadamard rotation of q_I
and k_I serves its fp8 kernel only and is left out. Every option of
:class:`~megatron_ext.mixers.attention.SoftmaxCoreAttention` but the sliding window applies
(sink, XSA).

Training, ``ExtConfig.dsa_stage`` (sec. 2.1 of the paper):

- "dense_warmup": the attention stays dense and only the indexer trains, on
  ``KL(p_t || softmax(I_t))`` over every causal key, p the main attention summed over heads
  and L1-normalised. Every other parameter is frozen by :func:`freeze_all_but_indexers`,
  which the entry points install: ``hybrid_block`` as a pre-wrap hook of Megatron's model
  builder (``pretrain_gpt.py``, ``megatron-ext pretrain``), ``megatron-ext train`` itself; a
  script of one's own calls it on its model.
- "sparse": top-k attention, and the same loss over each query's selected keys only. The
  indexer reads ``x.detach()`` and the loss's target is detached, so the indexer learns from
  its loss alone and the rest of the model from the LM loss alone.

The indexer reads a detached input in both stages (in the warm-up nothing before it trains).
Its loss joins the graph as Megatron's MoE auxiliary losses do: :class:`IndexerLoss` passes the
attention output through unchanged and, in backward, gives the loss (a mean over the
micro-batch's tokens, times ``dsa_indexer_loss_coeff``) the gradient ``scale``. The spec sets
``config.experimental_attention_variant_loss_scale_func``, through which Megatron's pipeline
schedule sets that scale to the LM loss's own factor, the gradient scaler's scale divided by
the number of micro-batches; so gradient accumulation weighs both losses alike and the
training loop needs no change. A loop of one's own that divides its LM loss by N micro-batches
calls ``IndexerLoss.set_loss_scale(torch.tensor(1 / N))`` (``megatron-ext train`` does).

Tensor parallelism: the indexer is replicated on every TP rank, not split. All ranks must
choose the same keys, and splitting the indexer heads would cost an all-reduce of the
``[T, T]`` score matrix before every top-k; the indexer is small next to the attention
(``HI * DI + DI + HI`` output columns). Each rank runs it on the whole sequence (gathered
under SP). The one thing it needs from the other ranks is its loss's target, the main
attention summed over all heads, which is all-reduced over TP by chunks of queries. Every rank
then computes the same loss and the same indexer gradients (under context parallelism, the TP
ranks of one CP rank: the same share of the loss, see :meth:`DSACoreAttention.attend`); the
parameters also carry Megatron's ``average_gradients_across_tp_domain``, so
finalize_model_grads keeps the replicas equal.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.kernels import sparse
from megatron_ext.mixers.attention import HeadSplitCoreAttention, core_inputs
from megatron_ext.mixers.common import cannot_decode, packed_cu_seqlens
from megatron_ext.parallel.context import packed_layout


class IndexerLoss(torch.autograd.Function):
    """``apply(output, loss)`` returns output; backward gives ``loss`` the gradient
    :attr:`scale` (1 until set), whatever reaches output."""

    scale: torch.Tensor | None = None

    @staticmethod
    def forward(ctx, output, loss):
        ctx.save_for_backward(loss)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        scale = 1.0 if IndexerLoss.scale is None else IndexerLoss.scale.to(loss.device)
        return grad_output, torch.ones_like(loss) * scale

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        """Megatron's ``experimental_attention_variant_loss_scale_func``."""
        IndexerLoss.scale = scale.detach().clone()


class LightningIndexer(MegatronModule):
    """DSA's indexer, replicated over TP: ``x [s, b, h]`` (the whole sequence) ->
    ``index_q [b, s, HI, DI]``, ``index_k [b, s, DI]``, ``index_weights [b, s, HI]``.
    ``query_size``: the width of the input index_q is projected from, when that is not x
    (MLA layers: the query latent, passed to :meth:`forward` as ``query_input``).

    A subclass with other keys (CSA's, one per compressed block) overrides :meth:`_build_keys`
    and :meth:`keys`; ``dim_setting`` names its ExtConfig field of DI, for errors."""

    dim_setting = "dsa_indexer_dim"

    def __init__(self, config, heads: int, dim: int, query_size: int | None = None,
                 **key_options):
        super().__init__(config=config)
        self.heads, self.dim = heads, dim
        self.linear_q = self._linear(heads * dim, query_size)
        self._build_keys(**key_options)
        self.linear_weights = self._linear(heads)
        for p in self.parameters():
            p.average_gradients_across_tp_domain = True

    def _build_keys(self):
        self.linear_k = self._linear(self.dim)
        self.key_norm = torch.nn.LayerNorm(self.dim, eps=self.config.layernorm_epsilon,
                                           dtype=self.config.params_dtype)

    def _linear(self, out_size: int, in_size: int | None = None) -> torch.nn.Linear:
        layer = torch.nn.Linear(in_size or self.config.hidden_size, out_size, bias=False,
                                dtype=self.config.params_dtype)
        if self.config.perform_initialization:
            self.config.init_method(layer.weight)
        return layer

    def _rope(self, x, freqs, cu_seqlens, cp_group):
        """Megatron's RoPE on the first ``freqs.shape[-1]`` dims of ``x [s, b, h, DI]``."""
        if freqs.shape[-1] > self.dim:
            raise ConfigError(
                f"{self.dim_setting}={self.dim} is smaller than the {freqs.shape[-1]} rotary "
                f"dims of the model's RoPE; raise {self.dim_setting} or lower rotary_percent")
        if cu_seqlens is None:
            return apply_rotary_pos_emb(x, freqs, config=self.config, cp_group=cp_group)
        return apply_rotary_pos_emb(x.squeeze(1), freqs, config=self.config,
                                    cu_seqlens=cu_seqlens, cp_group=cp_group).unsqueeze(1)

    def keys(self, x, rotary_pos_emb, cu_seqlens, cp_group):
        """``index_k [b, s, DI]``: one key per token."""
        s, b, _ = x.shape
        index_k = self.key_norm(self.linear_k(x)).view(s, b, 1, self.dim)
        if rotary_pos_emb is not None:
            index_k = self._rope(index_k, rotary_pos_emb[1], cu_seqlens, cp_group)
        return index_k.squeeze(2).transpose(0, 1)

    def forward(self, x, rotary_pos_emb=None, cu_seqlens=None, cp_group=None, query_input=None):
        s, b, _ = x.shape
        index_q = self.linear_q(x if query_input is None else query_input)
        index_q = index_q.view(s, b, self.heads, self.dim)
        if rotary_pos_emb is not None:
            index_q = self._rope(index_q, rotary_pos_emb[0], cu_seqlens, cp_group)
        index_weights = self.linear_weights(x) * (self.heads * self.dim) ** -0.5
        return (index_q.transpose(0, 1), self.keys(x, rotary_pos_emb, cu_seqlens, cp_group),
                index_weights.transpose(0, 1))


class DSACoreAttention(HeadSplitCoreAttention):
    """DSA's core: top-k (in the dense warm-up: dense) causal attention, and the indexer loss
    attached to its output, from the indexer's outputs ``index`` (index_q, index_k,
    index_weights) that :class:`DSASelfAttention` passes to it. Packed (``thd``) sequences
    select within their own sequence."""

    def __init__(self, config, layer_number, attn_mask_type, *args, **kwargs):
        super().__init__(config, layer_number, attn_mask_type, *args, **kwargs)
        if self.window is not None:
            raise ConfigError(
                f"window_size={self.window} applies to '*' and MoBA layers; DSA picks its own "
                "keys. Use window_attn_skip_freq to leave DSA layers out, or drop window_size")

    def _sum_over_heads(self, mass: torch.Tensor) -> torch.Tensor:
        """The loss target summed over the heads of every TP rank (under CP, the query shares'
        reduce-scatter has already summed it over the CP ranks' head groups)."""
        torch.distributed.all_reduce(mass, group=self.tp_group)
        return mass

    def _indexer_loss_options(self, seq_len: int, packed, device) -> dict:
        """``reduce_heads`` and ``shares`` of the indexer loss: the target summed over the TP
        ranks' heads; under CP, each rank's loss over its own tokens only, whose target, summed
        over the CP ranks' head groups, a reduce-scatter brings it (``cp.query_shares``)."""
        return dict(reduce_heads=self._sum_over_heads if self.tp_size > 1 else None,
                    shares=None if self.cp is None else self.cp.query_shares(seq_len, packed,
                                                                             device))

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params, index):
        """Under context parallelism (all-to-all, as MoBA and NSA): the indexer's outputs are
        all-gathered (every rank selects for the whole sequence, the same keys), q, k and v go
        from a sequence split to a head split, and each rank computes the indexer loss of its
        own tokens (the ranks' losses sum to the whole one), from its local index_q and
        index_weights and the gathered index_k. Only index_k's gather carries a gradient
        (summed over the ranks by its reduce-scatter); index_q and index_weights are gathered
        detached, for the selection alone."""
        index_q, index_k, index_weights = index
        loss_q, loss_weights = index_q, index_weights  # the queries of this rank's loss
        ext = self.ext
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        heads = lambda per_head: per_head  # noqa: E731
        packed = None
        if self.cp is not None:
            packed = None if cu_seqlens is None else packed_layout(self.cp, cu_seqlens)
            index_q, index_weights = (self.cp.gather_sequence(t.detach(), packed)
                                      for t in (index_q, index_weights))
            index_k = self.cp.gather_sequence(index_k, packed)
            q, k, v = (self.cp.sequence_to_heads(x, packed) for x in (q, k, v))
            heads = self.cp_heads
        options = dict(sink=heads(self.sink(q.device)), scale=self.softmax_scale,
                       backend=ext.sparse_backend)
        selected = lse = None
        if ext.dsa_stage == "sparse":
            selected = sparse.dsa_select(index_q, index_k, index_weights, top_k=ext.dsa_top_k,
                                         cu_seqlens=cu_seqlens, backend=ext.sparse_backend)
            out, lse = sparse.dsa_attention(q, k, v, selected, causal=True, return_lse=True,
                                            **options)
        else:
            out = sparse.softmax_attention(q, k, v, cu_seqlens=cu_seqlens, **options)
        if loss_q.requires_grad and ext.dsa_indexer_loss_coeff > 0:
            loss = sparse.dsa_indexer_loss(
                q, k, loss_q, index_k, loss_weights, selected=selected, cu_seqlens=cu_seqlens,
                lse=lse, **self._indexer_loss_options(q.shape[1], packed, q.device), **options)
            out = IndexerLoss.apply(out, ext.dsa_indexer_loss_coeff * loss)
        return out if self.cp is None else self.cp.heads_to_sequence(out, packed)


def refuse_core_recompute(layer: SelfAttention, name: str, inputs: str) -> None:
    """ConfigError for Megatron's selective recompute of the core attention in a layer whose
    core takes ``inputs`` that the layer computes before it (Megatron's recompute would call
    the core without them); the sparse ops recompute their chunks in backward anyway."""
    if layer.checkpoint_core_attention:
        raise ConfigError(
            f"{name} layers do not take recompute_modules=['core_attn'] (selective recompute): "
            f"Megatron's recompute would call the core without {inputs}, and the layer's op "
            "already recomputes its chunks in backward. Drop 'core_attn' from recompute_modules")


def rope_cu_seqlens(packed_seq_params):
    """The ``cu_seqlens`` by which RoPE places the tokens of ``thd``-packed sequences (the
    padded ones where given, as Megatron's attention does), or None for ordinary batches."""
    if packed_cu_seqlens(packed_seq_params) is None:
        return None
    if packed_seq_params.cu_seqlens_q_padded is not None:
        return packed_seq_params.cu_seqlens_q_padded
    return packed_seq_params.cu_seqlens_q


class DSASelfAttention(SelfAttention):
    """Megatron's SelfAttention plus DSA's :class:`LightningIndexer`, run on the detached
    input before the attention; the indexer's outputs go to the core as its ``index``
    argument (:func:`~megatron_ext.mixers.attention.core_inputs`)."""

    def __init__(self, config, submodules, layer_number, *args, **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        refuse_core_recompute(self, "DSA", "the indexer's outputs")
        ext = self.core_attention.ext
        self.indexer = LightningIndexer(config, ext.dsa_indexer_heads, ext.dsa_indexer_dim)

    def forward(self, hidden_states, *args, rotary_pos_emb=None, packed_seq_params=None,
                **kwargs):
        if kwargs.get("inference_context") is not None:
            raise ConfigError(cannot_decode("DSA"))
        x = hidden_states.detach()
        if self.config.sequence_parallel and self.world_size > 1:
            x = gather_from_sequence_parallel_region(x, group=self.pg_collection.tp)
        rotary = rotary_pos_emb
        if rotary is not None and not isinstance(rotary, tuple):
            rotary = (rotary, rotary)
        index = self.indexer(x, rotary, rope_cu_seqlens(packed_seq_params), self.pg_collection.cp)
        with core_inputs(self.core_attention, index=index):
            return super().forward(hidden_states, *args, rotary_pos_emb=rotary_pos_emb,
                                   packed_seq_params=packed_seq_params, **kwargs)


def freeze_all_but_indexers(model_chunks):
    """DSA's dense warm-up: ``requires_grad=False`` on every parameter outside a
    :class:`LightningIndexer`. Takes and returns a model or a list of model chunks (the
    contract of Megatron's ``pre_wrap_hooks``)."""
    for chunk in model_chunks if isinstance(model_chunks, list) else [model_chunks]:
        trained = {id(p) for module in chunk.modules() if isinstance(module, LightningIndexer)
                   for p in module.parameters()}
        for p in chunk.parameters():
            if id(p) not in trained:
                p.requires_grad_(False)
    return model_chunks


def prepare(config, ext: ExtConfig) -> None:
    """What a model with DSA layers needs from Megatron (the spec entry points call it): the
    indexer loss's gradient scale from the pipeline schedule; in the dense warm-up, when
    ``config`` is Megatron's GPTModelConfig (megatron-core >= 0.19 ``pretrain_gpt.py``), the
    freeze as a pre-wrap hook, which its builder runs once every chunk is built."""
    config.experimental_attention_variant_loss_scale_func = IndexerLoss.set_loss_scale
    hooks = getattr(config, "pre_wrap_hooks", None)
    if ext.dsa_stage == "dense_warmup" and hooks is not None and (
            freeze_all_but_indexers not in hooks):
        hooks.append(freeze_all_but_indexers)
