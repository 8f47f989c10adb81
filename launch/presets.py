"""Presets: model, data, training and parallel settings as YAML data files.

A preset is looked up by name in ``presets/`` next to this file (``tiny-hybrid`` ->
``presets/tiny-hybrid.yaml``) or given as a path to a YAML file of the same shape.
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
import re

import yaml

from megatron_ext.config import ConfigError

PRESET_DIR = pathlib.Path(__file__).parent / "presets"


def list_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def preset_path(name_or_path: str) -> pathlib.Path:
    path = pathlib.Path(name_or_path)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists():
            raise FileNotFoundError(f"preset file {name_or_path!r} does not exist")
        return path
    path = PRESET_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        raise ConfigError(
            f"unknown preset {name_or_path!r}; known presets: {', '.join(list_presets())} "
            "(or give a path to a .yaml file)"
        )
    return path


def load_preset(name_or_path: str) -> dict:
    """The preset as a dict of sections (model, ext, data, train, parallel)."""
    with open(preset_path(name_or_path)) as f:
        return yaml.safe_load(f) or {}


# ---------------------------------------------------------------------------- sizes
# A preset whose name ends in a size ("hybrid-350m", "hybrid-1.3b") must build a model of that
# many parameters, embeddings included, within this relative tolerance. Sizes are nominal (the
# seed paper's 20-layer "350M" models have 284-291M), so the band is wide; it still catches a
# wrong layer count, width or FFN, which move the count by far more.
SIZE_TOLERANCE = 0.15
_SIZE_SUFFIX = re.compile(r"-(\d+(?:\.\d+)?)([mb])$")


def nominal_size(name_or_path: str) -> float | None:
    """The parameter count a preset's name states (``"hybrid-1.3b"`` -> 1.3e9), or None."""
    path = pathlib.Path(name_or_path)
    name = path.stem if path.suffix in (".yaml", ".yml") else path.name  # "hybrid-1.3b"
    match = _SIZE_SUFFIX.search(name.lower())
    if match is None:
        return None
    return float(match.group(1)) * {"m": 1e6, "b": 1e9}[match.group(2)]


def load_settings(name_or_path: str):
    """The preset as validated :class:`~megatron_ext.train.RunSettings`."""
    from megatron_ext.train import RunSettings

    return RunSettings.from_dict(load_preset(name_or_path)).validate()


