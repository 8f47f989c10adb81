"""Gated DeltaNet as a Megatron token mixer (the ``G`` symbol).

Yang, Kautz, Hatamizadeh, "Gated Delta Networks: Improving Mamba2 with Delta Rule" (ICLR 2025).
Per token: q, k, v from linear projections, each through a short causal depthwise convolution
and SiLU; q and k L2-normalised per head; ``beta = sigmoid(x W_b)``; log-decay
``g = -exp(A_log) * softplus(x W_a + dt_bias)`` (one per value head); then the gated delta rule
(:func:`megatron_ext.kernels.gated_delta_rule`); a per-head RMSNorm gated by ``silu(x W_z)``;
and the output projection.

Tensor parallelism splits heads: every projection is column-parallel over heads, the output
projection row-parallel, and the per-head parameters (``A_log``, ``dt_bias``, conv weights,
output-norm weight) are sharded with their heads, so no gradient needs a TP all-reduce. The
output norm therefore has one weight vector per value head (fla-core shares one over heads).
Separate projections (rather than one fused matrix) keep each TP shard a plain slice of the
full weight, so checkpoints reshard across TP sizes without split factories.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)

from megatron_ext.config import ConfigError
from megatron_ext.kernels import gated_delta_rule


@dataclass
class GatedDeltaNetSubmodules:
    column_linear: type = ColumnParallelLinear
    row_linear: type = RowParallelLinear


class GatedDeltaNet(MegatronModule):
    """Megatron mixer contract: ``forward(hidden [s, b, h], ...) -> (out [s, b, h], bias)``."""

    # Raw parameters sharded over TP along dim 0 (heads or head-major channels).
    TP_SHARDED = ("A_log", "dt_bias", "conv_q", "conv_k", "conv_v", "out_norm_weight")

    def __init__(self, config, submodules: GatedDeltaNetSubmodules, layer_number: int,
                 ext_config, pg_collection=None, **_unused):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        if config.context_parallel_size > 1:
            raise NotImplementedError(
                "Gated DeltaNet does not support context_parallel_size > 1 yet")

        head_dim = config.kv_channels
        key_heads = ext_config.gdn_num_key_heads or config.num_query_groups or config.num_attention_heads
        value_heads = ext_config.gdn_num_value_heads or config.num_attention_heads
        self.key_dim = ext_config.gdn_key_head_dim or head_dim
        self.value_dim = ext_config.gdn_value_head_dim or head_dim
        if value_heads % key_heads:
            raise ConfigError(
                f"gdn_num_value_heads={value_heads} must be a multiple of "
                f"gdn_num_key_heads={key_heads} (each key head serves a group of value heads)")
        if key_heads % tp_size:
            raise ConfigError(
                f"gdn_num_key_heads={key_heads} is not divisible by "
                f"tensor_model_parallel_size={tp_size}; choose a multiple of the TP size")
        self.key_heads = key_heads // tp_size
        self.value_heads = value_heads // tp_size
        self.chunk_size = ext_config.gdn_chunk_size
        self.kernel_backend = ext_config.kernel_backend

        h = config.hidden_size
        qk_size, v_size = key_heads * self.key_dim, value_heads * self.value_dim

        def column(name, out_size):
            return build_module(
                submodules.column_linear, h, out_size, config=config,
                init_method=config.init_method, gather_output=False, bias=False,
                skip_bias_add=False, is_expert=False, tp_comm_buffer_name=name,
                tp_group=self.tp_group)

        self.linear_q = column("gdn_q", qk_size)
        self.linear_k = column("gdn_k", qk_size)
        self.linear_v = column("gdn_v", v_size)
        self.linear_gate = column("gdn_gate", v_size)
        self.linear_beta = column("gdn_beta", value_heads)
        self.linear_decay = column("gdn_decay", value_heads)
        self.linear_out = build_module(
            submodules.row_linear, v_size, h, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name="gdn_out", tp_group=self.tp_group)

        # Raw per-head parameters: drawn at full size from the (TP-identical) default generator
        # and sliced, so that every TP size starts from the same model.
        def local(full: torch.Tensor) -> torch.nn.Parameter:
            shard = full.chunk(tp_size, dim=0)[tp_rank].contiguous()
            p = torch.nn.Parameter(shard.to(config.params_dtype))
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
            return p

        kernel = ext_config.gdn_conv_kernel
        bound = 1.0 / math.sqrt(kernel)  # torch's default Conv1d init for a depthwise filter
        self.conv_q = local(torch.empty(qk_size, kernel).uniform_(-bound, bound))
        self.conv_k = local(torch.empty(qk_size, kernel).uniform_(-bound, bound))
        self.conv_v = local(torch.empty(v_size, kernel).uniform_(-bound, bound))
        # Decay rates A in [1, 16] and time steps dt log-uniform in [1e-3, 1e-1], as in
        # Mamba-2 and the GDN paper; dt_bias is softplus^-1(dt).
        self.A_log = local(torch.empty(value_heads).uniform_(1, 16).log())
        dt = torch.exp(torch.empty(value_heads).uniform_(math.log(1e-3), math.log(1e-1)))
        dt = dt.clamp(min=1e-4)
        self.dt_bias = local(dt + torch.log(-torch.expm1(-dt)))
        self.out_norm_weight = local(torch.ones(value_heads, self.value_dim))
        self.norm_eps = config.layernorm_epsilon
        for name in ("A_log", "dt_bias"):
            getattr(self, name)._no_weight_decay = True

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None,
                **_unused):
        """hidden_states ``[s, b, h]`` -> (``[s, b, h]``, bias or None)."""
        q, _ = self.linear_q(hidden_states)  # [s, b, Hk*K] (full s: SP gathers here)
        k, _ = self.linear_k(hidden_states)
        v, _ = self.linear_v(hidden_states)
        gate, _ = self.linear_gate(hidden_states)
        beta, _ = self.linear_beta(hidden_states)
        decay, _ = self.linear_decay(hidden_states)
        s, b = q.shape[:2]

        cu_seqlens = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q
        same_sequence = _same_sequence_masks(cu_seqlens, s, self.conv_q.shape[1], q.device)

        def to_heads(x, heads, conv):
            x = x.transpose(0, 1)  # [b, s, C]
            x = F.silu(_causal_depthwise_conv(x, conv, same_sequence))
            return x.reshape(b, s, heads, -1)

        q = F.normalize(to_heads(q, self.key_heads, self.conv_q).float(), dim=-1)
        k = F.normalize(to_heads(k, self.key_heads, self.conv_k).float(), dim=-1)
        v = to_heads(v, self.value_heads, self.conv_v)
        beta = torch.sigmoid(beta.transpose(0, 1).float())  # [b, s, Hv]
        g = -self.A_log.float().exp() * F.softplus(decay.transpose(0, 1).float()
                                                   + self.dt_bias.float())
        o, _ = gated_delta_rule(q.to(v.dtype), k.to(v.dtype), v, beta=beta, g=g,
                                cu_seqlens=cu_seqlens, backend=self.kernel_backend)

        # Gated RMSNorm per head: norm(o) * w_head * silu(z).
        o = o.float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        o = o * self.out_norm_weight.float()
        gate = gate.transpose(0, 1).reshape(b, s, self.value_heads, self.value_dim)
        o = (o * F.silu(gate.float())).to(hidden_states.dtype)
        o = o.reshape(b, s, -1).transpose(0, 1).contiguous()  # [s, b, Hv*V]
        return self.linear_out(o)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        own = {}
        self._save_to_state_dict(own, "", keep_vars=True)
        sharded = make_sharded_tensors_for_checkpoint(
            own, prefix, {name: 0 for name in self.TP_SHARDED}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])
        for name, child in self.named_children():
            sharded.update(sharded_state_dict_default(
                child, f"{prefix}{name}.", sharded_offsets, metadata, tp_group=self.tp_group))
        return sharded


def _same_sequence_masks(cu_seqlens, length: int, kernel: int, device):
    """For packed sequences: mask[j][t] says whether token t-j is in t's sequence (j < kernel)."""
    if cu_seqlens is None:
        return None
    positions = torch.arange(length, device=device)
    seq_id = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    masks = []
    for shift in range(kernel):
        earlier = torch.full_like(seq_id, -1)
        earlier[shift:] = seq_id[: length - shift]
        masks.append(earlier == seq_id)
    return masks


def _causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, same_sequence=None):
    """``y[:, t, c] = sum_j weight[c, K-1-j] * x[:, t-j, c]`` for ``[b, s, C]`` inputs.

    Tap ``K-1`` multiplies the current token (torch Conv1d's orientation). With packed
    sequences, ``same_sequence[j]`` drops taps that would reach into the previous sequence.
    """
    kernel = weight.shape[1]
    out = x * weight[:, kernel - 1]
    for shift in range(1, kernel):
        shifted = F.pad(x, (0, 0, shift, 0))[:, : x.shape[1]]
        if same_sequence is not None:
            shifted = shifted * same_sequence[shift].view(1, -1, 1).to(x.dtype)
        out = out + shifted * weight[:, kernel - 1 - shift]
    return out


def gated_deltanet_spec(ext_config, transformer_config) -> ModuleSpec:
    return ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(),
                      params={"ext_config": ext_config})
