"""The delta-rule token mixers as Megatron layers: DeltaNet, Gated DeltaNet, KDA, Gated DeltaNet-2.

All four are one module around one op, :func:`megatron_ext.kernels.gated_delta_rule`
(``S_t = (I - k_t (b_t * k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T``); they differ only
in their gates:

============================  ==========================  =================================
variant                       decay ``g``                 erase ``b`` / write ``w``
============================  ==========================  =================================
``deltanet`` (Yang 2024)      none                        ``b = w = beta = sigmoid(x W_b)``
``gated_deltanet`` (GDN)      one per value head          ``beta``
``kda`` (Kimi Linear 2025)    one per key channel         ``beta``
``gated_deltanet2`` (GDN-2)   one per key channel         ``b`` per key channel, ``w`` per
                                                          value channel, both sigmoids
============================  ==========================  =================================

Decays follow Mamba-2 / GDN: ``g = -exp(A_log) * softplus(a + dt_bias)`` with ``A_log`` per head
and, per key channel, ``a`` from a low-rank projection ``x W_down W_up`` as in Kimi Linear.
Around the op: q, k, v projections, each through a short causal depthwise convolution and
SiLU; q and k L2-normalised per head; a per-head RMSNorm gated by ``silu(x W_z)``; the output
projection. (KDA's paper gates its output with a low-rank sigmoid; we use GDN's full-rank SiLU
gate for all four, so that they differ only in the recurrence.)

Tensor parallelism splits heads: every projection is column-parallel over heads and the output
projection row-parallel; the per-head parameters (``A_log``, ``dt_bias``, conv weights,
output-norm weight) are sharded with their heads, so no gradient needs a TP all-reduce (hence
one output-norm weight per value head, where fla-core shares one over heads). The low-rank
decay projection's first factor is column-parallel with its output gathered. Separate
projections, rather than one fused matrix, keep each TP shard a plain slice of the full weight,
so checkpoints reshard across TP sizes without split factories.
"""

from __future__ import annotations

import copy
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

VARIANTS = ("deltanet", "gated_deltanet", "kda", "gated_deltanet2")


@dataclass
class DeltaRuleSubmodules:
    column_linear: type = ColumnParallelLinear
    row_linear: type = RowParallelLinear


