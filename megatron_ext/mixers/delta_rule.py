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
Around the op: one fused input projection (q, k, v, the output gate, the erase/write gates and
GDN's decay); q, k and v each through a short causal depthwise convolution and SiLU, q and k
L2-normalised per head, in one kernel per tensor (:mod:`megatron_ext.kernels.fused`); the
sigmoid gates and the log-decay in one kernel each (``kernels.fused.gate``); a per-head
RMSNorm gated by ``silu(x W_z)`` (one kernel, which also writes Megatron's ``[s, b, h]``
layout); the output projection. The convolutions', the gates' and the norm's backward kernels
write their input gradients into one buffer for the fused projection's gradient
(:meth:`~megatron_ext.mixers.common.HeadShardedModule.split_outputs`), so the parts' gradients are
not concatenated. (KDA's paper gates its output with a low-rank sigmoid; we use GDN's full-rank SiLU
gate for all four, so that they differ only in the recurrence.)

Tensor parallelism splits heads: the input projections are column-parallel over heads (each
rank's rows of the fused one are its slices of every part, and checkpoints store the parts as
separate TP-sharded tensors, so they reshard across TP sizes) and the output projection
row-parallel; the per-head parameters (``A_log``, ``dt_bias``, conv weights,
output-norm weight) are sharded with their heads, so no gradient needs a TP all-reduce (hence
one output-norm weight per value head, where fla-core shares one over heads). The low-rank
decay projection's first factor is column-parallel with its output gathered.

Context parallelism (``context_parallel_size > 1``, Megatron's load-balanced layout): the
convolutions take their halo from the neighbouring chunks, and the op runs under
:func:`megatron_ext.parallel.linear.linear_recurrence`, by state passing (default) or all-to-all
(``ExtConfig.context_parallel_method``); the equations are in that module.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config import ConfigError
from megatron_ext.kernels import gated_delta_rule
from megatron_ext.kernels.delta_rule import gated_delta_rule_summary
from megatron_ext.kernels.fused import gate, gated_rms_norm, sequence_positions
from megatron_ext.mixers.common import (
    HeadShardedModule,
    LinearMixerSubmodules,
    conv_silu_heads,
    packed_cu_seqlens,
    recurrent_state,
)
from megatron_ext.parallel import ContextParallel
from megatron_ext.parallel.linear import check_heads, check_sequence, linear_recurrence

VARIANTS = ("deltanet", "gated_deltanet", "kda", "gated_deltanet2")


def _batch_first(t: torch.Tensor) -> torch.Tensor:  # [s, b, ...] -> [b, s, ...], a view
    return t.transpose(0, 1)


class DeltaRuleMixer(HeadShardedModule):
    """Megatron mixer contract: ``forward(hidden [s, b, h], ...) -> (out [s, b, h], bias)``.

    With cross-layer routing on, the forward returns ``(out, bias, signal)``: the routed signal
    (its value v for CLVR, its write residual r for CLER-H; ``[s, b, local value heads * V]``)
    for the layer to project into the residual stream
    (:class:`~megatron_ext.specs.ExtTransformerLayer`).
    """

    def __init__(self, config, submodules: LinearMixerSubmodules, layer_number: int,
                 ext_config, variant: str, pg_collection=None, **_unused):
        super().__init__(config, submodules, pg_collection)
        if variant not in VARIANTS:
            raise ConfigError(f"delta-rule variant {variant!r} is not one of {list(VARIANTS)}")
        self.variant = variant
        self.layer_number = layer_number

        ext = ext_config
        key_heads = ext.linear_num_key_heads or config.num_query_groups or config.num_attention_heads
        value_heads = ext.linear_num_value_heads or config.num_attention_heads
        self.key_dim = ext.linear_key_head_dim or config.kv_channels
        self.value_dim = ext.linear_value_head_dim or config.kv_channels
        if value_heads % key_heads:
            raise ConfigError(
                f"linear_num_value_heads={value_heads} must be a multiple of "
                f"linear_num_key_heads={key_heads} (each key head serves a group of value heads)")
        if key_heads % self.tp_size:
            raise ConfigError(
                f"linear_num_key_heads={key_heads} is not divisible by "
                f"tensor_model_parallel_size={self.tp_size}; choose a multiple of the TP size")
        self.key_heads = key_heads // self.tp_size
        self.value_heads = value_heads // self.tp_size
        self.cp = ContextParallel.of(config, pg_collection)
        self.cp_method = ext.context_parallel_method
        check_heads(self.cp, self.cp_method, variant, key_heads=self.key_heads,
                    value_heads=self.value_heads)
        self.kernel_backend = ext.kernel_backend
        self.routing = ext.cross_layer_routing
        self.routed_size = value_heads * self.value_dim  # over all TP ranks
        per_channel_decay = variant in ("kda", "gated_deltanet2")

        h = config.hidden_size
        qk_size, v_size = key_heads * self.key_dim, value_heads * self.value_dim
        # Per-channel decays act on the key channels of each value head.
        decay_size = value_heads * self.key_dim if per_channel_decay else value_heads

        # One input projection for q, k, v, the output gate, the erase/write gates and, for GDN,
        # the per-head decay (its TP split map in HeadShardedModule.fused_column).
        parts = {"q": qk_size, "k": qk_size, "v": v_size, "gate": v_size}
        if variant == "gated_deltanet2":
            parts.update(erase=value_heads * self.key_dim, write=v_size)
        else:
            parts["beta"] = value_heads
        if variant == "gated_deltanet":
            parts["decay"] = value_heads
        self.in_proj = self.fused_column("in_proj", h, parts)
        if per_channel_decay:
            self.low_rank_decay_projection("delta", h, ext.linear_decay_rank or self.value_dim,
                                           decay_size)
        self.linear_out = self.row("delta_out", v_size, h)

        kernel = ext.linear_conv_kernel
        self.conv_q = self.conv_parameter("conv_q", qk_size, kernel)
        self.conv_k = self.conv_parameter("conv_k", qk_size, kernel)
        self.conv_v = self.conv_parameter("conv_v", v_size, kernel)
        if variant != "deltanet":
            self.decay_parameters(value_heads, decay_size)
        self.sharded_parameter("out_norm_weight", torch.ones(value_heads, self.value_dim))
        self.norm_eps = config.layernorm_epsilon

    def _decay(self, x: torch.Tensor, projected: dict, grad_into, b: int,
               s: int) -> torch.Tensor | None:
        """Log-decay g: None, ``[b, s, Hv]`` or ``[b, s, Hv, K]`` (fp32, <= 0)."""
        if self.variant == "deltanet":
            return None
        if self.variant == "gated_deltanet":
            a, into = projected["decay"], grad_into("decay", _batch_first)
        else:
            a, into = self.low_rank_decay(x), None
        g = gate(_batch_first(a), self.A_log, self.dt_bias, grad_into=into)  # [b, s, Hv * C]
        per_channel = () if self.variant == "gated_deltanet" else (-1,)
        return g.reshape(b, s, self.value_heads, *per_channel)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None,
                inference_context=None, **_unused):
        """hidden_states ``[s, b, h]`` -> (``[s, b, h]``, bias or None), and with cross-layer
        routing the routed signal ``[s, b, local value heads * V]``. With Megatron's
        ``inference_context``, the tokens continue the ones before them (see
        :meth:`~megatron_ext.mixers.common.HeadShardedModule.decoding_cache`)."""
        cache = self.decoding_cache(inference_context, packed_seq_params)
        projected, _ = self.in_proj(hidden_states)  # [s, b, widths] (full s: SP gathers here)
        projected, grad_into = self.split_outputs("in_proj", projected)
        s, b = projected["q"].shape[:2]
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        packed = check_sequence(self.cp, s, cu_seqlens, self.conv_q.shape[1], self.variant)
        positions = sequence_positions(cu_seqlens, s, hidden_states.device)

        def sigmoid_gate(name, per_head_channels):  # fp32 [b, s, Hv, ...]
            return gate(_batch_first(projected[name]), grad_into=grad_into(name, _batch_first)
                        ).reshape(b, s, self.value_heads, *per_head_channels)

        # Conv + SiLU (+ L2 norm per head for q and k) in one kernel each, read in place.
        q = conv_silu_heads(projected["q"], self.conv_q, self.key_heads, positions, self.cp,
                            packed, l2_norm=True, cache=cache, name="q", grad_into=grad_into("q"))
        k = conv_silu_heads(projected["k"], self.conv_k, self.key_heads, positions, self.cp,
                            packed, l2_norm=True, cache=cache, name="k", grad_into=grad_into("k"))
        v = conv_silu_heads(projected["v"], self.conv_v, self.value_heads, positions, self.cp,
                            packed, cache=cache, name="v", grad_into=grad_into("v"))
        gates = {}
        if self.variant == "gated_deltanet2":
            gates["erase"] = sigmoid_gate("erase", (self.key_dim,))
            gates["write"] = sigmoid_gate("write", (self.value_dim,))
        else:
            gates["beta"] = sigmoid_gate("beta", ())
        o, final, *residual = linear_recurrence(
            self.cp, self.cp_method, gated_delta_rule, gated_delta_rule_summary,
            dict(q=q, k=k, v=v, g=self._decay(hidden_states, projected, grad_into, b, s),
                 **gates),
            cu_seqlens=cu_seqlens, backend=self.kernel_backend,
            return_write_residual=self.routing == "cler_h",
            **recurrent_state(cache))
        if cache is not None:
            cache["state"] = final

        def gate_heads(z):  # [s, b, Hv * V] -> [b, s, Hv, V]
            return z.transpose(0, 1).unflatten(-1, (self.value_heads, self.value_dim))

        o = gated_rms_norm(o.to(hidden_states.dtype), self.out_norm_weight,
                           gate_heads(projected["gate"]), self.norm_eps, sequence_first=True,
                           gate_grad_into=grad_into("gate", gate_heads))  # [s, b, Hv * V]
        out, bias = self.linear_out(o)
        if self.routing == "none":
            return out, bias
        signal = residual[0] if self.routing == "cler_h" else v
        return out, bias, signal.reshape(b, s, -1).transpose(0, 1)


def delta_rule_spec(ext_config, transformer_config, variant: str) -> ModuleSpec:
    """The ``self_attention`` spec of one delta-rule variant (registry builder)."""
    return ModuleSpec(module=DeltaRuleMixer, submodules=LinearMixerSubmodules(),
                      params={"ext_config": ext_config, "variant": variant})
