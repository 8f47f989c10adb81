"""One dataclass for everything megatron-ext adds to a Megatron model.

It is filled in one of three ways and validated once:

- in Python: ``ExtConfig(pattern="GG*", ...)``;
- from a YAML preset (``ExtConfig.from_dict(yaml.safe_load(...)["ext"])``);
- from Megatron's argparse: pass :func:`add_megatron_args` as ``extra_args_provider`` to
  ``pretrain(...)``, then :func:`ExtConfig.from_megatron_args` reads the ``--ext-*`` flags back.

For an unmodified ``pretrain_gpt.py --spec megatron_ext.specs ...`` (whose argparse we cannot
extend), the same fields come from the YAML file named by the environment variable
``MEGATRON_EXT_CONFIG``; see :func:`resolve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from dataclasses import dataclass, fields
from typing import Any

ENV_CONFIG = "MEGATRON_EXT_CONFIG"

# Fields that take one of a fixed set of values.
CHOICES = {
    "attention_backend": ("auto", "sdpa", "local", "te"),
    "kernel_backend": ("auto", "reference", "chunked", "triton", "fla"),
    "sparse_backend": ("auto", "reference", "gathered", "flex"),
    "cross_layer_routing": ("none", "clvr", "cler_h"),
    "residual": ("standard", "mhc", "attnres_full", "attnres_block"),
    "mhc_collapse": ("learned", "mean"),
    "residual_backend": ("auto", "eager", "compile"),
    "context_parallel_method": ("state_passing", "all_to_all"),
    "dsa_stage": ("dense_warmup", "sparse"),
    "dsa_attention_type": ("gqa", "mla"),
    "mla_rope_type": ("rope", "yarn"),
}


class ConfigError(ValueError):
    """A megatron-ext setting is invalid; the message names the field, the value and the fix."""


@dataclass
class ExtConfig:
    """Settings of the megatron-ext layers.

    ``pattern`` gives one token mixer per layer, either as a string of symbols (``"GGG*GGG*"``)
    or as a list of names (``["gated_deltanet"] * 3 + ["attention"]``); see
    :mod:`megatron_ext.registry` for the table. A pattern of length one is repeated over all
    layers.
    """

    pattern: str | list[str] = "*"

    # Softmax attention core. "auto" and "sdpa": torch SDPA (flash / cuDNN) in Megatron's local
    # layer, the path the tests run. "te": Transformer Engine's layer (its norm-fused QKV and FC1
    # linears, its attention core and row-parallel linears; the linear mixers keep Megatron's
    # local linears): opt-in, not exercised by our tests. "local": Megatron's unfused
    # DotProductAttention (kept for comparison).
    attention_backend: str = "auto"

    # Linear-recurrent mixers (DeltaNet, Gated DeltaNet, KDA, GDN-2). Head counts default to
    # the attention's: key heads = num_query_groups, value heads = num_attention_heads; head
    # dims to kv_channels. Names follow megatron-core's own GDN settings.
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel: int = 4
    # Rank of the low-rank projection behind per-channel decays (KDA, GDN-2); default: the
    # value head dim, as in Kimi Linear.
    linear_decay_rank: int | None = None

    # RWKV-7 ('V'; megatron_ext.mixers.rwkv7): the rank of its low-rank projections (decay,
    # in-context learning rate, output gate). Unset: RWKV-7's sizes for the hidden size h,
    # multiples of 32 and at least 32: 1.8 sqrt(h) for the decay and the rate, 0.6 h^0.8 for
    # the gate. Must divide by the TP size. Heads and head dims: the linear_* fields above.
    rwkv7_lora_rank: int | None = None

    # Which implementation the linear-recurrence ops use (see megatron_ext.kernels). RWKV-7's op
    # has no "fla" backend: there "fla" runs "auto"; its "triton" computes the decayed scores in
    # Triton kernels and the rest of its chunked form in PyTorch.
    kernel_backend: str = "auto"
    # Single ops on a backend of one's choice where their calls ask for "auto": {op: backend},
    # e.g. {"short_conv": "reference", "index_scores": "pytorch"}. The ops and their backends
    # are the backend registry's (megatron_ext.kernels.registry; `megatron-ext doctor` lists
    # them); a call that names its backend (a family's setting here other than "auto") keeps it.
    # A backend that cannot take a call raises, with the reason. Set for the process when a
    # model is built from this config. Flag: --ext-kernel-overrides short_conv=reference,...
    kernel_overrides: dict[str, str] = dataclasses.field(default_factory=dict)
    # Context parallelism (context_parallel_size > 1) of the linear recurrences
    # (megatron_ext.parallel): "state_passing" exchanges each rank's recurrent-state summary
    # (volume independent of the sequence length); "all_to_all" (Ulysses) moves the op's inputs
    # and outputs between sequence and head sharding (needs heads divisible by TP * CP).
    context_parallel_method: str = "state_passing"

    # Softmax attention: every '*' layer and the sparse mixers MoBA ('B'), NSA ('S'), DSA
    # ('D'), CSA ('C') and HCA ('H').
    # Sliding window, learnable sink, output gate and QK-norm are Megatron's own settings
    # (window_size + window_attn_skip_freq, softmax_type="learnable", attention_output_gate,
    # qk_layernorm), which our attention cores honour. Exclusive self attention (XSA, Zhai
    # 2026) removes from each head's output its component along the token's own value.
    attention_xsa: bool = False
    # How the windowed / sink / sparse attention ops run (megatron_ext.kernels.sparse): "auto"
    # (on CUDA: torch's FlashAttention-2 kernels, once they pass their first-use check, for
    # windows, sinks, MoBA and, from 8192 tokens a sequence, NSA's selected and window branches;
    # FlexAttention for the other block layouts and for DSA's and CSA's selections; the
    # gathered PyTorch form elsewhere), "flex" (FlexAttention only: NSA's layout takes a
    # quarter of flash's peak memory), "gathered" or "reference" (dense masks, for checks).
    sparse_backend: str = "auto"
    # MoBA (Lu et al. 2025): keys per block; blocks each query attends to, its own included
    # (the paper's scaling runs: 512 and 3).
    moba_block_size: int = 512
    moba_top_k: int = 3
    # NSA (Yuan et al. 2025), the paper's sizes: compression blocks of l = 32 tokens every
    # d = 16; selection blocks of l' = 64 tokens, n = 16 of them per query (the first block and
    # the 2 local ones included); a sliding window of w = 512 tokens.
    nsa_compress_block: int = 32
    nsa_compress_stride: int = 16
    nsa_select_block: int = 64
    nsa_select_top_k: int = 16
    nsa_window: int = 512
    # DSA (DeepSeek-V3.2, arXiv 2512.02556; megatron_ext.mixers.dsa), the paper's sizes: each
    # query attends to the dsa_top_k = 2048 earlier tokens that a lightning indexer of 64 heads
    # of 128 dims scores highest. dsa_stage: "dense_warmup" (dense attention; only the indexer
    # trains, on its KL loss to the attention; everything else frozen) or "sparse" (top-k
    # attention; the indexer learns from its KL loss on the selected keys, the rest of the
    # model from the LM loss). The loss is a mean over tokens times dsa_indexer_loss_coeff;
    # as the indexer learns from nothing else, the coefficient only scales its gradient.
    # dsa_attention_type: the attention the 'D' layers select keys for: "gqa" (Megatron's
    # SelfAttention with grouped query heads; the indexer's queries from the layer input) or
    # "mla" (MLA with the mla_* sizes, as in DeepSeek-V3.2 and Megatron's own 'D': the
    # indexer's queries from MLA's query latent; megatron_ext.mixers.mla).
    dsa_top_k: int = 2048
    dsa_indexer_heads: int = 64
    dsa_indexer_dim: int = 128
    dsa_stage: str = "sparse"
    dsa_indexer_loss_coeff: float = 1.0
    dsa_attention_type: str = "gqa"
    # DeepSeek-V4's compressed attentions (arXiv 2606.19348; megatron_ext.mixers.compressed),
    # V4-Flash's sizes. CSA ('C'): one compressed entry per csa_compress_rate = 4 tokens (each
    # mixing two adjacent blocks); each query attends to the csa_top_k = 512 entries an
    # indexer of 64 heads of 128 dims scores highest, plus its last csa_window = 128 tokens.
    # HCA ('H'): one entry per hca_compress_rate = 128 tokens, no overlap, no indexer; each query
    # attends to every complete entry plus its last hca_window = 128 tokens. A query sees an
    # entry once its block is complete. CSA's indexer trains like DSA's, in the stage of
    # dsa_stage (its dense warm-up attends to every entry), with dsa_indexer_loss_coeff.
    csa_compress_rate: int = 4
    csa_top_k: int = 512
    csa_indexer_heads: int = 64
    csa_indexer_dim: int = 128
    csa_window: int = 128
    hca_compress_rate: int = 128
    hca_window: int = 128

    # MLA ('+', DeepSeek-V2/V3 multi-head latent attention; megatron_ext.mixers.mla), the
    # DeepSeek-V3 sizes: queries through a rank mla_q_lora_rank = 1536 latent, keys and values
    # through one rank mla_kv_lora_rank = 512 latent; per head mla_qk_head_dim = 128 dims
    # without position plus mla_qk_pos_emb_head_dim = 64 with RoPE (one RoPE key shared by the
    # heads), and mla_v_head_dim = 128 value dims. RoPE: "rope" (base mla_rotary_base) or "yarn"
    # (megatron-core's YaRN defaults, DeepSeek-V3's 40x extension of 4,096 positions).
    mla_q_lora_rank: int = 1536
    mla_kv_lora_rank: int = 512
    mla_qk_head_dim: int = 128
    mla_qk_pos_emb_head_dim: int = 64
    mla_v_head_dim: int = 128
    mla_rope_type: str = "rope"
    mla_rotary_base: float = 10000.0

    # Cross-layer key/value sharing (CLA; megatron_ext.mixers.kv_share): the '*' layers, in
    # order, form groups of attention_kv_share; each group's later layers project only queries
    # and attend to the first one's keys and values. 1: no sharing.
    attention_kv_share: int = 1

    # Cross-layer routing from delta-rule layers into the residual stream (Cerruti et al.,
    # "Linear Attention Architectures: Mechanisms, Trade-offs, and Cross-Layer Routing"):
    # after each delta-rule layer, h <- h + P_l s_l with P_l zero-initialised and s_l the layer's
    # value v ("clvr") or its write residual r ("cler_h").
    cross_layer_routing: str = "none"

    # The residual stream of every layer (megatron_ext.residual): "standard" (x + F(x)), "mhc"
    # (Manifold-Constrained Hyper-Connections, Xie et al. 2025), "attnres_full" or
    # "attnres_block" (Attention Residuals, Kimi Team 2026).
    residual: str = "standard"
    # mHC: number of streams n; Sinkhorn iterations of H_res; how the streams collapse before
    # the final norm ("learned": DeepSeek-V4's hc_head, or "mean"); and whether backward
    # recomputes the mHC intermediates, keeping only each pipeline stage's input.
    mhc_streams: int = 4
    mhc_sinkhorn_iters: int = 20
    mhc_collapse: str = "learned"
    mhc_recompute: bool = False
    # Block Attention Residuals: transformer layers (two sublayers each) per block.
    attnres_block_layers: int = 4
    # How the residual-stream ops (mHC, Attention Residuals) run: "auto" (on CUDA with Triton,
    # our Triton kernels where they pass their first-use check and torch.compile'd PyTorch for
    # the rest; eager PyTorch elsewhere), "compile" (compiled PyTorch only) or "eager" (eager
    # PyTorch only): the last two to compare with, or to rule our kernels out.
    residual_backend: str = "auto"

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ExtConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown megatron-ext setting(s) {unknown}; known settings: {sorted(known)}"
            )
        return cls(**typed_values("ext", cls, values))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "ExtConfig":
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        # A preset file keeps our settings under "ext"; a bare file is all ours.
        return cls.from_dict(data.get("ext", data) if isinstance(data, dict) else {})

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace) -> "ExtConfig":
        """Read the ``--ext-*`` flags that :func:`add_megatron_args` registered."""
        values = {}
        for f in _cli_fields():
            value = getattr(args, _arg_dest(f.name))
            if value is not None:
                values[f.name] = value
        if "pattern" in values and "," in values["pattern"]:
            values["pattern"] = [p.strip() for p in values["pattern"].split(",")]
        return cls.from_dict(values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ validation
    def validate(self, num_layers: int | None = None) -> "ExtConfig":
        """Check every field; with ``num_layers``, also the pattern length. Returns self."""
        from megatron_ext.pattern import expand_pattern

        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ConfigError(f"{name}={getattr(self, name)!r} is not one of {list(choices)}")
        for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_decay_rank", "rwkv7_lora_rank"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"{name}={value} must be a positive integer (or unset)")
        for name in ("mla_q_lora_rank", "mla_kv_lora_rank", "mla_qk_head_dim",
                     "mla_qk_pos_emb_head_dim", "mla_v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        if self.mla_qk_pos_emb_head_dim % 2:
            raise ConfigError(f"mla_qk_pos_emb_head_dim={self.mla_qk_pos_emb_head_dim} must be "
                              "even (RoPE rotates pairs of dims)")
        if isinstance(self.attention_kv_share, bool) or not isinstance(
                self.attention_kv_share, int) or self.attention_kv_share < 1:
            raise ConfigError(f"attention_kv_share={self.attention_kv_share!r} must be a "
                              "positive integer (1: no sharing)")
        if self.attention_kv_share > 1 and self.attention_backend in ("te", "local"):
            raise ConfigError("attention_kv_share needs attention_backend='sdpa' or 'auto' "
                              "(our attention core; the others are not tested with it)")
        self._validate_kernel_overrides()
        if self.linear_conv_kernel < 1:
            raise ConfigError(f"linear_conv_kernel={self.linear_conv_kernel} must be >= 1")
        self._validate_sparse_attention()
        for name in ("mhc_streams", "mhc_sinkhorn_iters", "attnres_block_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        if not isinstance(self.mhc_recompute, bool):
            raise ConfigError(f"mhc_recompute={self.mhc_recompute!r} must be true or false")
        if num_layers is not None:
            expand_pattern(self.pattern, num_layers)
            if self.residual == "attnres_block" and self.attnres_block_layers > num_layers:
                raise ConfigError(
                    f"attnres_block_layers={self.attnres_block_layers} exceeds num_layers="
                    f"{num_layers}; a single block is attnres_block_layers={num_layers}")
        return self

    def _validate_kernel_overrides(self) -> None:
        if not self.kernel_overrides:
            return
        from megatron_ext.kernels import declared_ops

        ops = declared_ops()
        for op, backend in self.kernel_overrides.items():
            if op not in ops:
                raise ConfigError(f"kernel_overrides names op {op!r}, which the backend registry "
                                  f"does not have; its ops: {sorted(ops)}")
            if backend not in ops[op].backends:
                raise ConfigError(f"kernel_overrides[{op!r}]={backend!r} is not a backend of "
                                  f"{op}; its backends: {list(ops[op].backends)}")

    def _validate_sparse_attention(self) -> None:
        if not isinstance(self.attention_xsa, bool):
            raise ConfigError(f"attention_xsa={self.attention_xsa!r} must be true or false")
        for name in ("moba_block_size", "moba_top_k", "nsa_compress_block", "nsa_compress_stride",
                     "nsa_select_block", "nsa_select_top_k", "nsa_window"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        for name in ("nsa_compress_block", "nsa_select_block"):
            if getattr(self, name) % self.nsa_compress_stride:
                raise ConfigError(
                    f"{name}={getattr(self, name)} is not a multiple of nsa_compress_stride="
                    f"{self.nsa_compress_stride}; NSA's blocks are made of whole strides")
        if self.nsa_select_top_k < 3:
            raise ConfigError(
                f"nsa_select_top_k={self.nsa_select_top_k} must be >= 3: NSA always keeps the "
                "first block and the 2 local blocks")
        for name in ("dsa_top_k", "dsa_indexer_heads", "dsa_indexer_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for name in ("csa_compress_rate", "csa_top_k", "csa_indexer_heads", "csa_indexer_dim",
                     "csa_window", "hca_compress_rate", "hca_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} must be a positive integer")
        for kind in ("csa", "hca"):
            rate, window = getattr(self, f"{kind}_compress_rate"), getattr(self, f"{kind}_window")
            if window < rate - 1:
                raise ConfigError(
                    f"{kind}_window={window} is smaller than {kind}_compress_rate - 1 = "
                    f"{rate - 1}: the tokens of a query's incomplete block (up to {rate - 1}, "
                    f"its own included), in no entry yet, would be out of its reach; raise "
                    f"{kind}_window or lower {kind}_compress_rate")
        coeff = self.dsa_indexer_loss_coeff
        if isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or not (
                0 <= coeff < math.inf):
            raise ConfigError(
                f"dsa_indexer_loss_coeff={coeff!r} must be a finite number >= 0 (0 leaves the "
                "indexer untrained)")


def resolve(explicit: ExtConfig | None = None) -> ExtConfig:
    """The ExtConfig in force for a spec entry point.

    Order: an explicit config; else Megatron's parsed args when our flags were registered
    (``megatron-ext pretrain`` or a script that passed :func:`add_megatron_args`); else the YAML
    file in ``$MEGATRON_EXT_CONFIG``. With none of these, an error says how to give one.
    """
    if explicit is not None:
        return explicit
    args = _megatron_args()
    if args is not None and hasattr(args, _arg_dest("pattern")):
        return ExtConfig.from_megatron_args(args)
    path = os.environ.get(ENV_CONFIG)
    if path:
        if not os.path.exists(path):
            raise ConfigError(f"{ENV_CONFIG}={path!r} does not exist; point it at a YAML file")
        return ExtConfig.from_yaml(path)
    raise ConfigError(
        "no megatron-ext settings found: pass --ext-pattern (register the flags with "
        "extra_args_provider=megatron_ext.config.add_megatron_args, or use `megatron-ext "
        f"pretrain`), or set {ENV_CONFIG}=path/to/config.yaml"
    )


def _megatron_args() -> argparse.Namespace | None:
    try:
        from megatron.training import global_vars
    except ImportError:
        return None
    return getattr(global_vars, "_GLOBAL_ARGS", None)


# ---------------------------------------------------------------------- argparse bridge
def _cli_fields():
    return fields(ExtConfig)


def _arg_dest(name: str) -> str:
    return f"ext_{name}"


def typed_values(section: str, cls, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked against the annotations of the dataclass ``cls`` (ints given for
    float fields become floats); a value of the wrong type raises ConfigError naming
    ``section.field``, the value and the fix. YAML reads ``3e-4`` (no dot) as a string, the
    usual way a learning rate arrives as text."""
    import types
    import typing

    hints = typing.get_type_hints(cls)
    checked = {}
    for name, value in values.items():
        hint = hints[name]
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
        if value is None and type(None) in options:
            checked[name] = value
            continue
        for option in options:
            base = typing.get_origin(option) or option
            if option is float and isinstance(value, (int, float)) and not isinstance(value, bool):
                checked[name] = float(value)
                break
            if option is int and isinstance(value, int) and not isinstance(value, bool):
                checked[name] = value
                break
            if base in (bool, str) and isinstance(value, base):
                checked[name] = value
                break
            if base is list and isinstance(value, list) and all(
                    isinstance(item, typing.get_args(option)[0]) for item in value):
                checked[name] = value
                break
            if base is dict and isinstance(value, dict) and all(
                    isinstance(key, str) and isinstance(item, str) for key, item in value.items()):
                checked[name] = dict(value)
                break
        else:
            expected = " or ".join(getattr(o, "__name__", str(o)) for o in options)
            fix = ""
            if isinstance(value, str) and float in options:
                fix = " (YAML reads a number without a dot, such as 3e-4, as text: write 3.0e-4)"
            elif isinstance(value, str) and int in options:
                fix = " (write the number without quotes)"
            raise ConfigError(f"{section}.{name}={value!r} is a {type(value).__name__}, "
                              f"expected {expected}{fix}")
    return checked