class DeltaRuleMixer(MegatronModule):
    """Megatron mixer contract: ``forward(hidden [s, b, h], ...) -> (out [s, b, h], bias)``."""

    # Raw parameters sharded over TP along dim 0 (heads or head-major channels).
    TP_SHARDED = ("A_log", "dt_bias", "conv_q", "conv_k", "conv_v", "out_norm_weight")

    def __init__(self, config, submodules: DeltaRuleSubmodules, layer_number: int,
                 ext_config, variant: str, pg_collection=None, **_unused):
        super().__init__(config=config)
        if variant not in VARIANTS:
            raise ConfigError(f"delta-rule variant {variant!r} is not one of {list(VARIANTS)}")
        self.variant = variant
        self.layer_number = layer_number
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        tp_size = self.tp_group.size() if self.tp_group is not None else 1
        tp_rank = self.tp_group.rank() if self.tp_group is not None else 0
        if config.context_parallel_size > 1:
            raise NotImplementedError(
                f"{variant} does not support context_parallel_size > 1 yet")

        ext = ext_config
        key_heads = ext.linear_num_key_heads or config.num_query_groups or config.num_attention_heads
        value_heads = ext.linear_num_value_heads or config.num_attention_heads
        self.key_dim = ext.linear_key_head_dim or config.kv_channels
        self.value_dim = ext.linear_value_head_dim or config.kv_channels
        if value_heads % key_heads:
            raise ConfigError(
                f"linear_num_value_heads={value_heads} must be a multiple of "
                f"linear_num_key_heads={key_heads} (each key head serves a group of value heads)")
        if key_heads % tp_size:
            raise ConfigError(
                f"linear_num_key_heads={key_heads} is not divisible by "
                f"tensor_model_parallel_size={tp_size}; choose a multiple of the TP size")
        self.key_heads = key_heads // tp_size
        self.value_heads = value_heads // tp_size
        self.kernel_backend = ext.kernel_backend
        per_channel_decay = variant in ("kda", "gated_deltanet2")

        h = config.hidden_size
        qk_size, v_size = key_heads * self.key_dim, value_heads * self.value_dim
        # Per-channel decays act on the key channels of each value head.
        decay_size = value_heads * self.key_dim if per_channel_decay else value_heads

        def column(name, in_size, out_size, gather_output=False, layer_config=config):
            return build_module(
                submodules.column_linear, in_size, out_size, config=layer_config,
                init_method=config.init_method, gather_output=gather_output, bias=False,
                skip_bias_add=False, is_expert=False, tp_comm_buffer_name=name,
                tp_group=self.tp_group)

        self.linear_q = column("delta_q", h, qk_size)
        self.linear_k = column("delta_k", h, qk_size)
        self.linear_v = column("delta_v", h, v_size)
        self.linear_gate = column("delta_gate", h, v_size)
        if variant == "gated_deltanet2":
            self.linear_erase = column("delta_erase", h, value_heads * self.key_dim)
            self.linear_write = column("delta_write", h, v_size)
        else:
            self.linear_beta = column("delta_beta", h, value_heads)
        if variant == "gated_deltanet":
            self.linear_decay = column("delta_decay", h, value_heads)
        elif per_channel_decay:
            rank = ext.linear_decay_rank or self.value_dim
            if rank % tp_size:
                raise ConfigError(f"linear_decay_rank={rank} is not divisible by "
                                  f"tensor_model_parallel_size={tp_size}")
            self.linear_decay_down = column("delta_decay_down", h, rank, gather_output=True)
            # Its input is already the whole sequence (the first factor gathered it under SP).
            full_sequence = copy.copy(config)
            full_sequence.sequence_parallel = False
            self.linear_decay = column("delta_decay", rank, decay_size, layer_config=full_sequence)
        self.linear_out = build_module(
            submodules.row_linear, v_size, h, config=config,
            init_method=config.output_layer_init_method, bias=config.add_bias_linear,
            input_is_parallel=True, skip_bias_add=True, is_expert=False,
            tp_comm_buffer_name="delta_out", tp_group=self.tp_group)

        # Raw per-head parameters: drawn at full size from the (TP-identical) default generator
        # and sliced, so that every TP size starts from the same model.
        def local(full: torch.Tensor) -> torch.nn.Parameter:
            shard = full.chunk(tp_size, dim=0)[tp_rank].contiguous()
            p = torch.nn.Parameter(shard.to(config.params_dtype))
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
            return p

        kernel = ext.linear_conv_kernel
        bound = 1.0 / math.sqrt(kernel)  # torch's default Conv1d init for a depthwise filter
        self.conv_q = local(torch.empty(qk_size, kernel).uniform_(-bound, bound))
        self.conv_k = local(torch.empty(qk_size, kernel).uniform_(-bound, bound))
        self.conv_v = local(torch.empty(v_size, kernel).uniform_(-bound, bound))
        if variant != "deltanet":
            # Decay rates A in [1, 16] and time steps dt log-uniform in [1e-3, 1e-1], as in
            # Mamba-2 and the GDN paper; dt_bias is softplus^-1(dt).
            self.A_log = local(torch.empty(value_heads).uniform_(1, 16).log())
            dt = torch.exp(torch.empty(decay_size).uniform_(math.log(1e-3), math.log(1e-1)))
            dt = dt.clamp(min=1e-4)
            self.dt_bias = local(dt + torch.log(-torch.expm1(-dt)))
            self.A_log._no_weight_decay = self.dt_bias._no_weight_decay = True
        self.out_norm_weight = local(torch.ones(value_heads, self.value_dim))
        self.norm_eps = config.layernorm_epsilon

    def _decay(self, x: torch.Tensor, b: int, s: int) -> torch.Tensor | None:
        """Log-decay g: None, ``[b, s, Hv]`` or ``[b, s, Hv, K]`` (fp32, <= 0)."""
        if self.variant == "deltanet":
            return None
        if self.variant == "gated_deltanet":
            a, _ = self.linear_decay(x)
        else:
            low_rank, _ = self.linear_decay_down(x)
            a, _ = self.linear_decay(low_rank)
        a = a.transpose(0, 1).float().reshape(b, s, self.value_heads, -1)
        a = a + self.dt_bias.float().view(self.value_heads, -1)
        g = -self.A_log.float().exp().view(-1, 1) * F.softplus(a)
        return g.squeeze(-1) if self.variant == "gated_deltanet" else g

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None,
                **_unused):
        """hidden_states ``[s, b, h]`` -> (``[s, b, h]``, bias or None)."""
        q, _ = self.linear_q(hidden_states)  # [s, b, Hk*K] (full s: SP gathers here)
        k, _ = self.linear_k(hidden_states)
        v, _ = self.linear_v(hidden_states)
        gate, _ = self.linear_gate(hidden_states)
        s, b = q.shape[:2]

        cu_seqlens = None
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_seqlens = packed_seq_params.cu_seqlens_q
        same_sequence = _same_sequence_masks(cu_seqlens, s, self.conv_q.shape[1], q.device)

        def to_heads(x, heads, conv):
            x = x.transpose(0, 1)  # [b, s, C]
            x = F.silu(_causal_depthwise_conv(x, conv, same_sequence))
            return x.reshape(b, s, heads, -1)

        def sigmoid_gate(linear, per_head_channels):
            out, _ = linear(hidden_states)
            return torch.sigmoid(out.transpose(0, 1).float()).reshape(
                b, s, self.value_heads, *per_head_channels)

        q = F.normalize(to_heads(q, self.key_heads, self.conv_q).float(), dim=-1)
        k = F.normalize(to_heads(k, self.key_heads, self.conv_k).float(), dim=-1)
        v = to_heads(v, self.value_heads, self.conv_v)
        gates = {}
        if self.variant == "gated_deltanet2":
            gates["erase"] = sigmoid_gate(self.linear_erase, (self.key_dim,))
            gates["write"] = sigmoid_gate(self.linear_write, (self.value_dim,))
        else:
            gates["beta"] = sigmoid_gate(self.linear_beta, ())
        o, _ = gated_delta_rule(q.to(v.dtype), k.to(v.dtype), v, g=self._decay(hidden_states, b, s),
                                cu_seqlens=cu_seqlens, backend=self.kernel_backend, **gates)

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


def delta_rule_spec(ext_config, transformer_config, variant: str) -> ModuleSpec:
    """The ``self_attention`` spec of one delta-rule variant (registry builder)."""
    return ModuleSpec(module=DeltaRuleMixer, submodules=DeltaRuleSubmodules(),
                      params={"ext_config": ext_config, "variant": variant})
