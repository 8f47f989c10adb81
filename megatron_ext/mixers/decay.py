"""The decay family of linear attention as Megatron layers: GLA, RetNet, Lightning, Mamba-2.

All run on one op, :func:`megatron_ext.kernels.decay_linear_attention`
(``S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T``, ``o_t = scale * S_t^T q_t``), and differ in
where q, k, v and the decay come from:

- ``gla`` (Yang et al., ICML 2024): decay per key channel,
  ``g = logsigmoid(x W_down W_up + b) / 16`` (the paper's gate normaliser);
- ``retnet`` (Sun et al. 2023): a fixed decay per head, ``gamma_h = 1 - 2^(-5-h)``;
- ``lightning`` (Qin et al. 2024, as in MiniMax-01): a fixed decay per head,
  ``exp(-slope_h * (1 - (l-1)/(L-1) + 1e-5))`` with ALiBi slopes ``2^(-8 (h+1) / H)`` and the
  layer's position l of L; SiLU feature maps on q and k;
- ``hgrn2`` (Qin et al., "HGRN2: Gated Linear RNNs with State Expansion", 2024): a forget gate
  per key channel ``f = b_l + (1 - b_l) sigmoid(x W_f)`` with the layer's lower bound
  ``b_l = (l - 1) / L`` (HGRN learns bounds that rise with depth; here they are fixed on that
  schedule), decay ``g = log f``, key ``k = 1 - f`` (what is forgotten is written), query
  ``silu(x W_q)`` and scale 1: ``S_t = Diag(f_t) S_{t-1} + (1 - f_t) v_t^T``;
- ``hedgehog`` (Zhang et al., ICLR 2024, "The Hedgehog & the Porcupine"): linear attention with
  a learned feature map per head, ``phi(x) = [softmax(x W + b), softmax(-(x W + b))]`` (2K
  features; W starts as the identity), no decay, and its normaliser:
  ``o_t = phi(q_t)^T S_t / (phi(q_t) . sum_{j <= t} phi(k_j))`` with
  ``S_t = sum_{j <= t} phi(k_j) v_j^T``; then the output projection (no output norm or gate: a
  per-head norm would cancel the normaliser). Not under context parallelism.

Around the op (GLA, RetNet, Lightning, HGRN-2): one fused input projection (q, k, v and the
output gate), a per-head RMSNorm gated by ``silu(x W_z)`` (one kernel,
:mod:`megatron_ext.kernels.fused`) and the output projection. :class:`Mamba2Mixer` keeps
Mamba-2's own layout (one fused projection to z, x, B, C and dt; a causal convolution + SiLU
over x, B and C; ``A`` per head; ``D`` skip) on the same op: Dao & Gu, "Transformers are SSMs"
(ICML 2024).

Tensor parallelism splits heads (and Mamba-2's B/C groups); the fused projections' rows and the
per-head raw parameters are sharded with their heads (see
:class:`~megatron_ext.mixers.common.HeadShardedModule`). Context
parallelism: as in :mod:`megatron_ext.mixers.delta_rule` (convolution halo for Mamba-2; state
passing or all-to-all around the op, :mod:`megatron_ext.parallel.linear`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config import ConfigError
from megatron_ext.kernels import decay_linear_attention
from megatron_ext.kernels.decay import decay_linear_attention_summary
from megatron_ext.kernels.fused import gated_rms_norm, sequence_positions
from megatron_ext.mixers.common import (
    HeadShardedModule,
    LinearMixerSubmodules,
    conv_silu_heads,
    packed_cu_seqlens,
    recurrent_state,
)
from megatron_ext.parallel import ContextParallel
from megatron_ext.parallel.linear import check_heads, check_sequence, linear_recurrence

VARIANTS = ("gla", "retnet", "lightning", "hgrn2", "hedgehog")
GLA_GATE_NORMALIZER = 16.0


class DecayMixer(HeadShardedModule):
    """GLA, RetNet, Lightning, HGRN-2 or Hedgehog: ``forward(hidden [s, b, h]) -> (out, bias)``."""

    def __init__(self, config, submodules: LinearMixerSubmodules, layer_number: int,
                 ext_config, variant: str, pg_collection=None, **_unused):
        super().__init__(config, submodules, pg_collection)
        if variant not in VARIANTS:
            raise ConfigError(f"decay variant {variant!r} is not one of {list(VARIANTS)}")
        self.variant = variant
        self.layer_number = layer_number
        ext = ext_config
        heads = self.same_heads(config, ext, variant, pg_collection)
        self.kernel_backend = ext.kernel_backend
        h = config.hidden_size
        qk_size, v_size = heads * self.key_dim, heads * self.value_dim

        parts = {"q": qk_size, "k": qk_size, "v": v_size}
        if variant != "hedgehog":
            parts["gate"] = v_size
        self.in_proj = self.fused_column("in_proj", h, parts)
        self.linear_out = self.row("decay_out", v_size, h)
        if variant == "hedgehog":
            if self.cp is not None:
                raise ConfigError("hedgehog's normaliser (a running sum of the key features) "
                                  "does not run under context parallelism; use "
                                  "context_parallel_size=1 or another mixer")
            self.sharded_parameter("feature_map", torch.eye(self.key_dim).repeat(heads, 1, 1))
            self.sharded_parameter("feature_bias", torch.zeros(heads, self.key_dim))
        elif variant == "gla":
            self.low_rank_decay_projection("gla", h, ext.linear_decay_rank or 16, qk_size)
            self.sharded_parameter("decay_bias", torch.zeros(qk_size))
        elif variant == "hgrn2":  # the "k" projection gives the forget gate's logits
            self.forget_lower_bound = (layer_number - 1) / config.num_layers
        else:
            # Fixed decays: buffers of the global heads this rank holds (not trained).
            global_heads = torch.arange(heads, dtype=torch.float64)
            if variant == "retnet":
                log_decay = torch.log1p(-torch.pow(2.0, -5.0 - global_heads))
            else:
                slopes = torch.pow(2.0, -8.0 * (global_heads + 1) / heads)
                depth = (layer_number - 1) / max(config.num_layers - 1, 1)
                log_decay = -slopes * (1 - depth + 1e-5)
            local = log_decay.chunk(self.tp_size)[self.tp_rank].float()
            self.register_buffer("log_decay", local, persistent=False)
        if variant != "hedgehog":
            self.sharded_parameter("out_norm_weight", torch.ones(heads, self.value_dim))
        self.norm_eps = config.layernorm_epsilon

    def _features(self, x: torch.Tensor) -> torch.Tensor:
        """Hedgehog's feature map: ``[b, s, heads, K]`` -> ``[b, s, heads, 2K]``."""
        z = torch.einsum("bshk,hkf->bshf", x.float(), self.feature_map.float())
        z = z + self.feature_bias.float()
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1).to(x.dtype)

    def _normaliser(self, q, k, cu_seqlens, cache) -> torch.Tensor:
        """``phi(q_t) . sum_{j <= t} phi(k_j)`` ``[b, s, heads, 1]`` (fp32), the sum restarting
        at each packed sequence and continuing the cached one when decoding."""
        sums = k.float().cumsum(1)
        if cu_seqlens is not None:  # subtract what came before each token's sequence
            s = k.shape[1]
            starts = torch.arange(s, device=k.device) - sequence_positions(cu_seqlens, s, k.device)
            before = torch.cat([torch.zeros_like(sums[:, :1]), sums], dim=1)
            sums = sums - before[:, starts]
        if cache is not None:
            if "key_sum" in cache:
                sums = sums + cache["key_sum"][:, None]
            cache["key_sum"] = sums[:, -1]
        return (q.float() * sums).sum(-1, keepdim=True)

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None,
                inference_context=None, **_unused):
        cache = self.decoding_cache(inference_context, packed_seq_params)
        projected, _ = self.in_proj(hidden_states)  # [s, b, widths] (full s: SP gathers here)
        parts, grad_into = self.split_outputs("in_proj", projected)
        q, k, v = parts["q"], parts["k"], parts["v"]
        s, b = q.shape[:2]

        def to_heads(x):
            return x.transpose(0, 1).reshape(b, s, self.heads, -1)

        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        scale = None
        if self.variant == "lightning":
            q, k = F.silu(q), F.silu(k)
        if self.variant == "gla":
            a = to_heads(self.low_rank_decay(hidden_states)).float() + self.decay_bias.float().view(self.heads, -1)
            g = F.logsigmoid(a) / GLA_GATE_NORMALIZER
        elif self.variant == "hgrn2":
            bound = self.forget_lower_bound
            forget = bound + (1 - bound) * torch.sigmoid(k.float())
            q, k, g, scale = F.silu(q), (1 - forget).to(v.dtype), torch.log(forget), 1.0
        elif self.variant == "hedgehog":
            q, k, g, scale = self._features(q), self._features(k), None, 1.0
        else:
            g = self.log_decay
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        check_sequence(self.cp, s, cu_seqlens, 1, self.variant)
        o, final = linear_recurrence(self.cp, self.cp_method, decay_linear_attention,
                                     decay_linear_attention_summary, dict(q=q, k=k, v=v, g=g),
                                     scale=scale, cu_seqlens=cu_seqlens,
                                     backend=self.kernel_backend, **recurrent_state(cache))
        if self.variant == "hedgehog":
            o = o.float() / self._normaliser(q, k, cu_seqlens, cache)
            o = o.to(hidden_states.dtype).reshape(b, s, -1).transpose(0, 1).contiguous()
        else:
            o = gated_rms_norm(o.to(hidden_states.dtype), self.out_norm_weight,
                               to_heads(parts["gate"]), self.norm_eps, sequence_first=True,
                               gate_grad_into=grad_into("gate", to_heads))  # [s, b, heads * V]
        if cache is not None:
            cache["state"] = final
        return self.linear_out(o)


