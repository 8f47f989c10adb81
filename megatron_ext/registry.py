"""The table of token mixers: one row per mixer, looked up by pattern symbol or by name.

Symbols keep Megatron's hybrid-pattern meaning where one exists (``*`` softmax attention, ``G``
Gated DeltaNet, ``M`` Mamba, ``D`` DSA, ``+`` MLA, ``-`` MLP, ``E`` MoE, ``|`` and ``/``
separators); symbols of our own must not collide with those. Sparse softmax attention: ``B``
MoBA (mixture of Block attention), ``S`` NSA (native Sparse attention), ``D`` DSA (DeepSeek
Sparse Attention), ``C`` CSA and ``H`` HCA (DeepSeek-V4's Compressed Sparse and Heavily
compressed attention; the symbols Megatron's DeepSeek-V4 branch gives them, free in
megatron-core 0.19).

A row names its spec builder as ``"module:function"`` so that this table stays free of imports;
the builder takes ``(ext_config, transformer_config, **options)`` and returns the ModuleSpec
that fills the ``self_attention`` slot of a TransformerLayer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class Mixer:
    symbol: str
    name: str
    builder: str  # "module:function" -> f(ext_config, transformer_config, **options)
    description: str
    options: dict = field(default_factory=dict)
    # Whether the mixer exposes a value / write residual for cross-layer routing (CLVR, CLER-H).
    routable: bool = False
    # Whether the mixer is Megatron's SelfAttention (with a core of ours): its input norm stays
    # where Megatron's attention files it (fused into linear_qkv under Transformer Engine).
    self_attention: bool = False

    def build_spec(self, ext_config, transformer_config):
        module, function = self.builder.split(":")
        fn: Callable = getattr(importlib.import_module(module), function)
        return fn(ext_config, transformer_config, **self.options)


_ATTENTION = "megatron_ext.specs:attention_self_spec"
_DELTA = "megatron_ext.mixers.delta_rule:delta_rule_spec"
_DECAY = "megatron_ext.mixers.decay:decay_spec"

MIXERS: tuple[Mixer, ...] = (
    Mixer("*", "attention", _ATTENTION,
          "softmax self-attention (torch SDPA, TE or Megatron's local core)", self_attention=True),
    Mixer("B", "moba", _ATTENTION, "MoBA: Mixture of Block Attention (Lu et al. 2025)",
          {"variant": "moba"}, self_attention=True),
    Mixer("S", "nsa", _ATTENTION, "NSA: Native Sparse Attention (Yuan et al. 2025)",
          {"variant": "nsa"}, self_attention=True),
    Mixer("F", "fox", _ATTENTION,
          "FoX: Forgetting Transformer, softmax attention with a forget gate (Lin et al. 2025)",
          {"variant": "fox"}, self_attention=True),
    # A SelfAttention too, but its indexer reads the normalised input: the input norm stays the
    # layer's own (under Transformer Engine not fused into linear_qkv).
    Mixer("D", "dsa", _ATTENTION, "DSA: DeepSeek Sparse Attention (DeepSeek-V3.2, 2025)",
          {"variant": "dsa"}),
    # Like DSA, their compressor (and CSA's indexer) read the normalised input.
    Mixer("C", "csa", _ATTENTION, "CSA: Compressed Sparse Attention (DeepSeek-V4, 2026)",
          {"variant": "csa"}),
    Mixer("H", "hca", _ATTENTION, "HCA: Heavily Compressed Attention (DeepSeek-V4, 2026)",
          {"variant": "hca"}),
    # Megatron's hybrid symbol for MLA. Its own RoPE: the model's rotary table is not passed.
    Mixer("+", "mla", "megatron_ext.mixers.mla:mla_spec",
          "MLA: multi-head latent attention (DeepSeek-V2/V3, 2024)"),
    Mixer("G", "gated_deltanet", _DELTA, "Gated DeltaNet (Yang, Kautz, Hatamizadeh 2025)",
          {"variant": "gated_deltanet"}, routable=True),
    Mixer("N", "deltanet", _DELTA, "DeltaNet (Yang et al. 2024)", {"variant": "deltanet"},
          routable=True),
    Mixer("K", "kda", _DELTA, "Kimi Delta Attention (Kimi Linear 2025)", {"variant": "kda"},
          routable=True),
    Mixer("Q", "gated_deltanet2", _DELTA, "Gated DeltaNet-2: per-channel erase and write gates",
          {"variant": "gated_deltanet2"}, routable=True),
    Mixer("M", "mamba2", "megatron_ext.mixers.decay:mamba2_spec", "Mamba-2 / SSD (Dao & Gu 2024)"),
    Mixer("A", "gla", _DECAY, "Gated Linear Attention (Yang et al. 2024)", {"variant": "gla"}),
    Mixer("R", "retnet", _DECAY, "RetNet retention (Sun et al. 2023)", {"variant": "retnet"}),
    Mixer("L", "lightning", _DECAY, "Lightning Attention (Qin et al. 2024)",
          {"variant": "lightning"}),
    Mixer("W", "hgrn2", _DECAY, "HGRN-2: gated linear RNN with state expansion (Qin et al. 2024)",
          {"variant": "hgrn2"}),
    Mixer("Y", "hedgehog", _DECAY,
          "Hedgehog: linear attention with a learned softmax feature map (Zhang et al. 2024)",
          {"variant": "hedgehog"}),
    Mixer("V", "rwkv7", "megatron_ext.mixers.rwkv7:rwkv7_spec",
          "RWKV-7 time mixing: the delta rule with a diagonal-plus-low-rank transition "
          "(Peng et al. 2025)"),
)

_BY_SYMBOL = {m.symbol: m for m in MIXERS}
_BY_NAME = {m.name: m for m in MIXERS}


def known_mixers() -> str:
    """A one-line listing for error messages: ``'*' attention, 'G' gated_deltanet``."""
    return ", ".join(f"{m.symbol!r} {m.name}" for m in MIXERS)


def lookup(key: str) -> Mixer:
    """The mixer for a symbol or a name; an unknown key raises with the known ones listed."""
    mixer = _BY_SYMBOL.get(key) or _BY_NAME.get(key)
    if mixer is None:
        from megatron_ext.config import ConfigError

        raise ConfigError(f"unknown token mixer {key!r} in pattern; known: {known_mixers()}")
    return mixer
