"""MLA: DeepSeek-V2/V3 multi-head latent attention as a pattern mixer (``+``, Megatron's hybrid
symbol for it), on megatron-core's own ``MLASelfAttention`` with its local modules.

Per token ``x`` (dims per head: ``d_n`` = ``mla_qk_head_dim``, ``d_r`` =
``mla_qk_pos_emb_head_dim``, ``d_v`` = ``mla_v_head_dim``)::

    c_q  = RMSNorm(x W_dq)                     [q_lora_rank]
    q_i  = [c_q W_uq,i ; RoPE(c_q W_qr,i)]     [d_n + d_r] per head i
    c_kv = RMSNorm(x W_dkv)                    [kv_lora_rank], k_r = RoPE(x W_kr) [d_r], shared
    k_i  = [c_kv W_uk,i ; k_r],  v_i = c_kv W_uv,i
    o    = softmax(q k^T / sqrt(d_n + d_r)) v, causal, then the output projection

so that a decoder could cache only ``c_kv`` and ``k_r`` per token. Megatron builds MLA from an
``MLATransformerConfig``; :class:`MLAMixer` makes one from the model's config and the
``ExtConfig.mla_*`` fields, so MLA layers sit among layers of a plain ``TransformerConfig``.
They apply RoPE themselves (to the ``d_r`` dims, with ``mla_rope_type``): the model's rotary
table, which ``*`` layers use, is not passed to them. The core attention is ours (torch SDPA,
:class:`~megatron_ext.mixers.attention.SDPACoreAttention`). TP splits heads (Megatron's
modules, with the latent's gradient fixed as :class:`MLAMixer` says); TP + SP and pipeline
splits equal one process (tests/parallel). Packed (``thd``) sequences: RoPE restarts and
attention stays within each sequence.

Context parallelism (Megatron's load-balanced layout, on ordinary batches and on packed
documents split per document): megatron-core's MLA rotates by the CP group's positions (its
rotary table, ``rope`` or ``yarn``, is this rank's chunks of the sequence; packed, RoPE's
``thd`` path takes each document's two local chunks at their positions in the document), and
the core, causal, all-gathers the per-head keys (``d_n + d_r`` dims) and values (``d_v``) as
for ``*`` layers (:meth:`~megatron_ext.mixers.attention.SDPACoreAttention._attend_context_parallel`;
the latent itself is not what moves). CP = 2, CP = 4 and TP = 2 x CP = 2 (+ SP) equal one
process, with ``mla_rope_type: rope`` on a batch and on packed documents and ``yarn`` on a
batch (tests/parallel/test_context_parallel.py).

Decoding runs through Megatron's static inference context (megatron-core caches the per-head
keys and values). Not yet: queries without a latent (DeepSeek-V2-Lite: megatron-core wants
Transformer Engine's fused norm + linear there), Transformer Engine's MLA modules; RoPE on a
CPU needs megatron-core's CUDA device calls redirected (as the tests do).

DSA on MLA layers (DeepSeek-V3.2; Megatron's hybrid ``D``): with
``ExtConfig.dsa_attention_type: mla`` every ``D`` layer is :class:`MLADSASelfAttention`, this
MLA plus DSA's lightning indexer (:mod:`megatron_ext.mixers.dsa`, the ``dsa_*`` settings and
training stages). As in DeepSeek-V3.2 the indexer reads the layer's normalised input ``x`` and
the query latent ``c_q``, both detached::

    q_I = c_q W_q  [HI, DI],   k_I = LayerNorm(x W_k)  [DI],   w = x W_w / sqrt(HI * DI)  [HI]
    I[t, s] = sum_j w[t, j] relu(q_I[t, j] . k_I[s])

with MLA's RoPE table (``mla_rope_type``, ``mla_rotary_base``) on the first ``d_r`` dims of
q_I and k_I, rotated as halves, where MLA's own ``d_r`` dims rotate as pairs, and under
``mla_rope_type: yarn`` without the concentration factor megatron-core puts on MLA's own
(both as DeepSeek-V3.2's indexer does). Each query attends, with all its heads, to the
``dsa_top_k`` earlier tokens the indexer scores highest: its per-head ``q_i``, ``k_i`` (latent
part and the shared RoPE key) and ``v_i`` restricted to those tokens
(:class:`MLADSACoreAttention`, on DSA's ops). The indexer's KL loss to the attention, its
dense warm-up, its TP replication and packed (``thd``) sequences are DSA's; TP and TP + SP
equal one process (tests/parallel). Context parallelism is DSA's too, not MLA's KV gather:
all-to-all over heads around the core (MLA's heads per TP rank divisible by CP; the values
move padded to the query dims, as the core pads them), the indexer's outputs all-gathered, its
RoPE table that of the rank's positions as for MLA's own; CP = 2, CP = 4 and TP = 2 x CP = 2
(+ SP) equal one process (both RoPE types on a batch, ``rope`` on packed documents). Refused
with a ConfigError, as for MLA or for DSA: decoding, a sliding window, Megatron's recompute of
the core attention, Transformer Engine.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.tensor_parallel import (
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers.common import cannot_decode
from megatron_ext.mixers.dsa import (DSACoreAttention, LightningIndexer, refuse_core_recompute,
                                     rope_cu_seqlens)
from megatron_ext.norm import TorchNorm


def mla_config(config: TransformerConfig, ext: ExtConfig) -> MLATransformerConfig:
    """The model's config as megatron-core's MLA config, with the ``ext.mla_*`` sizes."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig)
              if f.init and hasattr(config, f.name)}
    values.update(
        multi_latent_attention=True, q_lora_rank=ext.mla_q_lora_rank,
        kv_lora_rank=ext.mla_kv_lora_rank, qk_head_dim=ext.mla_qk_head_dim,
        qk_pos_emb_head_dim=ext.mla_qk_pos_emb_head_dim, v_head_dim=ext.mla_v_head_dim,
        rope_type=ext.mla_rope_type, rotary_base=ext.mla_rotary_base, qk_layernorm=True,
        # RMSNorm on both latents (qk_layernorm); keys have one head per query head (no
        # grouping), their sizes set by the per-head dims. RoPE unfused: megatron-core's fused
        # MLA RoPE is not the path tested here, and it cannot decode.
        num_query_groups=None, kv_channels=None, apply_rope_fusion=False)
    return MLATransformerConfig(**values)