class Mamba2Mixer(HeadShardedModule):
    """Mamba-2 (SSD) with its own layout, on the decay op; no mamba_ssm build needed.

    Per head h with state ``[N, P]``: ``S_t = exp(dt_t A_h) S_{t-1} + B_t (dt_t x_t)^T``,
    ``y_t = S_t^T C_t + D_h x_t``; then ``rmsnorm(y * silu(z))`` per group and the output
    projection. B and C have ``mamba_num_groups`` heads shared by the value heads (GQA-style).
    Sizes come from megatron-core's own Mamba settings (``mamba_head_dim``,
    ``mamba_num_groups``, ``mamba_state_dim``, ``mamba_num_heads``) with expand 2.
    """

    def __init__(self, config, submodules: LinearMixerSubmodules, layer_number: int,
                 ext_config, pg_collection=None, **_unused):
        super().__init__(config, submodules, pg_collection)
        self.layer_number = layer_number
        self.kernel_backend = ext_config.kernel_backend
        h = config.hidden_size
        self.head_dim = config.mamba_head_dim
        heads = config.mamba_num_heads or (2 * h) // self.head_dim
        groups, self.state_dim = config.mamba_num_groups, config.mamba_state_dim
        if heads % groups:
            raise ConfigError(f"Mamba-2 heads ({heads}) must be a multiple of "
                              f"mamba_num_groups={groups}")
        if groups % self.tp_size:
            raise ConfigError(f"mamba_num_groups={groups} is not divisible by "
                              f"tensor_model_parallel_size={self.tp_size}")
        self.heads, self.groups = heads // self.tp_size, groups // self.tp_size
        self.cp = ContextParallel.of(config, pg_collection)
        self.cp_method = ext_config.context_parallel_method
        check_heads(self.cp, self.cp_method, "mamba2", heads=self.heads, groups=self.groups)
        inner, bc_size = heads * self.head_dim, groups * self.state_dim

        self.in_proj = self.fused_column("in_proj", h, {"z": inner, "x": inner, "B": bc_size,
                                                         "C": bc_size, "dt": heads})
        self.linear_out = self.row("mamba_out", inner, h)
        kernel = ext_config.linear_conv_kernel
        self.conv_x = self.conv_parameter("conv_x", inner, kernel)
        self.conv_B = self.conv_parameter("conv_B", bc_size, kernel)
        self.conv_C = self.conv_parameter("conv_C", bc_size, kernel)
        self.decay_parameters(heads, heads)
        self.sharded_parameter("D", torch.ones(heads), no_weight_decay=True)
        self.sharded_parameter("norm_weight", torch.ones(inner))
        self.norm_eps = config.layernorm_epsilon

    def forward(self, hidden_states, attention_mask=None, packed_seq_params=None,
                inference_context=None, **_unused):
        cache = self.decoding_cache(inference_context, packed_seq_params)
        projected, _ = self.in_proj(hidden_states)  # [s, b, widths] (full s: SP gathers here)
        parts, grad_into = self.split_outputs("in_proj", projected)
        z, x, B, C, dt = parts.values()
        s, b = x.shape[:2]
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        packed = check_sequence(self.cp, s, cu_seqlens, self.conv_x.shape[1], "mamba2")
        positions = sequence_positions(cu_seqlens, s, x.device)

        x = conv_silu_heads(x, self.conv_x, self.heads, positions, self.cp, packed,
                            cache=cache, name="x", grad_into=grad_into("x"))  # [b, s, H, P]
        B = conv_silu_heads(B, self.conv_B, self.groups, positions, self.cp, packed,
                            cache=cache, name="B", grad_into=grad_into("B"))  # [b, s, G, N]
        C = conv_silu_heads(C, self.conv_C, self.groups, positions, self.cp, packed,
                            cache=cache, name="C", grad_into=grad_into("C"))
        dt = F.softplus(dt.transpose(0, 1).float() + self.dt_bias.float())  # [b, s, H]
        g = -self.A_log.float().exp() * dt
        # C reads and B writes the state; dt scales the write; scale 1 as in Mamba-2.
        y, final = linear_recurrence(
            self.cp, self.cp_method, decay_linear_attention, decay_linear_attention_summary,
            dict(q=C, k=B, v=(x.float() * dt.unsqueeze(-1)).to(x.dtype), g=g),
            scale=1.0, cu_seqlens=cu_seqlens, backend=self.kernel_backend,
            **recurrent_state(cache))
        if cache is not None:
            cache["state"] = final
        y = torch.addcmul(y, x, self.D.to(y.dtype).view(-1, 1))  # the skip D x, [b, s, H, P]

        def groups_of(t):  # [b, s, inner] -> [b, s, G, inner / G]
            return t.unflatten(-1, (self.groups, -1))

        # Mamba-2 gates before its norm: rmsnorm(y * silu(z)) per group of heads, times weight
        # (one kernel each way, which also writes Megatron's [s, b, inner] layout).
        y = gated_rms_norm(groups_of(y.flatten(2)), self.norm_weight.view(self.groups, -1),
                           groups_of(z.transpose(0, 1)), self.norm_eps, sequence_first=True,
                           gate_grad_into=grad_into("z", lambda t: groups_of(t.transpose(0, 1))),
                           gate_first=True)
        return self.linear_out(y)


def decay_spec(ext_config, transformer_config, variant: str) -> ModuleSpec:
    """The ``self_attention`` spec of GLA, RetNet, Lightning, HGRN-2 or Hedgehog (registry
    builder)."""
    return ModuleSpec(module=DecayMixer, submodules=LinearMixerSubmodules(),
                      params={"ext_config": ext_config, "variant": variant})


def mamba2_spec(ext_config, transformer_config) -> ModuleSpec:
    return ModuleSpec(module=Mamba2Mixer, submodules=LinearMixerSubmodules(),
                      params={"ext_config": ext_config})