def format_overrides(overrides: dict[str, str]) -> str:
    """``kernel_overrides`` as its flag's text: ``op=backend,op=backend``."""
    return ",".join(f"{op}={backend}" for op, backend in overrides.items())


def _parse_overrides(text: str) -> dict[str, str]:
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if any(not op.strip() or not sep or not backend.strip() for op, sep, backend in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of op=backend pairs, such as "
                                         "short_conv=reference,index_scores=pytorch")
    return {op.strip(): backend.strip() for op, _, backend in pairs}


def _parse_bool(text: str) -> bool:
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(
        text.lower())
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a boolean; use true or false")
    return value


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``extra_args_provider`` for Megatron's ``pretrain``: one ``--ext-<field>`` per field."""
    group = parser.add_argument_group("megatron-ext")
    defaults = ExtConfig()
    for f in _cli_fields():
        flag = "--ext-" + f.name.replace("_", "-")
        arg_type = {"bool": _parse_bool, "float": float, "dict[str, str]": _parse_overrides}.get(
            f.type, int if "int" in str(f.type) else str)
        help_text = f"megatron-ext {f.name} (default: {getattr(defaults, f.name)!r})"
        if f.name == "pattern":
            help_text += "; symbols like 'GG*' or comma-separated names"
        group.add_argument(flag, dest=_arg_dest(f.name), type=arg_type, default=None,
                           choices=CHOICES.get(f.name), help=help_text)
    return parser