@contextlib.contextmanager
def _megatron_world(parallel=None, rank: int = 0):
    """Megatron's parallel state in this process, for building models on the ``meta`` device.

    ``parallel``: a :class:`~megatron_ext.train.ParallelSettings` (default: TP = PP = CP = 1).
    Without a process group yet, the world is ``tensor x pipeline x context`` ranks (data
    parallelism 1: it does not change what a rank builds) on torch's fake backend, whose
    collectives return at once without moving data, and this process is rank ``rank`` of it;
    torn down on exit. Inside a running job (a process group exists) only the sizes 1 are
    possible, on that job's groups.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_ext.train import ParallelSettings

    p = parallel or ParallelSettings()
    world = p.tensor * p.pipeline * p.context
    own_world = not dist.is_initialized()
    if own_world:
        # Importing it registers the "fake" backend (torch's single-process stand-in for a world).
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    elif world != 1:
        raise ConfigError("a tensor-, pipeline- or context-parallel layout is built in a process "
                          "without a process group (stage_parameters starts one)")
    own_groups = not parallel_state.model_parallel_is_initialized()
    try:
        if own_groups:
            parallel_state.initialize_model_parallel(
                p.tensor, p.pipeline, virtual_pipeline_model_parallel_size=p.virtual_pipeline,
                context_parallel_size=p.context, create_gloo_process_groups=False)
        elif (parallel_state.get_tensor_model_parallel_world_size() != 1
              or parallel_state.get_pipeline_model_parallel_world_size() != 1):
            raise ConfigError(
                "parameter_count builds the whole model in one process; call it outside a "
                "tensor- or pipeline-parallel run (or before its groups are set up)")
        yield
    finally:
        if own_groups:
            parallel_state.destroy_model_parallel()
        if own_world:
            dist.destroy_process_group()


def stage_parameters(settings, vocab_size: int | None = None) -> list[int]:
    """The parameters one GPU of each pipeline stage holds (its virtual-pipeline chunks summed)
    at the settings' tensor, pipeline, virtual-pipeline and context parallel sizes: the real
    model constructors, run on the ``meta`` device (shapes, no storage) in this process, so that
    a layout they refuse (heads or widths not divisible by TP, layers by the pipeline) fails here
    and not after a queue wait. Errors are :class:`ConfigError` naming the layout.

    ``vocab_size``: the tokenizer's size before padding (default: ``data.vocab_size``), padded
    as training pads it (to a multiple of 128 x TP).
    """
    import torch
    import torch.distributed as dist

    from megatron_ext import train

    settings = copy.deepcopy(settings).validate()
    p = settings.parallel
    if dist.is_initialized() and p.tensor * p.pipeline * p.context > 1:
        # This process belongs to a world already; the layout's fake world needs its own process.
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(
                1, mp_context=multiprocessing.get_context("spawn")) as pool:
            return pool.submit(stage_parameters, settings, vocab_size).result()
    vocab = train._padded_vocab(vocab_size or settings.data.vocab_size, p.tensor)
    # Megatron's own modules honour the meta device (with CPU initialisation they allocate
    # without naming a device); Transformer Engine's are placed on an explicit device, so they
    # are not used here: both hold the same parameters.
    if settings.ext.attention_backend != "local":
        settings.ext.attention_backend = "sdpa"
    counts = []
    for stage in range(p.pipeline):
        rank = stage * p.tensor * p.context  # Megatron's rank order: tp, cp, (ep, dp), pp
        runtime = train.Runtime(device=torch.device("cpu"), rank=rank, world_size=p.tensor *
                                p.pipeline * p.context)
        chunks = range(p.virtual_pipeline) if p.virtual_pipeline else [None]
        try:
            with _megatron_world(p, rank), torch.device("meta"):
                config = train.unloaded_config(settings, runtime)  # shapes only
                models = [train.build_model(settings, config, vocab, vp_stage=chunk)
                          for chunk in chunks]
        except (AssertionError, ValueError) as error:  # Megatron's refusals; ours are ConfigError
            raise ConfigError(
                f"the model does not build at parallel.tensor={p.tensor}, pipeline={p.pipeline}, "
                f"virtual_pipeline={p.virtual_pipeline}, context={p.context} (pipeline stage "
                f"{stage}): {error or type(error).__name__}") from error
        counts.append(sum(w.numel() for model in models for w in model.parameters()))
    return counts


def parameter_count(settings_or_preset_name, vocab_size: int | None = None) -> int:
    """Exact number of parameters of the model a preset builds (all layers, all experts,
    untied input and output embeddings), without allocating it.

    ``settings_or_preset_name``: a :class:`~megatron_ext.train.RunSettings`, a preset name or
    a YAML path. ``vocab_size``: the tokenizer's size before padding; default: the preset's
    ``data.vocab_size``. It is padded as training pads it (to a multiple of 128 x TP).

    The model is :func:`stage_parameters`' with every pipeline stage in one piece (TP = PP =
    CP = 1); a 3B model takes well under a second and no memory, on a machine without a GPU.
    """
    from megatron_ext import train

    if isinstance(settings_or_preset_name, train.RunSettings):
        settings = copy.deepcopy(settings_or_preset_name)
    else:
        settings = load_settings(settings_or_preset_name)
    tensor = settings.parallel.tensor
    settings.parallel = train.ParallelSettings()
    vocab = train._padded_vocab(vocab_size or settings.data.vocab_size, tensor)
    return stage_parameters(settings, vocab_size=vocab)[0]


def model_flops_per_token(settings) -> float:
    """Training FLOPs per token (forward + backward = 3x forward) of the model a
    :class:`~megatron_ext.train.RunSettings` describes, the count behind the benchmarks' MFU:

    - 6 per weight of every matrix multiply (the embedding lookup excluded, the output layer
      included);
    - each softmax layer ``6 * T * heads * head_dim`` (causal: half of the T x T scores; sparse
      layers count as dense, an upper bound);
    - each linear-recurrent layer, per value head, ``3 * (6 * K * V + 2 * C * (2 * K + V))``:
      the chunked recurrence's state read, state update and intra-chunk correction (``2 K V``
      each) plus the in-chunk scores and their use, chunk C = 64.
    """
    from megatron_ext.pattern import expand_pattern

    chunk = 64
    m, ext = settings.model, settings.ext
    flops = 6.0 * (parameter_count(settings) - settings.data.vocab_size * m.hidden_size)
    head_dim = m.hidden_size // m.num_attention_heads
    for mixer in expand_pattern(ext.pattern, m.num_layers):
        if mixer.self_attention:
            flops += 6.0 * m.seq_length * m.num_attention_heads * head_dim
        else:
            heads = ext.linear_num_value_heads or m.num_attention_heads
            key_dim = ext.linear_key_head_dim or head_dim
            value_dim = ext.linear_value_head_dim or head_dim
            flops += heads * 3 * (6 * key_dim * value_dim + 2 * chunk * (2 * key_dim + value_dim))
    return flops


def check_parameter_count(name_or_path: str, count: int | None = None) -> int:
    """The preset's parameter count, checked against the size in its name (see
    :data:`SIZE_TOLERANCE`); ``count`` skips the measurement when already known."""
    nominal = nominal_size(name_or_path)
    if nominal is None:
        raise ConfigError(f"preset name {name_or_path!r} states no size (like '-350m' or '-1.3b')")
    count = parameter_count(name_or_path) if count is None else count
    if abs(count - nominal) > SIZE_TOLERANCE * nominal:
        raise ConfigError(
            f"preset {name_or_path!r} builds {count / 1e6:,.1f}M parameters, "
            f"{(count / nominal - 1) * 100:+.1f}% off the {nominal / 1e6:,.0f}M its name states "
            f"(allowed: +-{SIZE_TOLERANCE:.0%}); change the model's sizes or the name")
    return count
