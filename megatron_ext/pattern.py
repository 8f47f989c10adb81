"""From a pattern to the mixers of the layers a pipeline stage builds.

A pattern names one token mixer per layer: a string of symbols (``"GGG*GGG*"``; spaces are
ignored) or a list of symbols or names. A single entry is repeated over all layers.
"""

from __future__ import annotations

from megatron_ext.config import ConfigError
from megatron_ext.registry import Mixer, lookup


def expand_pattern(pattern: str | list[str], num_layers: int) -> list[Mixer]:
    """One registry entry per layer, for all ``num_layers`` layers of the model."""
    if isinstance(pattern, str):
        entries = [c for c in pattern if not c.isspace()]
    else:
        entries = list(pattern)
    if not entries:
        raise ConfigError("pattern is empty; give one mixer per layer, e.g. 'GGG*'")
    mixers = [lookup(e) for e in entries]
    if len(mixers) == 1:
        return mixers * num_layers
    if len(mixers) != num_layers:
        raise ConfigError(
            f"pattern {pattern!r} describes {len(mixers)} layers but num_layers={num_layers}; "
            f"give exactly {num_layers} entries, or a single entry to repeat"
        )
    return mixers


def check_pipeline_split(config) -> None:
    """Fail early, with the fix, when the layers cannot be split over the pipeline as asked."""
    pp = config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size or 1
    if pp == 1 and vpp == 1:
        return
    if (config.pipeline_model_parallel_layout is not None
            or config.account_for_embedding_in_pipeline_split
            or config.account_for_loss_in_pipeline_split):
        return  # Megatron validates these splits itself.
    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    middle_layers = config.num_layers - (first or 0) - (last or 0)
    middle_stages = pp - (first is not None) - (last is not None)
    if middle_layers < 0 or (middle_stages > 0 and middle_layers % middle_stages):
        raise ConfigError(
            f"num_layers={config.num_layers} cannot be split evenly over "
            f"pipeline_model_parallel_size={pp} (first stage {first}, last stage {last}); "
            "choose num_layers divisible by the number of stages, or set the first/last stage "
            "layer counts"
        )
    per_stage = middle_layers // middle_stages if middle_stages else (first or last)
    for label, count in (("each stage", per_stage), ("first stage", first), ("last stage", last)):
        if count is not None and count % vpp:
            raise ConfigError(
                f"{label} has {count} layers, not divisible by "
                f"virtual_pipeline_model_parallel_size={vpp}; choose num_layers so that every "
                "stage holds a multiple of the virtual stages"
            )


def stage_layer_indices(config, vp_stage: int | None = None, pp_rank: int | None = None):
    """0-based global indices of the layers that this pipeline stage (and VPP chunk) builds."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if config.pipeline_model_parallel_layout is not None:
        return list(config.pipeline_model_parallel_layout.get_layer_id_list(
            layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    count = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return list(range(offset, offset + count))
