"""Layer specs for hybrid models: what ``--spec megatron_ext.specs NAME`` and user code call.

Three ways in, one construction underneath (:func:`layer_submodules`):

- ``hybrid_block`` (callable, megatron-core >= 0.19 ``pretrain_gpt.py``): Megatron calls
  ``hybrid_block(model_config, vp_stage=...)`` per model chunk; it returns this stage's
  per-layer specs.
- ``hybrid_layer`` (a ModuleSpec object, for builders that take the named object as is): one
  layer class for every layer, which picks its mixer from the pattern by its global layer
  number, so the same object serves every pipeline stage and VPP chunk.
- :func:`block_spec` for a user's own script:
  ``GPTModel(config, transformer_layer_spec=block_spec(config, pattern="GG*"), ...)``.

Every layer is Megatron's TransformerLayer: norm, token mixer in the ``self_attention`` slot,
bias-dropout-add, norm, FFN (dense MLP, or MoE when ``num_moe_experts`` is set). With a residual
scheme (``ExtConfig.residual``: mHC or Attention Residuals, :mod:`megatron_ext.residual`) the
layer keeps its sublayers and lets the scheme decide what each reads and how its output joins
the residual state.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from megatron_ext import residual
from megatron_ext.config import ConfigError, ExtConfig, resolve
from megatron_ext.kernels import registry
from megatron_ext.norm import TorchNorm
from megatron_ext.mixers.kv_share import share_groups
from megatron_ext.pattern import check_pipeline_split, expand_pattern, stage_layer_indices
from megatron_ext.registry import Mixer

HAVE_TE = importlib.util.find_spec("transformer_engine") is not None
if HAVE_TE:
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_with_transformer_engine_submodules,
    )


def uses_te(ext: ExtConfig) -> bool:
    """Whether layers are built from Transformer Engine modules: only when asked for
    (``attention_backend='te'``); "auto" is the torch SDPA path our tests run, TE or not."""
    if ext.attention_backend == "te" and not HAVE_TE:
        raise ConfigError(
            "attention_backend='te' but Transformer Engine is not installed; install "
            "megatron-ext[te] or use attention_backend='sdpa'"
        )
    return ext.attention_backend == "te"


def _base_submodules(ext: ExtConfig, config) -> TransformerLayerSubmodules:
    """Megatron's own GPT layer (norms, attention, FFN) for the chosen backend."""
    moe = dict(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
               qk_layernorm=config.qk_layernorm)
    if uses_te(ext):
        return get_gpt_layer_with_transformer_engine_submodules(**moe)
    subs = get_gpt_layer_local_submodules(normalization=config.normalization, **moe)
    # Megatron's torch norm refuses sequence parallelism; ours marks its weights for the SP
    # gradient all-reduce instead. Apex's fused norm (when installed) is kept as it is.
    if subs.input_layernorm is WrappedTorchNorm:
        subs.input_layernorm = subs.pre_mlp_layernorm = TorchNorm
    attention = subs.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is WrappedTorchNorm:
            setattr(attention, name, TorchNorm)
    if ext.attention_backend != "local":
        from megatron_ext.mixers.attention import SDPACoreAttention

        attention.core_attention = functools.partial(SDPACoreAttention, ext=ext)
    return subs


def attention_self_spec(ext: ExtConfig, config, variant: str = "attention") -> ModuleSpec:
    """The ``self_attention`` spec of a softmax-attention layer: registry builder of ``*``
    (variant "attention") and of the sparse layers ("moba", "nsa", "fox", "dsa", "csa", "hca"),
    which swap in their core; "dsa" with ``ext.dsa_attention_type == "mla"`` is an MLA layer
    (:func:`megatron_ext.mixers.mla.mla_spec`)."""
    if variant == "dsa" and ext.dsa_attention_type == "mla":
        from megatron_ext.mixers.mla import mla_spec

        return mla_spec(ext, config, indexer=True)
    spec = _base_submodules(ext, config).self_attention
    if variant != "attention":
        from megatron_ext.mixers.sparse_attention import sparse_attention_spec

        if variant in ("dsa", "csa", "hca") and uses_te(ext):
            # DSA's indexer and the CSA / HCA compressors read the normalised input, which TE's
            # norm-fused QKV linear never gives out: the layer keeps its own input norm
            # (layer_submodules) and a plain QKV.
            spec.submodules.linear_qkv = TEColumnParallelLinear
        return sparse_attention_spec(spec, ext, variant)
    if ext.attention_xsa and (ext.attention_backend == "local" or uses_te(ext)):
        raise ConfigError(
            "attention_xsa=True needs our attention core, which Transformer Engine and Megatron's "
            "local core are not; set attention_backend='sdpa'")
    return spec