class _GatherLatent(torch.autograd.Function):
    """The down-projected latent ``[s, b, width / TP]`` of each TP rank -> ``[s, b, width]``.
    Backward: this rank's columns of the gradient, after summing over TP the columns from
    ``rope_from`` on, the RoPE key, which every rank's heads read; the latent's own columns
    arrive already summed (the up-projection's input copy all-reduces them)."""

    @staticmethod
    def forward(ctx, local, group, rope_from: int):
        ctx.group, ctx.rope_from, ctx.width = group, rope_from, local.shape[-1]
        parts = [torch.empty_like(local) for _ in range(group.size())]
        torch.distributed.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rope = grad[..., ctx.rope_from:].contiguous()
        torch.distributed.all_reduce(rope, group=ctx.group)
        grad = torch.cat([grad[..., :ctx.rope_from], rope], dim=-1)
        start = ctx.group.rank() * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None, None


class MLAMixer(MLASelfAttention):
    """megatron-core's MLASelfAttention on a config of its own (:func:`mla_config`).

    Under TP its down-projections are column-parallel; megatron-core 0.19 gathers the key/value
    latent with a backward that keeps this rank's columns of the gradient unsummed, which for
    the shared RoPE key holds only the local heads' share (its TP=2 gradient is off by about
    half). :meth:`_qkv_down_projection` gathers it here instead: with sequence parallelism as
    a replicated projection of this rank's tokens (Megatron then gathers the RoPE key over the
    sequence, whose backward sums the heads' shares), without it through :class:`_GatherLatent`.
    """

    def __init__(self, config, submodules, layer_number: int, ext_config: ExtConfig,
                 attn_mask_type=AttnMaskType.causal, **kwargs):
        super().__init__(mla_config(config, ext_config), submodules, layer_number,
                         attn_mask_type, **kwargs)

    def _qkv_down_projection(self, hidden_states):
        q_compressed, kv_combined = super()._qkv_down_projection(hidden_states)
        width = self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim
        if kv_combined.size(-1) == width:  # TP = 1
            return q_compressed, kv_combined
        if self.config.sequence_parallel:
            kv_combined = scatter_to_sequence_parallel_region(
                gather_from_tensor_model_parallel_region(kv_combined))
        else:
            kv_combined = _GatherLatent.apply(kv_combined, self.tp_group, self.config.kv_lora_rank)
        return q_compressed, kv_combined

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        """The core on MLA's own head dims in every format: megatron-core pads ``thd`` values
        to the query dims (for Transformer Engine's kernels) and trims the output; our cores
        take values of another head dim than the queries and keys (SDPA does; DSA's core pads
        them itself), so under CP only ``d_v`` value dims are gathered."""
        return self.core_attention(
            query, key, value, attention_mask, packed_seq_params=packed_seq_params,
            attn_mask_type=self.attn_mask_type if attn_mask_type is None else attn_mask_type,
            **extra_kwargs)

    def forward(self, hidden_states, attention_mask=None, *args, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                inference_context=None, **kwargs):
        # The model's rotary table is for the '*' layers; MLA rotates its own RoPE dims.
        return super().forward(hidden_states, attention_mask, *args,
                               inference_context=inference_context, **kwargs)


