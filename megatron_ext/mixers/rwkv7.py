"""RWKV-7's time mixing as a Megatron token mixer (Peng et al., "RWKV-7 'Goose' with Expressive
Dynamic State Evolution", 2025); its channel mixing is the layer's usual MLP.

Per token, with ``x'`` the previous token of the same sequence (zeros before its first):

- token shift: ``x_c = x + (x' - x) * mu_c`` for c in r, w, k, v, a, g (``mu`` per hidden channel);
- projections: ``r = x_r W_r``, ``k = x_k W_k``, ``v = x_v W_v``;
- decay: ``w = exp(-exp(-0.5) * sigmoid(d))`` with ``d = w_0 + tanh(x_w W_w1) W_w2``, so each
  step keeps between ``exp(-exp(-0.5))`` (about 0.545) and all of a key channel;
- in-context learning rate: ``alpha = sigmoid(a_0 + x_a W_a1 W_a2)``;
- removal key ``kappa_hat = normalize(k * xi)`` per head, and the written key
  ``k <- k * (1 + (alpha - 1) * k_a)``;
- the recurrence, :func:`megatron_ext.kernels.dplr_delta_rule` with ``q = r``,
  ``a = -kappa_hat``, ``b = kappa_hat * alpha``, ``g = log w`` and scale 1 (RWKV-7's state is our
  state transposed; see ``kernels/dplr/reference.py``);
- output: a per-head group norm (weight and bias, eps 64e-5 as in RWKV-7) of the read, plus the
  bonus ``sum_c(r * k * rho) v`` per head, times the gate ``g = sigmoid(x_g W_g1) W_g2``, then the
  output projection.

The three low-rank projections (decay, rate, gate) have rank ``ExtConfig.rwkv7_lora_rank``, or
RWKV-7's sizes for hidden size h when unset (:func:`lora_ranks`). RWKV-7's value residual (each
layer's v mixed with the first layer's) is left out: it would carry a tensor from layer to layer,
across pipeline stages.

Tensor parallelism splits heads. The token shift needs each token's predecessor, so the input is
brought to the whole sequence once (under SP one all-gather, whose backward reduce-scatters; else
an identity whose backward all-reduces), and every projection then runs on it with its own input
gradient left unreduced (``disable_grad_reduce``): one TP collective each way for all six mixed
inputs. The shift weights ``mu`` are replicated and used by every head, so their gradient is summed
over TP in autograd (``copy_to_tensor_model_parallel_region`` on the parameter). The LoRAs' first
factors are column-parallel with their outputs gathered (the rank is split over TP); the per-head
parameters (``w_0``, ``a_0``, ``xi``, ``k_a``, ``rho``, the norm's weight and bias) are sharded
with their heads (:class:`~megatron_ext.mixers.common.HeadShardedModule`), so checkpoints reshard.
Packed sequences: the shift restarts at each sequence (zeros before its first token) and so does
the state.

Context parallelism (Megatron's load-balanced layout, each rank two chunks of the sequence, or of
each packed document): the token shift is a causal convolution of width 2, and takes the token
before each local chunk from the rank that holds it, as the short convolutions' halo does
(:meth:`~megatron_ext.parallel.ContextParallel.previous_tokens`, or for packed documents
:meth:`~megatron_ext.parallel.ContextParallel.before_tails` of the layout's pieces; zeros before a
sequence's first chunk). The recurrence runs under
:func:`megatron_ext.parallel.linear.linear_recurrence` with
:func:`~megatron_ext.kernels.dplr.dplr_delta_rule_summary`: by state passing (default; each chunk's
``S -> M S + H`` with the full K x K transition ``M``) or all-to-all over heads
(``ExtConfig.context_parallel_method``; heads per TP rank divisible by CP).
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.config import ConfigError
from megatron_ext.kernels import dplr_delta_rule, registry
from megatron_ext.kernels.dplr import dplr_delta_rule_summary
from megatron_ext.kernels.fused import sequence_positions
from megatron_ext.mixers.common import HeadShardedModule, LinearMixerSubmodules, packed_cu_seqlens, recurrent_state
from megatron_ext.parallel.linear import check_sequence, linear_recurrence

SHIFTED = ("r", "w", "k", "v", "a", "g")  # the token-shift mixes, in the rows of token_shift
GROUP_NORM_EPS = 64e-5  # RWKV-7's ln_x


def lora_ranks(hidden_size: int) -> dict[str, int]:
    """RWKV-7's low-rank sizes for a hidden size h, multiples of 32, at least 32: decay and rate
    ``1.8 sqrt(h)``, gate ``0.6 h^0.8``."""
    def size(x):
        return max(32, 32 * round(x / 32))

    return {"w": size(1.8 * math.sqrt(hidden_size)), "a": size(1.8 * math.sqrt(hidden_size)),
            "g": size(0.6 * hidden_size**0.8)}


class Rwkv7Mixer(HeadShardedModule):
    """Megatron mixer contract: ``forward(hidden [s, b, h], ...) -> (out [s, b, h], bias)``."""

    def __init__(self, config, submodules: LinearMixerSubmodules, layer_number: int,
                 ext_config, pg_collection=None, **_unused):
        super().__init__(config, submodules, pg_collection)
        self.layer_number = layer_number
        ext = ext_config
        heads = self.same_heads(config, ext, "rwkv7", pg_collection)
        # A backend the op does not declare ("fla") runs "auto".
        declared = registry.get("dplr_delta_rule").backends
        self.kernel_backend = ext.kernel_backend if ext.kernel_backend in declared else "auto"
        h = config.hidden_size
        k_size, v_size = heads * self.key_dim, heads * self.value_dim
        ranks = lora_ranks(h) if ext.rwkv7_lora_rank is None else dict.fromkeys("wag", ext.rwkv7_lora_rank)
        for name, rank in ranks.items():
            if rank % self.tp_size:
                raise ConfigError(f"rwkv7_lora_rank={rank} (the {name} projection's) is not "
                                  f"divisible by tensor_model_parallel_size={self.tp_size}")

        # Every projection reads the whole sequence that forward gathers once.
        self.full_sequence = copy.copy(config)
        self.full_sequence.sequence_parallel = False
        self.linear_r = self._column("rwkv7_r", h, k_size)
        self.linear_k = self._column("rwkv7_k", h, k_size)
        self.linear_v = self._column("rwkv7_v", h, v_size)
        self.linear_w_down = self._column("rwkv7_w_down", h, ranks["w"], gather_output=True)
        self.linear_w_up = self.column("rwkv7_w_up", ranks["w"], k_size, config=self.full_sequence)
        self.linear_a_down = self._column("rwkv7_a_down", h, ranks["a"], gather_output=True)
        self.linear_a_up = self.column("rwkv7_a_up", ranks["a"], k_size, config=self.full_sequence)
        self.linear_g_down = self._column("rwkv7_g_down", h, ranks["g"], gather_output=True)
        self.linear_g_up = self.column("rwkv7_g_up", ranks["g"], v_size, config=self.full_sequence)
        self.linear_out = self.row("rwkv7_out", v_size, h)

        # Token shift: RWKV-7's schedule over channels and depth, mu_c = 1 - (i / h)^(p_c * f_l)
        # with f_l falling from 1 at the first layer towards 0 at the last.
        depth = 1 - (layer_number - 1) / config.num_layers
        channel = torch.arange(h, dtype=torch.float32) / h
        powers = {"r": 0.2, "w": 0.9, "k": 0.7, "v": 0.7, "a": 0.9, "g": 0.2}
        shift = torch.stack([1 - channel.pow(powers[c] * depth) for c in SHIFTED])
        self.token_shift = torch.nn.Parameter(shift.to(config.params_dtype))  # [6, h], replicated
        # Decay bias: RWKV-7's per-channel speeds, -7 + 5 (i / (K - 1))^(0.85 + sqrt(1 - f_l)),
        # plus 0.5, per head.
        position = torch.arange(self.key_dim, dtype=torch.float32) / max(self.key_dim - 1, 1)
        speed = -7 + 5 * position.pow(0.85 + (1 - depth) ** 0.5) + 0.5
        self.sharded_parameter("decay_bias", speed.repeat(heads))
        self.sharded_parameter("rate_bias", torch.zeros(k_size))
        self.sharded_parameter("removal_key_scale", torch.full((k_size,), 0.85))  # xi
        self.sharded_parameter("key_rate_mix", torch.ones(k_size))  # k_a
        self.sharded_parameter("bonus", torch.zeros(heads, self.key_dim))  # rho
        self.sharded_parameter("out_norm_weight", torch.ones(heads, self.value_dim))
        self.sharded_parameter("out_norm_bias", torch.zeros(heads, self.value_dim))

    def _column(self, name: str, in_size: int, out_size: int, gather_output: bool = False):
        """A projection of the gathered sequence, its input gradient left to forward's one
        reduction."""
        return self.column(name, in_size, out_size, gather_output=gather_output,
                           config=self.full_sequence, disable_grad_reduce=True)

    def _whole_sequence(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[s, b, h]`` on every TP rank, with one reduction of its gradient over TP."""
        if self.tp_size == 1:
            return hidden_states
        if self.config.sequence_parallel:
            return gather_from_sequence_parallel_region(hidden_states, group=self.tp_group)
        return copy_to_tensor_model_parallel_region(hidden_states, group=self.tp_group)

    def _previous_tokens(self, x: torch.Tensor, positions, cache, packed) -> torch.Tensor:
        """x' ``[s, b, h]``: the token before each of x ``[s, b, h]`` (zeros before a sequence's
        first). Under CP, the token before each local chunk (or packed piece) comes from the rank
        that holds it."""
        if self.cp is None:
            before = cache.get("shift") if cache is not None else None
            first = torch.zeros_like(x[:1]) if before is None else before[None]
            previous = torch.cat([first, x[:-1]])
            if positions is not None:  # each packed sequence starts from zeros
                previous = previous.masked_fill((positions == 0).view(-1, 1, 1), 0.0)
            return previous
        x = x.transpose(0, 1)  # [b, s, h]
        if packed is not None:  # b = 1; a document's first chunk gets zeros
            pieces = packed.split(x)
            before = self.cp.before_tails(torch.cat([piece[:, -1:] for piece in pieces]))
            previous = torch.cat([torch.cat([before[i:i + 1], piece[:, :-1]], dim=1)
                                  for i, piece in enumerate(pieces)], dim=1)
        else:
            chunks = self.cp.split_chunks(x)  # [2b, L, h]
            previous = self.cp.merge_chunks(
                torch.cat([self.cp.previous_tokens(chunks, 1), chunks[:, :-1]], dim=1))
        return previous.transpose(0, 1)

    def _shifted_inputs(self, x: torch.Tensor, positions, cache, packed) -> list[torch.Tensor]:
        """The six token-shift mixes of x ``[s, b, h]``: ``x + (x' - x) * mu_c``."""
        previous = self._previous_tokens(x, positions, cache, packed)
        if cache is not None:
            cache["shift"] = x[-1].clone()
        shift = self.token_shift
        if self.tp_size > 1:  # each rank's gradient covers its heads only
            shift = copy_to_tensor_model_parallel_region(shift, group=self.tp_group)
        delta = previous - x
        return [torch.addcmul(x, delta, mix) for mix in shift.to(x.dtype).unbind(0)]

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, packed_seq_params=None,
                inference_context=None, **_unused):
        """hidden_states ``[s, b, h]`` (``[s / TP, b, h]`` under SP) -> (``[s, b, h]``, bias or
        None). With Megatron's ``inference_context``, the tokens continue the ones before them
        (the state and the last token are cached)."""
        cache = self.decoding_cache(inference_context, packed_seq_params)
        x = self._whole_sequence(hidden_states)
        s, b = x.shape[:2]
        cu_seqlens = packed_cu_seqlens(packed_seq_params)
        # The shift is a convolution of width 2: CP chunks of at least one token.
        packed = check_sequence(self.cp, s, cu_seqlens, 2, "rwkv7")
        positions = sequence_positions(cu_seqlens, s, x.device) if self.cp is None else None
        x_r, x_w, x_k, x_v, x_a, x_g = self._shifted_inputs(x, positions, cache, packed)
        dtype = torch.promote_types(torch.float32, x.dtype)  # of the gates, norm and bonus

        def wide(t):
            return t.to(dtype)

        def heads(t):  # [s, b, H * D] -> [b, s, H, D]
            return t.transpose(0, 1).unflatten(-1, (self.heads, -1))

        def lora(down, up, inputs, inner=None):
            low_rank, _ = down(inputs)
            out, _ = up(low_rank if inner is None else inner(low_rank))
            return wide(heads(out))

        r, k, v = (heads(linear(t)[0]) for linear, t in
                   ((self.linear_r, x_r), (self.linear_k, x_k), (self.linear_v, x_v)))
        per_channel = (self.heads, self.key_dim)
        d = wide(self.decay_bias).view(per_channel) + lora(self.linear_w_down, self.linear_w_up,
                                                             x_w, torch.tanh)
        log_decay = -math.exp(-0.5) * torch.sigmoid(d)  # log w: [b, s, H, K]
        rate = torch.sigmoid(wide(self.rate_bias).view(per_channel)
                             + lora(self.linear_a_down, self.linear_a_up, x_a))  # alpha
        gate = lora(self.linear_g_down, self.linear_g_up, x_g, torch.sigmoid)  # [b, s, H, V]
        removal_key = F.normalize(wide(k) * wide(self.removal_key_scale).view(per_channel), dim=-1)
        k = wide(k) * (1 + (rate - 1) * wide(self.key_rate_mix).view(per_channel))

        o, final = linear_recurrence(
            self.cp, self.cp_method, dplr_delta_rule, dplr_delta_rule_summary,
            dict(q=r, k=k.to(v.dtype), v=v, a=-removal_key, b=removal_key * rate, g=log_decay),
            scale=1.0, cu_seqlens=cu_seqlens, backend=self.kernel_backend, **recurrent_state(cache))
        if cache is not None:
            cache["state"] = final
        o = F.layer_norm(wide(o), (self.value_dim,), eps=GROUP_NORM_EPS)
        o = o * wide(self.out_norm_weight) + wide(self.out_norm_bias)
        bonus = (wide(r) * k * wide(self.bonus)).sum(-1, keepdim=True) * wide(v)
        o = ((o + bonus) * gate).to(hidden_states.dtype)
        return self.linear_out(o.flatten(2).transpose(0, 1).contiguous())


def rwkv7_spec(ext_config, transformer_config) -> ModuleSpec:
    """The ``self_attention`` spec of an RWKV-7 layer (registry builder)."""
    return ModuleSpec(module=Rwkv7Mixer, submodules=LinearMixerSubmodules(),
                      params={"ext_config": ext_config})