def layer_submodules(mixer: Mixer, ext: ExtConfig, config) -> TransformerLayerSubmodules:
    """The submodules of one layer whose token mixer is ``mixer``."""
    subs = _base_submodules(ext, config)
    subs.self_attention = mixer.build_spec(ext, config)
    if not mixer.self_attention:
        # The local spec files the input norm under the attention's fused QKV name (for TE
        # checkpoint compatibility); other mixers keep it as their own input_layernorm.
        subs.sharded_state_dict_keys_map.pop("input_layernorm.", None)
        if subs.input_layernorm is IdentityOp:
            # TE fuses the input norm into the attention's QKV linear; other mixers need it back.
            subs.input_layernorm = TENorm
    return subs


def routes(mixer: Mixer, ext: ExtConfig) -> bool:
    """Whether this layer adds a cross-layer routing term (CLVR / CLER-H): delta-rule mixers."""
    return ext.cross_layer_routing != "none" and mixer.routable


class ExtTransformerLayer(TransformerLayer):
    """Megatron's TransformerLayer, with two options:

    - cross-layer routing after the whole layer: ``h <- layer(h) + P_l s_l``, where ``s_l`` is
      the signal the delta-rule mixer returns as its third output (CLVR: its value v; CLER-H:
      its write residual r), which :meth:`_routed_signals` takes off before Megatron's layer
      code sees the mixer's output, and ``P_l`` is a zero-initialised row-parallel projection
      (so the model starts exactly at the baseline, and under TP/SP the term is summed over
      heads and scattered like any layer output);
    - a residual scheme (``ext.residual`` other than "standard"): the sublayers' bias-dropout
      slots stop adding the residual, and the scheme (:mod:`megatron_ext.residual`) gives each
      sublayer its input and folds its output into the packed state the layer returns. A routed
      term then joins the FFN's output, which is where it lands in the standard residual too.
    """

    def __init__(self, config, submodules, *args, route: bool = False,
                 ext: ExtConfig | None = None, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.routing_projection = None
        if route:
            from megatron.core.tensor_parallel import RowParallelLinear

            self.routing_projection = RowParallelLinear(
                self.self_attention.routed_size, config.hidden_size, config=config,
                init_method=torch.nn.init.zeros_, bias=False, input_is_parallel=True,
                skip_bias_add=True, tp_group=self.tp_group)
        self.residual = residual.build(config, ext, self.layer_number) if ext is not None else None
        if self.residual is not None:
            self.self_attn_bda = self.mlp_bda = residual.bias_dropout

    @contextlib.contextmanager
    def _routed_signals(self):
        """Yields a list that, with routing on, receives the signal of each call of the mixer,
        whose output ``(out, bias, signal)`` goes on to Megatron's layer code as ``(out, bias)``
        (the form its ``_forward_attention`` takes)."""
        signals = []
        if self.routing_projection is None:
            yield signals
            return

        def take_signal(module, args, output):
            out, bias, signal = output
            signals.append(signal)
            return out, bias

        handle = self.self_attention.register_forward_hook(take_signal)
        try:
            yield signals
        finally:
            handle.remove()

    def _route(self, output: torch.Tensor, signals: list) -> torch.Tensor:
        """``output + P_l s_l`` with routing on (``s_l`` from ``signals``), else output."""
        if self.routing_projection is None:
            return output
        routed, _ = self.routing_projection(signals.pop().to(output.dtype))
        return output + routed

    def forward(self, *args, **kwargs):
        with self._routed_signals() as signals:
            if self.residual is not None:
                return self._forward_with_scheme(signals, *args, **kwargs)
            output, context = super().forward(*args, **kwargs)
            return self._route(output, signals), context

    def _forward_with_scheme(self, signals: list, *args, **kwargs):
        """TransformerLayer.forward with the residual connections of ``self.residual``;
        ``signals``: the mixer's routed signal (:meth:`_routed_signals`)."""
        if "hidden_states" in kwargs:
            hidden_states = kwargs.pop("hidden_states")
        else:
            hidden_states, *args = args
        state = self.residual.enter(hidden_states)
        output, context = self._forward_attention(self.residual.sublayer_input(state), *args,
                                                  **kwargs)
        self.residual.sublayer_output(state, output)
        output = self._forward_mlp(self.residual.sublayer_input(state),
                                   kwargs.get("inference_context"),
                                   padding_mask=kwargs.get("padding_mask"),
                                   packed_seq_params=kwargs.get("packed_seq_params"))
        output = self._route(output, signals)
        self.residual.sublayer_output(state, output)
        return self.residual.exit(state), context


def layer_spec(mixer: Mixer, ext: ExtConfig, config, kv_share=None) -> ModuleSpec:
    """One layer's spec; ``kv_share``: its (KVShare, produces) when it shares keys and values
    (:mod:`megatron_ext.mixers.kv_share`)."""
    submodules = layer_submodules(mixer, ext, config)
    if kv_share is not None:
        from megatron_ext.mixers.kv_share import KVShareSelfAttention

        attention = submodules.self_attention
        attention.module = KVShareSelfAttention
        attention.params = {**attention.params, "kv_share": kv_share[0],
                            "produces": kv_share[1]}
    return ModuleSpec(module=ExtTransformerLayer, submodules=submodules,
                      params={"route": routes(mixer, ext), "ext": ext})


def final_norm(ext: ExtConfig):
    return TENorm if uses_te(ext) else TorchNorm


def _prepare(config, ext: ExtConfig) -> list[Mixer]:
    """Validate once and set what Megatron needs for this pattern; returns all layers' mixers."""
    ext.validate(config.num_layers)
    registry.override(ext.kernel_overrides)
    check_pipeline_split(config)
    residual.prepare(config, ext)
    mixers = expand_pattern(ext.pattern, config.num_layers)
    if any(m.name in ("dsa", "csa") for m in mixers):  # layers with an indexer
        from megatron_ext.mixers import dsa

        dsa.prepare(config, ext)
    elif ext.dsa_stage == "dense_warmup":
        raise ConfigError(
            f"dsa_stage='dense_warmup' trains only the indexers of DSA and CSA layers, but "
            f"pattern {ext.pattern!r} has no 'D' or 'C' layer; add one or set "
            "dsa_stage='sparse'")
    if len({m.name for m in mixers}) > 1:
        # Layers with different parameter sets cannot share stacked checkpoint tensors.
        config.hetereogenous_dist_checkpoint = True
    return mixers


def block_spec(config, pattern: str | list[str] | None = None, ext: ExtConfig | None = None,
               vp_stage: int | None = None, pp_rank: int | None = None
               ) -> TransformerBlockSubmodules:
    """Per-layer specs of the layers this pipeline stage (and VPP chunk) builds.

    ``config`` is the model's TransformerConfig (or a GPTModelConfig wrapping one). ``pattern``
    overrides ``ext.pattern``; without ``ext`` the settings come from :func:`config.resolve`.
    For DSA's dense warm-up, call :func:`megatron_ext.mixers.dsa.freeze_all_but_indexers` on
    the model you build (``hybrid_block`` has Megatron's builder do it).
    """
    ext = copy.copy(ext if ext is not None else (ExtConfig() if pattern else resolve()))
    if pattern is not None:
        ext.pattern = pattern
    mixers = _prepare(config, ext)
    local = stage_layer_indices(config, vp_stage=vp_stage, pp_rank=pp_rank)
    shared = share_groups(mixers, ext, local)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(mixers[i], ext, config, shared.get(i)) for i in local],
        layer_norm=final_norm(ext),
    )