def _pad_head_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x [..., d]`` with zeros appended to ``size`` dims."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


class MLADSACoreAttention(DSACoreAttention):
    """DSA's core on an MLA layer. DSA's ops take one head dim for q, k and v; MLA's queries
    and keys have ``d_n + d_r`` dims and its values ``d_v``. All three are zero-padded to the
    larger of the two (zero dims add nothing to a score, and the scale is MLA's own, passed in;
    zero value dims give zero output dims), and the output is cut back to ``d_v`` dims (in
    every format: :meth:`MLAMixer._run_core_attention` passes the values unpadded)."""

    # megatron-core's MLA then passes the layer input and the query latent (x, qr) to its
    # _run_core_attention, where MLADSASelfAttention turns them into this core's index.
    requires_dsa_inputs = True

    def attend(self, q, k, v, attention_mask, mask_type, packed_seq_params, index):
        width = v.shape[-1]
        dim = max(q.shape[-1], width)
        q, k, v = (_pad_head_dim(t, dim) for t in (q, k, v))
        out = super().attend(q, k, v, attention_mask, mask_type, packed_seq_params, index)
        return out[..., :width]


class MLADSASelfAttention(MLAMixer):
    """An MLA layer with DSA's :class:`~megatron_ext.mixers.dsa.LightningIndexer` (replicated
    over TP; its queries from the query latent ``c_q``, width ``mla_q_lora_rank``): the 'D'
    layers under ``dsa_attention_type: mla``. The indexer runs on the whole sequence (gathered
    under SP) of the detached input and latent, between MLA's projections and its core, which
    takes its outputs as its ``index`` argument."""

    def __init__(self, config, submodules, layer_number: int, ext_config: ExtConfig, **kwargs):
        super().__init__(config, submodules, layer_number, ext_config, **kwargs)
        refuse_core_recompute(self, "DSA", "the indexer's outputs")
        if ext_config.dsa_indexer_dim < ext_config.mla_qk_pos_emb_head_dim:
            raise ConfigError(
                f"dsa_indexer_dim={ext_config.dsa_indexer_dim} is smaller than "
                f"mla_qk_pos_emb_head_dim={ext_config.mla_qk_pos_emb_head_dim}, the dims the "
                "indexer of an MLA layer rotates with MLA's RoPE; raise dsa_indexer_dim or lower "
                "mla_qk_pos_emb_head_dim")
        self.indexer = LightningIndexer(self.config, ext_config.dsa_indexer_heads,
                                        ext_config.dsa_indexer_dim,
                                        query_size=self.config.q_lora_rank)

    def forward(self, hidden_states, *args, **kwargs):
        if kwargs.get("inference_context") is not None:
            raise ConfigError(cannot_decode("DSA"))
        return super().forward(hidden_states, *args, **kwargs)

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, *, x, qr):
        """megatron-core's MLA calls its core through this, with the layer input ``x`` and the
        normalised query latent ``qr`` (the core's ``requires_dsa_inputs``): the indexer runs
        on both and the core gets its outputs as ``index``."""
        index = self._index(x, qr, packed_seq_params)
        return super()._run_core_attention(query, key, value, attention_mask,
                                           packed_seq_params=packed_seq_params,
                                           attn_mask_type=attn_mask_type, index=index)

    def _index(self, hidden_states, q_latent, packed_seq_params):
        """The indexer's outputs, from the detached layer input and query latent."""
        x = hidden_states.detach()
        c_q = q_latent.detach().view(*x.shape[:-1], -1)  # thd: [t, r] -> [t, 1, r]
        if self.config.sequence_parallel and self.world_size > 1:
            x, c_q = (gather_from_sequence_parallel_region(t, group=self.tp_group)
                      for t in (x, c_q))
        cu_seqlens = rope_cu_seqlens(packed_seq_params)
        # The whole sequence's length (the local one times TP under SP, times CP), as
        # megatron-core's MLA takes it: under CP the table then holds this rank's positions
        # (packed: every position of a document, of which RoPE's thd path takes the rank's).
        length = self.rotary_pos_emb.get_rotary_seq_len(None, None, hidden_states, self.config,
                                                        packed_seq_params)
        freqs = self.rotary_pos_emb(length, packed_seq=cu_seqlens is not None)
        if self.config.rope_type == "yarn":
            freqs = freqs[0]  # (table, concentration factor): the table alone
        return self.indexer(x, (freqs, freqs), cu_seqlens, self.pg_collection.cp,
                            query_input=c_q)


