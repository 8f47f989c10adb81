"""Cross-layer key/value sharing for softmax attention (CLA, Brandon et al. 2024; YOCO's
cross-decoder, Sun et al. 2024 shares one key/value set the same way).

``ExtConfig.attention_kv_share = n``: the ``*`` layers of the pattern, in order, form groups of
n; the first of a group (the producer) computes its keys and values as usual and hands them,
as they come out of its projection (after QK-norm, before RoPE), to the others (consumers),
which project only their queries and attend to those keys and values (RoPE applied at the same
positions gives the same rotated keys). A group's layers must be built together (the same
pipeline stage and virtual chunk, from ``block_spec``), which :func:`share_groups` checks.
The hand-over is one :class:`KVShare` object per group, given to its layers in their specs;
autograd carries the consumers' gradients back into the producer's projection. Decoding
keeps a KV cache per layer (Megatron's), so it stays correct but does not save cache memory.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_ext.config import ConfigError


class KVShare:
    """The keys and values of a group's producer in the current forward."""

    def __init__(self):
        self.key_value: tuple[torch.Tensor, torch.Tensor] | None = None


def share_groups(mixers, ext, local_layers) -> dict[int, tuple[KVShare, bool]]:
    """Global layer index -> (its group's KVShare, whether it produces) for the softmax layers
    of ``local_layers`` (this stage's), groups of ``ext.attention_kv_share`` consecutive ``*``
    layers over the whole model. Raises when a group is split between stages or chunks."""
    size = ext.attention_kv_share
    if size == 1:
        return {}
    softmax = [i for i, mixer in enumerate(mixers) if mixer.name == "attention"]
    local = set(local_layers)
    groups = {}
    for start in range(0, len(softmax), size):
        members = softmax[start:start + size]
        built = [i for i in members if i in local]
        if built and len(built) != len(members):
            raise ConfigError(
                f"attention_kv_share={size}: softmax layers {[i + 1 for i in members]} share keys "
                "and values, but the pipeline split (or virtual chunk) builds only "
                f"{[i + 1 for i in built]} here; choose a split that keeps each group together "
                "or another attention_kv_share")
        if built:
            share = KVShare()
            groups.update({i: (share, i == members[0]) for i in members})
    return groups


class KVShareSelfAttention(SelfAttention):
    """Megatron's SelfAttention as the producer or a consumer of a :class:`KVShare`."""

    def __init__(self, config, submodules, *args, kv_share: KVShare, produces: bool, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.kv_share, self.produces = kv_share, produces
        if config.attention_output_gate:
            raise ConfigError("attention_kv_share does not take attention_output_gate yet")
        if not produces:  # queries only: no key/value projection of its own
            self.linear_qkv = submodules.linear_qkv(
                config.hidden_size, self.query_projection_size, config=config,
                init_method=config.init_method, gather_output=False,
                bias=config.add_bias_linear or config.add_qkv_bias, skip_bias_add=False,
                is_expert=False, tp_comm_buffer_name="q", tp_group=self.pg_collection.tp)
            self.k_layernorm = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        if not split_qkv:
            raise ConfigError("attention_kv_share needs the query, key and value split "
                              "(no fused single-QKV RoPE)")
        if self.produces:
            query, key, value = super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate, split_qkv)
            self.kv_share.key_value = (key, value)
            return query, key, value
        if self.kv_share.key_value is None:
            raise RuntimeError("a key/value-sharing layer ran before its group's producer")
        query, _ = self.linear_qkv(hidden_states)
        query = query.view(*query.shape[:2], self.num_attention_heads_per_partition,
                           self.hidden_size_per_attention_head)
        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        key, value = self.kv_share.key_value
        return query, key, value