def mtp_layer_block(config, ext: ExtConfig) -> TransformerBlockSubmodules:
    """The layer each of Megatron's multi-token-prediction layers wraps: a softmax-attention
    layer of ours (MTP needs an attention mask type; Megatron's GPT builder, under ``pretrain``,
    puts its own standard GPT layer there, with the same parameters)."""
    from megatron_ext.registry import lookup

    return TransformerBlockSubmodules(layer_specs=[layer_spec(lookup("attention"), ext, config)])


def hybrid_block(model_config, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """``--spec megatron_ext.specs hybrid_block`` (megatron-core >= 0.19 ``pretrain_gpt.py``)."""
    return block_spec(model_config, vp_stage=vp_stage)


class PatternTransformerLayer(ExtTransformerLayer):
    """A TransformerLayer that picks its token mixer from the pattern by its global number.

    Used through the ``hybrid_layer`` spec object, which Megatron fans out to every layer of
    every stage; the global layer number then tells each layer which mixer it is.
    """

    def __init__(self, config, submodules=None, layer_number: int = 1, vp_stage=None,
                 pg_collection=None, add_layer_offset: bool = True, ext: ExtConfig | None = None,
                 **kwargs):
        ext = resolve(ext)
        mixers = _prepare(config, ext)
        if ext.attention_kv_share > 1:
            raise ConfigError("attention_kv_share groups layers that must be built together: "
                              "use block_spec / hybrid_block, not the hybrid_layer spec object")
        global_number = layer_number
        if add_layer_offset and not kwargs.get("is_mtp_layer", False):
            pp_rank = pg_collection.pp.rank() if pg_collection is not None else None
            global_number += get_transformer_layer_offset(config, vp_stage, pp_rank)
        mixer = mixers[global_number - 1]
        super().__init__(
            config, layer_submodules(mixer, ext, config), route=routes(mixer, ext), ext=ext,
            layer_number=layer_number, vp_stage=vp_stage, pg_collection=pg_collection,
            add_layer_offset=add_layer_offset, **kwargs)


hybrid_layer = ModuleSpec(module=PatternTransformerLayer)