def mla_spec(ext_config: ExtConfig, transformer_config, indexer: bool = False) -> ModuleSpec:
    """The ``self_attention`` spec of an MLA layer (registry builder of '+'): Megatron's local
    MLA submodules (RMSNorm on both latents), with our SDPA core and our norm (which takes
    sequence parallelism). ``indexer``: a 'D' layer under ``dsa_attention_type: mla``
    (:class:`MLADSASelfAttention` with :class:`MLADSACoreAttention`)."""
    from megatron_ext.mixers.attention import SDPACoreAttention

    if ext_config.attention_backend == "te":
        raise ConfigError("MLA layers ('+', and 'D' under dsa_attention_type='mla') are built "
                          "from Megatron's local modules; Transformer Engine's MLA is not wired "
                          "in: use attention_backend='sdpa'")
    spec = get_gpt_layer_local_submodules(multi_latent_attention=True, qk_layernorm=True,
                                          normalization="RMSNorm").self_attention
    attention = spec.submodules
    for name in ("q_layernorm", "kv_layernorm"):
        if getattr(attention, name) is WrappedTorchNorm:
            setattr(attention, name, TorchNorm)
    core, module = ((MLADSACoreAttention, MLADSASelfAttention) if indexer
                    else (SDPACoreAttention, MLAMixer))
    attention.core_attention = ModuleSpec(module=core, params={"ext": ext_config})
    return ModuleSpec(module=module, submodules=attention,
                      params={"ext_config": ext_config, "attn_mask_type": AttnMaskType.causal})
