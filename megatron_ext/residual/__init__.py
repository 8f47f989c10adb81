"""Residual-stream schemes inside our transformer layer (``ExtConfig.residual``):

- ``standard``: Megatron's ``x + F(norm(x))``;
- ``mhc``: Manifold-Constrained Hyper-Connections (Xie et al. 2025, DeepSeek-AI), :mod:`.mhc`;
- ``attnres_full`` / ``attnres_block``: Attention Residuals (Kimi Team 2026), :mod:`.attnres`.

A scheme lives in :class:`megatron_ext.specs.ExtTransformerLayer` (contract in :mod:`.scheme`),
so it travels through ``--spec`` alone: the layer with global number 1 expands the embedding
into the scheme's state, the last layer collapses it to ``[s, b, h]`` for Megatron's final norm
and output layer, and layers in between (and pipeline stages) pass ONE packed 3-D tensor
``[s, b, K h]``. Every token mixer and MoE FFN works unchanged: the scheme only decides what a
sublayer reads and how its output is folded back. Each scheme runs its ops
(:mod:`megatron_ext.kernels.residual.efficient`) with the backend ``ExtConfig.residual_backend``
maps to (:func:`ops_backend`), held as ``scheme.backend``.

Parallelism:

- Pipeline (PP, VPP): the packed width differs from ``hidden_size`` and, for attention
  residuals, from stage to stage. megatron-core 0.19's schedules size their receive buffers as
  ``[s, b, hidden_size]`` (``get_tensor_shapes``) unless ``config.variable_seq_lengths`` is
  set, in which case every P2P message first exchanges its 3-D shape. :func:`prepare` sets it
  on the TransformerConfig the model is built with (the object the schedules read through
  ``get_model_config``). Sequence lengths themselves stay fixed; only the last dimension of
  the messages changes. With virtual pipeline stages the shape exchange needs non-blocking
  P2P (``overlap_p2p_comm=True``, ``batch_p2p_comm=False``, Megatron's defaults for
  interleaved schedules in pretrain_gpt.py): with blocking batched P2P two stages can wait on
  each other's shape message and the interleaved schedule deadlocks (seen on CPU/gloo at
  PP=2 x VPP=2 and PP=4 x VPP=2; both run with the overlap settings).
- Tensor / sequence parallel: the packed state is laid out like hidden states (replicated over
  TP, sequence-sharded under SP); the scheme's parameters (mHC projections and biases,
  pseudo-queries) are small and replicated, marked ``sequence_parallel`` so Megatron sums their
  gradients over TP under SP, exactly like norm weights.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.residual.scheme import ResidualScheme, bias_dropout

if TYPE_CHECKING:
    from megatron_ext.kernels.residual.efficient import Backend

__all__ = ["ResidualScheme", "bias_dropout", "build", "ops_backend", "prepare"]


def build(config, ext: ExtConfig, layer_number: int) -> ResidualScheme | None:
    """The scheme of the layer with global number ``layer_number`` (None: standard)."""
    if ext.residual == "mhc":
        from megatron_ext.residual.mhc import MHC

        return MHC(config, layer_number, streams=ext.mhc_streams,
                   sinkhorn_iters=ext.mhc_sinkhorn_iters, collapse=ext.mhc_collapse,
                   recompute=ext.mhc_recompute, backend=ops_backend(ext))
    if ext.residual in ("attnres_full", "attnres_block"):
        from megatron_ext.residual.attnres import AttentionResiduals

        block = ext.attnres_block_layers if ext.residual == "attnres_block" else None
        return AttentionResiduals(config, layer_number, block_layers=block,
                                  backend=ops_backend(ext))
    return None


def ops_backend(ext: ExtConfig) -> Backend:
    """How the residual-stream ops run for ``ext.residual_backend``
    (:class:`megatron_ext.kernels.residual.efficient.Backend`): "auto" runs our Triton kernels
    (each where its op's declaration in the backend registry, kernels.registry, lets "auto" run
    it: on CUDA, for what it takes, once its first-use check passed) and, when CUDA and Triton are
    available, the compiled PyTorch bodies for the rest; "compile" the compiled bodies only;
    "eager" the eager bodies only."""
    from megatron_ext.kernels.residual.efficient import Backend

    auto = ext.residual_backend == "auto"
    return Backend(compiled=ext.residual_backend == "compile" or (auto and _cuda_with_triton()),
                   triton=auto)


def prepare(config, ext: ExtConfig) -> None:
    """Check that the model config can carry ``ext.residual`` and set what it needs: per-layer
    checkpoint keys (the last layer holds the collapse) and shape exchange between pipeline
    stages."""
    if ext.residual == "standard":
        return
    refusals = {
        "mtp_num_layers": (config.mtp_num_layers or None, "multi-token prediction needs the "
                           "pre-collapse state on the last stage, which is not wired"),
        "cuda_graph_impl": (None if config.cuda_graph_impl == "none" else config.cuda_graph_impl,
                            "CUDA graphs capture [s, b, hidden_size] layer inputs"),
    }
    for name, (value, reason) in refusals.items():
        if value is not None:
            raise ConfigError(f"residual={ext.residual!r} does not support {name}={value!r} "
                              f"({reason}); unset {name} or use residual='standard'")
    if config.virtual_pipeline_model_parallel_size and (
            not config.overlap_p2p_comm or config.batch_p2p_comm):
        raise ConfigError(
            f"residual={ext.residual!r} with virtual pipeline stages needs overlap_p2p_comm=True "
            f"and batch_p2p_comm=False (got {config.overlap_p2p_comm} and "
            f"{config.batch_p2p_comm}): the packed state's shape is exchanged before every "
            "message, and with blocking batched P2P the interleaved schedule deadlocks on it. "
            "These are Megatron's own settings for interleaved schedules (pretrain_gpt.py "
            "without --no-overlap-p2p-communication)")
    config.hetereogenous_dist_checkpoint = True
    if config.pipeline_model_parallel_size > 1:
        config.variable_seq_lengths = True


def _cuda_with_triton() -> bool:
    import importlib.util

    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None
