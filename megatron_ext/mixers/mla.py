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
splits equal one process (tests/dist). Not yet: DSA's indexer on MLA layers (DeepSeek-V3.2),
queries without a latent (DeepSeek-V2-Lite: megatron-core wants Transformer Engine's fused
norm + linear there), context parallelism, decoding, Transformer Engine's MLA modules; RoPE on
a CPU needs megatron-core's CUDA device calls redirected (as the tests do).
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.tensor_parallel import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.norm import TorchNorm


def mla_config(config: TransformerConfig, ext: ExtConfig) -> MLATransformerConfig:
    """The model's config as megatron-core's MLA config, with the ``ext.mla_*`` sizes."""
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ConfigError("mla layers do not run under context parallelism yet; use "
                          "context_parallel_size=1 or other mixers")
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

    def forward(self, hidden_states, attention_mask=None, *args, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None,
                inference_context=None, **kwargs):
        # The model's rotary table is for the '*' layers; MLA rotates its own RoPE dims.
        return super().forward(hidden_states, attention_mask, *args,
                               inference_context=inference_context, **kwargs)


def mla_spec(ext_config: ExtConfig, transformer_config) -> ModuleSpec:
    """The ``self_attention`` spec of an MLA layer (registry builder): Megatron's local MLA
    submodules (RMSNorm on both latents), with our SDPA core and our norm (which takes sequence
    parallelism)."""
    from megatron_ext.mixers.attention import SDPACoreAttention

    if ext_config.attention_backend == "te":
        raise ConfigError("mla layers are built from Megatron's local modules; Transformer "
                          "Engine's MLA is not wired in: use attention_backend='sdpa'")
    spec = get_gpt_layer_local_submodules(multi_latent_attention=True, qk_layernorm=True,
                                          normalization="RMSNorm").self_attention
    attention = spec.submodules
    for name in ("q_layernorm", "kv_layernorm"):
        if getattr(attention, name) is WrappedTorchNorm:
            setattr(attention, name, TorchNorm)
    attention.core_attention = ModuleSpec(module=SDPACoreAttention, params={"ext": ext_config})
    return ModuleSpec(module=MLAMixer, submodules=attention,
                      params={"ext_config": ext_config, "attn_mask_type": AttnMaskType.causal})
