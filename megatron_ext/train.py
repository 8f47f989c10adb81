"""``megatron-ext train``: a small, readable training loop on megatron-core pieces.

From tokens to loss: :func:`build_model` (GPTModel with our per-layer specs) -> :func:`_batches`
(samples of Megatron's GPTDataset, one global batch per step) -> :func:`_train_step` (forward,
loss, backward over micro-batches; optimizer step) -> checkpoints and a loss curve in the run
directory.

On CUDA (one process, or ``torchrun`` for several) it uses Megatron's DDP, optimizer and
pipeline schedules, so TP/PP/DP runs are the real thing. On a CPU, megatron-core's training
utilities cannot run (they allocate on ``"cuda"`` directly), so the same Megatron model trains
with ``torch.optim.AdamW`` and a plain micro-batch loop, in one process or in several gloo
processes that are all tensor-parallel (``WORLD_SIZE == parallel.tensor``: no data-parallel
gradient reduction is needed); everything else (data, model, schedule of the learning rate,
checkpoints) is shared.

Run directory layout::

    RUN_DIR/config.yaml           the settings of the run
    RUN_DIR/metrics.jsonl         one line per logged step / evaluation (appended on resume)
    RUN_DIR/checkpoints/iter_N/   model (dist checkpoint; on CPU a state dict: model/model.pt,
                                  or model/model_rankNNNNN.pt per TP rank) + optimizer,
                                  scheduler and RNG state per rank
    RUN_DIR/checkpoints/latest    the step of the newest complete checkpoint
    RUN_DIR/loss_curve.png/.json  written at the end
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pathlib
import shutil
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import yaml

from megatron_ext.config import ConfigError, ExtConfig, typed_values


# ---------------------------------------------------------------------------- settings
@dataclass
class ModelSettings:
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int | None = None
    num_attention_heads: int = 4
    num_query_groups: int | None = None
    seq_length: int = 256
    position_embedding_type: str = "rope"
    rotary_base: float = 10000
    # Context extension of the RoPE table (megatron_ext.rope): "none", "linear", "ntk",
    # "dynamic_ntk" or "yarn", by rope_scaling_factor over rope_original_length (default:
    # seq_length) tokens; applied by `megatron-ext train` and the exported model.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_length: int | None = None
    normalization: str = "RMSNorm"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    num_moe_experts: int | None = None
    moe_router_topk: int = 2
    # Auxiliary-loss-free balancing (Wang et al. 2024, as DeepSeek-V3): sigmoid router scores
    # plus a per-expert bias that only picks the experts; after each step it moves by
    # moe_router_bias_update_rate towards balance (up for experts below the mean load).
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # Multi-token prediction (DeepSeek-V3): mtp_num_layers extra layers, layer k predicting
    # token t + 1 + k, their mean loss times mtp_loss_scaling_factor added to the LM loss.
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1


@dataclass
class DataSettings:
    """Where the tokens come from. ``paths`` (``megatron-ext pretrain``): Megatron's ``--data-path``
    blend of preprocessed indexed datasets (``[weight] prefix ...``, prefixes without
    ``.bin``/``.idx``), split by ``split``, with Megatron's tokenizer ``tokenizer_type`` (e.g.
    SentencePieceTokenizer, HuggingFaceTokenizer) and ``tokenizer_model``. Without paths: the
    text files ``inputs`` (None: the Python standard library, a smoke-test corpus), tokenized
    with a sentencepiece model trained on them, ``vocab_size`` pieces, into ``output_dir``."""

    inputs: list[str] | None = None
    vocab_size: int = 4096
    output_dir: str | None = None  # None: <run_dir>/../data/<corpus name> (shared by runs)
    paths: list[str] | None = None
    split: str = "98,2,0"
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None


@dataclass
class TrainSettings:
    micro_batch_size: int = 8
    global_batch_size: int = 16
    steps: int = 300
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 30
    decay_style: str = "cosine"  # constant, linear, cosine, inverse-square-root or WSD
    # WSD (warmup-stable-decay): the last wsd_decay_steps decay to min_lr in this style.
    wsd_decay_steps: int | None = None
    wsd_decay_style: str = "linear"  # linear, cosine, exponential or minus_sqrt
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_batches: int = 4
    save_interval: int = 100
    bf16: bool = True  # on CUDA; CPU runs are fp32
    # megatron-ext pretrain only: replay each iteration's forward and backward as one CUDA graph
    # (Megatron's --cuda-graph-impl full_iteration), which takes the host's launch work out of
    # the step; it turns Megatron's NaN check of loss and gradients off. See docs/megatron.md.
    cuda_graph: bool = False

    def set_steps(self, steps: int) -> None:
        """Train for ``steps`` steps with the same schedule shape: warmup and the WSD decay
        phase are scaled by the same factor (a preset's 28,610-step schedule run for 300 steps
        keeps its 0.7% warmup and 20% decay)."""
        if steps < 2:
            raise ConfigError(f"--steps {steps}: a run needs at least 2 steps")
        ratio = steps / self.steps
        self.warmup_steps = min(round(self.warmup_steps * ratio), steps - 1)
        if self.wsd_decay_steps:
            self.wsd_decay_steps = min(max(1, round(self.wsd_decay_steps * ratio)),
                                       steps - self.warmup_steps)
        self.steps = steps


@dataclass
class ParallelSettings:
    """How a run splits over GPUs. ``megatron-ext train`` takes tensor (and pipeline, sequence
    parallelism on CUDA); the rest are Megatron's, for ``megatron-ext pretrain``."""

    tensor: int = 1
    pipeline: int = 1
    sequence_parallel: bool = False
    context: int = 1  # --context-parallel-size (ext.context_parallel_method for linear mixers)
    virtual_pipeline: int | None = None  # model chunks per pipeline rank (interleaved 1F1B)
    # None: Megatron's distributed optimizer (ZeRO-1 sharded optimizer state) whenever there is
    # more than one data-parallel rank; True / False: always / never.
    distributed_optimizer: bool | None = None
    recompute: str | None = None  # activation recompute: None, "selective" or "full"


@dataclass
class LoggingSettings:
    """``megatron-ext pretrain``'s logging besides its log: TensorBoard in RUN_DIR/tensorboard
    (when the tensorboard package imports), and Weights & Biases when a project is given."""

    tensorboard: bool = True
    wandb_project: str | None = None
    wandb_exp_name: str | None = None  # default: the run directory's name


@dataclass
class RunSettings:
    model: ModelSettings = field(default_factory=ModelSettings)
    ext: ExtConfig = field(default_factory=ExtConfig)
    data: DataSettings = field(default_factory=DataSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    parallel: ParallelSettings = field(default_factory=ParallelSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)

    @classmethod
    def from_dict(cls, values: dict) -> "RunSettings":
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(sections))
        if unknown:
            raise ConfigError(f"unknown preset section(s) {unknown}; known: {sorted(sections)}")
        kwargs = {}
        for f in dataclasses.fields(cls):
            section = values.get(f.name) or {}
            section_cls = f.default_factory
            known = {g.name for g in dataclasses.fields(section_cls)}
            bad = sorted(set(section) - known)
            if bad:
                raise ConfigError(f"unknown setting(s) {bad} in section {f.name!r}; "
                                  f"known: {sorted(known)}")
            kwargs[f.name] = (section_cls.from_dict(section) if section_cls is ExtConfig
                              else section_cls(**typed_values(f.name, section_cls, section)))
        return cls(**kwargs)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "RunSettings":
        from megatron_ext import rope

        m, t = self.model, self.train
        rope.check(m.rope_scaling, m.rope_scaling_factor, m.rope_original_length,
                   m.position_embedding_type)
        if m.moe_router_enable_expert_bias and not m.num_moe_experts:
            raise ConfigError("model.moe_router_enable_expert_bias balances experts: set "
                              "model.num_moe_experts")
        if m.mtp_num_layers is not None and m.mtp_num_layers < 1:
            raise ConfigError(f"model.mtp_num_layers={m.mtp_num_layers} must be >= 1 (or unset)")
        if not 0 <= t.warmup_steps < t.steps:
            raise ConfigError(f"train.warmup_steps={t.warmup_steps} must be >= 0 and smaller "
                              f"than train.steps={t.steps}")
        for name in ("log_interval", "eval_interval", "save_interval", "micro_batch_size",
                     "global_batch_size", "eval_batches"):
            if getattr(t, name) < 1:
                raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 1")
        if not 0 <= t.min_lr <= t.lr or t.lr <= 0:
            raise ConfigError(f"train.lr={t.lr} and train.min_lr={t.min_lr} need 0 <= min_lr "
                              "<= lr and lr > 0")
        styles = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
        if t.decay_style not in styles:
            raise ConfigError(f"train.decay_style={t.decay_style!r} is not one of {list(styles)}")
        if t.decay_style == "WSD":
            if not t.wsd_decay_steps or not 0 < t.wsd_decay_steps <= t.steps - t.warmup_steps:
                raise ConfigError(
                    f"train.wsd_decay_steps={t.wsd_decay_steps} must be in (0, steps - "
                    f"warmup_steps = {t.steps - t.warmup_steps}] with decay_style 'WSD'")
            wsd_styles = ("linear", "cosine", "exponential", "minus_sqrt")
            if t.wsd_decay_style not in wsd_styles:
                raise ConfigError(f"train.wsd_decay_style={t.wsd_decay_style!r} is not one of "
                                  f"{list(wsd_styles)}")
        if t.global_batch_size % t.micro_batch_size:
            raise ConfigError(f"train.global_batch_size={t.global_batch_size} must be a "
                              f"multiple of train.micro_batch_size={t.micro_batch_size}")
        p, m = self.parallel, self.model
        heads = m.num_attention_heads
        split_over_tp = {
            "model.num_attention_heads": heads,
            "model.num_query_groups": m.num_query_groups or heads,
            "model.ffn_hidden_size": m.ffn_hidden_size or 4 * m.hidden_size,
            "ext.linear_num_key_heads": self.ext.linear_num_key_heads or m.num_query_groups or heads,
            "ext.linear_num_value_heads": self.ext.linear_num_value_heads or heads,
        }
        for name, value in split_over_tp.items():
            if value % p.tensor:
                raise ConfigError(f"{name}={value} is not divisible by parallel.tensor="
                                  f"{p.tensor} (tensor parallelism splits it over the GPUs): "
                                  "choose a tensor size that divides it")
        if p.recompute not in (None, "selective", "full"):
            raise ConfigError(f"parallel.recompute={p.recompute!r} is not one of None, "
                              "'selective', 'full'")
        for name in ("tensor", "pipeline", "context"):
            if getattr(p, name) < 1:
                raise ConfigError(f"parallel.{name}={getattr(p, name)} must be >= 1")
        if p.virtual_pipeline is not None and (p.pipeline < 2 or p.virtual_pipeline < 2 or
                                               self.model.num_layers % (p.pipeline * p.virtual_pipeline)):
            raise ConfigError(
                f"parallel.virtual_pipeline={p.virtual_pipeline} needs parallel.pipeline >= 2 and "
                f"num_layers ({self.model.num_layers}) divisible by pipeline x virtual_pipeline")
        d = self.data
        if d.paths and not d.tokenizer_type:
            raise ConfigError("data.paths needs data.tokenizer_type (Megatron's --tokenizer-type, "
                              "e.g. SentencePieceTokenizer or HuggingFaceTokenizer) and "
                              "data.tokenizer_model")
        self.ext.validate(self.model.num_layers)
        return self


# ---------------------------------------------------------------------------- runtime
@dataclass
class Runtime:
    device: torch.device
    rank: int
    world_size: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def init_runtime(settings: RunSettings, device: str) -> Runtime:
    """Process group (NCCL on CUDA, gloo on CPU) and Megatron's model-parallel groups."""
    from megatron.core import parallel_state

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if use_cuda and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for but no CUDA GPU is visible")
    p = settings.parallel
    if not use_cuda and world_size > 1:
        _check_cpu_layout(settings, world_size)
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if use_cuda:
            # torchrun (or a Slurm launcher) sets these; a lone GPU process uses local defaults.
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            dist.init_process_group("nccl", rank=rank, world_size=world_size)
        elif world_size > 1:
            # Tensor-parallel CPU processes meet at MASTER_ADDR:MASTER_PORT (torchrun and the
            # Slurm job script set them).
            missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
            if missing:
                raise ConfigError(
                    f"WORLD_SIZE={world_size} but {' and '.join(missing)} not set: start the "
                    "processes with torchrun (or the Slurm job script), which sets them")
            dist.init_process_group("gloo", init_method="env://", rank=rank,
                                    world_size=world_size)
        else:
            # One CPU process needs no rendezvous: an in-memory store, so that no port is taken.
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    if world_size % (p.tensor * p.pipeline):
        raise ConfigError(
            f"world size {world_size} is not divisible by tensor ({p.tensor}) x pipeline "
            f"({p.pipeline}) parallel sizes")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline)
    torch.manual_seed(settings.train.seed)
    if use_cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(settings.train.seed)
    else:
        # On a CPU every rank draws from the same default generator (use_cpu_initialization
        # slices the same master weights on every TP rank), so dropout needs no separate
        # model-parallel RNG stream; this tracker makes Megatron's fork() a no-op instead of
        # touching CUDA.
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return Runtime(torch.device("cuda", torch.cuda.current_device()) if use_cuda
                   else torch.device("cpu"), rank, world_size)


def _check_cpu_layout(settings: RunSettings, world_size: int) -> None:
    """Several CPU processes train only when all of them are tensor-parallel ranks.

    The CPU path has no Megatron DDP (no data-parallel gradient reduction), no pipeline
    schedule (no stage-to-stage sends) and no sequence-parallel gradient reduction of the
    replicated parameters. With ``WORLD_SIZE == parallel.tensor`` none of them is needed: every
    rank sees the same batches, sharded parameters get their full gradient from Megatron's TP
    layers, and replicated parameters (norms) get identical gradients on every rank.
    """
    p = settings.parallel
    reasons = []
    if p.pipeline > 1:
        reasons.append(f"parallel.pipeline={p.pipeline} (pipeline schedules need CUDA)")
    if world_size != p.tensor * p.pipeline:
        reasons.append(f"data-parallel size {world_size // max(1, p.tensor * p.pipeline)} "
                       f"(WORLD_SIZE={world_size} != parallel.tensor={p.tensor}; data-parallel "
                       "gradient reduction needs Megatron's DDP, which needs CUDA)")
    if p.sequence_parallel and p.tensor > 1:
        reasons.append("parallel.sequence_parallel (its gradient reduction of the norms runs "
                       "in Megatron's finalize_model_grads, which needs CUDA)")
    if reasons:
        raise ConfigError(
            f"CPU training with WORLD_SIZE={world_size} supports only tensor parallelism "
            f"(WORLD_SIZE == parallel.tensor, pipeline 1, no sequence parallelism); this run "
            f"has {'; '.join(reasons)}. Start parallel.tensor processes (or one, without "
            "torchrun), or train on CUDA GPUs.")


def transformer_config(settings: RunSettings, runtime: Runtime):
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p, t = settings.model, settings.parallel, settings.train
    bf16 = runtime.cuda and t.bf16
    dtype = torch.bfloat16 if bf16 else torch.float32
    if not runtime.cuda and m.position_embedding_type == "rope":
        raise ConfigError(
            "position_embedding_type='rope' needs CUDA in megatron-core 0.19 (its RotaryEmbedding "
            "moves to the current CUDA device); use 'none' or 'learned_absolute' on a CPU")
    return TransformerConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        num_attention_heads=m.num_attention_heads, num_query_groups=m.num_query_groups,
        normalization=m.normalization, hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        num_moe_experts=m.num_moe_experts,
        moe_router_topk=m.moe_router_topk if m.num_moe_experts else 2,
        **({"moe_router_enable_expert_bias": True, "moe_router_score_function": "sigmoid",
            "moe_router_bias_update_rate": m.moe_router_bias_update_rate}
           if m.moe_router_enable_expert_bias else {}),
        mtp_num_layers=m.mtp_num_layers, mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        tensor_model_parallel_size=p.tensor, pipeline_model_parallel_size=p.pipeline,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline, context_parallel_size=p.context,
        sequence_parallel=p.sequence_parallel and p.tensor > 1,
        bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
        use_cpu_initialization=not runtime.cuda,
        bias_dropout_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
    )


def unloaded_config(settings: RunSettings, runtime: Runtime):
    """:func:`transformer_config` for a model whose weights are loaded (or only counted) after
    it is built: no random draws, and RoPE allowed on a CPU (the config refuses it there only
    because megatron-core 0.19 builds the rotary table on the CUDA device when the model runs;
    the model takes its position embedding from ``settings.model`` still)."""
    config_settings = copy.deepcopy(settings)
    if not runtime.cuda and config_settings.model.position_embedding_type == "rope":
        config_settings.model.position_embedding_type = "none"
    config = transformer_config(config_settings, runtime)
    config.perform_initialization = False
    return config


def build_model(settings: RunSettings, config, vocab_size: int, vp_stage: int | None = None):
    """This pipeline stage's GPTModel (its virtual-pipeline chunk ``vp_stage``, if any), with
    one token mixer per layer from the pattern."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    block = block_spec(config, ext=settings.ext, vp_stage=vp_stage)
    mtp = None
    if config.mtp_num_layers:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        from megatron_ext.specs import mtp_layer_block, uses_te

        mtp = get_gpt_mtp_block_spec(config, mtp_layer_block(config, settings.ext),
                                     use_transformer_engine=uses_te(settings.ext),
                                     vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=block,
        mtp_block_spec=mtp,
        vocab_size=vocab_size,
        max_sequence_length=settings.model.seq_length,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        position_embedding_type=settings.model.position_embedding_type,
        rotary_base=settings.model.rotary_base,
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
    )
    m = settings.model
    if m.rope_scaling != "none":
        from megatron_ext.rope import apply_rope_scaling

        apply_rope_scaling(model, config, m.rope_scaling, m.rope_scaling_factor,
                           m.rope_original_length or m.seq_length, m.rotary_base)
    if settings.ext.dsa_stage == "dense_warmup":
        from megatron_ext.mixers.dsa import freeze_all_but_indexers

        freeze_all_but_indexers(model)
    return model


# ---------------------------------------------------------------------------- data
def _padded_vocab(vocab_size: int, tp: int) -> int:
    multiple = 128 * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def data_dir(settings: RunSettings, run_dir: pathlib.Path) -> pathlib.Path:
    """Where a run's tokenizer and indexed dataset are (``data.output_dir``, or next to the run
    directory: ``../data/stdlib`` or ``../data/custom``)."""
    d = settings.data
    if d.output_dir:
        return pathlib.Path(d.output_dir)
    return run_dir.parent / "data" / ("stdlib" if d.inputs is None else "custom")


def prepared_data(settings: RunSettings, run_dir: pathlib.Path, rank: int):
    """The run's tokenizer and indexed dataset, built once by rank 0 (the others wait)."""
    from megatron_ext import data

    d = settings.data
    out_dir = data_dir(settings, run_dir)
    if rank == 0:
        data.prepare_data(inputs=d.inputs, output_dir=out_dir, vocab_size=d.vocab_size)
    dist.barrier()
    return data.load_prepared(out_dir)


def prepare_datasets(settings: RunSettings, run_dir: pathlib.Path, runtime: Runtime):
    """Tokenizer + indexed dataset and Megatron's train/valid datasets."""
    from megatron_ext import data

    t = settings.train
    if settings.data.paths:
        raise ConfigError("data.paths (Megatron's indexed datasets) are read by `megatron-ext "
                          "pretrain`; `megatron-ext train` tokenizes data.inputs itself")
    prepared = prepared_data(settings, run_dir, runtime.rank)
    train_samples = t.steps * t.global_batch_size
    valid_samples = max(1, t.eval_batches * t.global_batch_size * (t.steps // t.eval_interval + 1))
    train, valid = data.build_gpt_datasets(
        prepared.data_prefix, prepared.tokenizer, settings.model.seq_length,
        train_samples, valid_samples, t.seed)
    return prepared.tokenizer, train, valid


def _batches(dataset, step: int, settings: RunSettings, dp_rank: int, dp_size: int, device):
    """The micro-batches of this data-parallel rank for global step ``step`` (deterministic)."""
    t = settings.train
    per_rank = t.global_batch_size // dp_size
    start = step * t.global_batch_size + dp_rank * per_rank
    for first in range(start, start + per_rank, t.micro_batch_size):
        samples = [dataset[(first + i) % len(dataset)] for i in range(t.micro_batch_size)]
        batch = {key: torch.stack([torch.as_tensor(s[key]) for s in samples]).to(device)
                 for key in ("tokens", "labels", "loss_mask", "position_ids")}
        yield batch


def _lm_loss(per_token_loss, loss_mask):
    mask = loss_mask.float()
    return (per_token_loss.float() * mask).sum() / mask.sum().clamp(min=1)


# ---------------------------------------------------------------------------- optimizer
def build_optimizer(model, settings: RunSettings, runtime: Runtime):
    """Megatron's optimizer (with DDP around the model) on CUDA; torch AdamW on a CPU."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    t = settings.train
    if runtime.cuda:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.distributed.finalize_model_grads import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        from megatron_ext.multi_tensor import use_foreach_multi_tensor_ops

        use_foreach_multi_tensor_ops()  # where megatron-core would loop over the parameters
        model = DistributedDataParallel(
            config=model.config, module=model,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True))
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr,
                            weight_decay=t.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                            clip_grad=t.clip_grad, bf16=model.config.bf16,
                            params_dtype=model.config.params_dtype),
            [model])
        model.config.finalize_model_grads_func = finalize_model_grads
        model.config.no_sync_func = model.no_sync
        model.config.grad_scale_func = optimizer.scale_loss
    else:
        no_decay = [p for n, p in model.named_parameters() if p.ndim < 2 or n.endswith(".bias")]
        decay = [p for n, p in model.named_parameters() if not (p.ndim < 2 or n.endswith(".bias"))]
        optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "wd_mult": 0.0}],
            lr=t.lr, betas=(0.9, 0.95), weight_decay=t.weight_decay)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr, lr_warmup_steps=t.warmup_steps,
        lr_decay_steps=t.steps, lr_decay_style=t.decay_style, start_wd=t.weight_decay,
        end_wd=t.weight_decay, wd_incr_steps=t.steps, wd_incr_style="constant",
        wsd_decay_steps=t.wsd_decay_steps, lr_wsd_decay_style=t.wsd_decay_style)
    return model, optimizer, scheduler


# ---------------------------------------------------------------------------- steps
def _forward_backward(model, batches, settings, runtime, forward_only: bool) -> float:
    """Mean LM loss over this rank's micro-batches; gradients accumulated unless forward_only."""
    batches = list(batches)
    if runtime.cuda:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(iterator, chunk):
            b = next(iterator)
            out = chunk(b["tokens"], b["position_ids"], None, labels=b["labels"])

            def loss_func(per_token_loss):
                loss = _lm_loss(per_token_loss, b["loss_mask"])
                # A copy: the schedule divides the returned loss in place by the number of
                # micro-batches, which would also change a detached view.
                return loss, {"lm loss": loss.detach().clone()}

            return out, loss_func

        reduced = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=settings.model.seq_length,
            micro_batch_size=settings.train.micro_batch_size, forward_only=forward_only)
        from megatron.core import parallel_state

        if not parallel_state.is_pipeline_last_stage():
            return float("nan")
        return float(torch.stack([r["lm loss"] for r in reduced]).mean())
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from megatron_ext.mixers.dsa import IndexerLoss

    # Megatron's schedule sets these on CUDA; here each micro-batch's LM loss is divided by N.
    IndexerLoss.set_loss_scale(torch.tensor(1.0 / len(batches)))
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0 / len(batches)))
    total = 0.0
    for b in batches:
        with torch.set_grad_enabled(not forward_only):
            loss = _lm_loss(model(b["tokens"], b["position_ids"], None, labels=b["labels"]),
                            b["loss_mask"])
            if not forward_only:
                (loss / len(batches)).backward()
        total += float(loss.detach())
    return total / len(batches)


def _mean_over_ranks(value: float, runtime: Runtime) -> float:
    """Average a loss over the ranks that computed one (NaN elsewhere: earlier PP stages)."""
    if runtime.world_size == 1:
        return value
    t = torch.tensor([0.0 if math.isnan(value) else value, 0.0 if math.isnan(value) else 1.0],
                     device=runtime.device)
    dist.all_reduce(t)
    return float(t[0] / t[1].clamp(min=1))


def _train_step(model, optimizer, scheduler, batches, settings, runtime) -> tuple[float, float]:
    """One optimizer step over a global batch: (mean LM loss, grad norm)."""
    if runtime.cuda:
        model.zero_grad_buffer()
        optimizer.zero_grad()
        loss = _forward_backward(model, batches, settings, runtime, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        if ok:
            scheduler.step(increment=1)
        return loss, float(grad_norm or 0.0)
    optimizer.zero_grad(set_to_none=True)
    loss = _forward_backward(model, batches, settings, runtime, forward_only=False)
    # All CPU ranks are TP ranks of one replica (see _check_cpu_layout): without data
    # parallelism no gradient needs a reduction, and without sequence parallelism the
    # replicated parameters (norms) already hold identical gradients on every TP rank, so each
    # rank steps its own AdamW on its own shard and the ranks stay consistent.
    grad_norm = _clip_grad_norm(model, settings.train.clip_grad)
    optimizer.step()
    scheduler.step(increment=1)
    if model.config.moe_router_enable_expert_bias:  # on CUDA finalize_model_grads does it
        from megatron.core.distributed.finalize_model_grads import (
            _update_router_expert_bias,
            reset_model_temporary_tensors,
        )

        _update_router_expert_bias([model], model.config)
        reset_model_temporary_tensors(model.config, [model])  # the step's expert loads
    return loss, float(grad_norm)


def _clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Clip the gradients by the norm of the WHOLE model's gradient; returns that norm.

    As in megatron-core's ``clip_grads``: the squares of TP-sharded parameters
    (``param.tensor_model_parallel``) are summed over the TP group, replicated parameters
    are counted once (on TP rank 0, ``param_is_not_tensor_parallel_duplicate``), so a TP=2
    run clips exactly like a TP=1 run of the same model. The coefficient is the one of
    ``torch.nn.utils.clip_grad_norm_``.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    params = [p for p in model.parameters() if p.grad is not None]
    counted = [p.grad.detach().float() for p in params
               if param_is_not_tensor_parallel_duplicate(p)]
    square = (torch.stack([torch.linalg.vector_norm(g) for g in counted]).square().sum()
              if counted else torch.zeros(()))
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(square, group=parallel_state.get_tensor_model_parallel_group())
    norm = square.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm


# ---------------------------------------------------------------------------- checkpoints
def _unwrapped(model):
    return model.module if hasattr(model, "module") else model


def save_checkpoint(run_dir: pathlib.Path, step: int, model, optimizer, scheduler, runtime):
    """Model, optimizer, scheduler and RNG state of ``step``.

    On CUDA the model goes into a Megatron dist checkpoint (reshardable across TP/PP).
    megatron-core's dist-checkpoint writer calls ``torch.cuda.synchronize()`` unconditionally,
    so on a CPU the model is a plain state dict: ``model/model.pt`` for one process (the same
    keys a TP=PP=1 GPU run loads), ``model/model_rankNNNNN.pt`` (this rank's TP shard) for
    several; such a checkpoint resumes only with the same TP size. Written to a temporary folder and renamed, so a
    run killed mid-save keeps its last complete checkpoint; ``latest`` is updated last.
    """
    from megatron.core import dist_checkpointing

    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"iter_{step:07d}"
    tmp = ckpt_root / f".tmp_iter_{step:07d}"
    if runtime.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "model").mkdir(parents=True)
    dist.barrier()
    if runtime.cuda:
        dist_checkpointing.save(_unwrapped(model).sharded_state_dict(), str(tmp / "model"))
    else:
        torch.save(_unwrapped(model).state_dict(), tmp / "model" / _plain_model_file(runtime))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                "step": step, "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state() if runtime.cuda else None},
               tmp / f"state_rank{runtime.rank:05d}.pt")
    dist.barrier()
    if runtime.rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        (ckpt_root / "latest").write_text(f"{step}\n")
    dist.barrier()


def _plain_model_file(runtime: Runtime) -> str:
    """This rank's model file in a CPU checkpoint (model.pt for a single process)."""
    return "model.pt" if runtime.world_size == 1 else f"model_rank{runtime.rank:05d}.pt"


def load_checkpoint(run_dir: pathlib.Path, model, optimizer, scheduler, runtime) -> int:
    """Restore the newest checkpoint; returns its step (0 when there is none)."""
    from megatron.core import dist_checkpointing

    latest = run_dir / "checkpoints" / "latest"
    if not latest.exists():
        return 0
    step = int(latest.read_text())
    folder = run_dir / "checkpoints" / f"iter_{step:07d}"
    inner = _unwrapped(model)
    plain = folder / "model" / _plain_model_file(runtime)
    if plain.exists():
        inner.load_state_dict(torch.load(plain, map_location=runtime.device, weights_only=True))
    elif any((folder / "model").glob("model*.pt")):
        found = sorted(f.name for f in (folder / "model").glob("model*.pt"))
        raise ConfigError(
            f"{folder / 'model'} holds a CPU checkpoint of another world size ({found}), not "
            f"{plain.name} for rank {runtime.rank} of {runtime.world_size}: resume with the "
            "same number of processes (parallel.tensor) as the run that saved it")
    else:
        inner.load_state_dict(dist_checkpointing.load(inner.sharded_state_dict(),
                                                      str(folder / "model")))
    state = torch.load(folder / f"state_rank{runtime.rank:05d}.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    if runtime.cuda and state["cuda_rng"] is not None:
        torch.cuda.set_rng_state(state["cuda_rng"])
    return step


# ---------------------------------------------------------------------------- outputs
def _log(run_dir: pathlib.Path, record: dict):
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


def write_loss_curve(run_dir: pathlib.Path) -> pathlib.Path:
    """loss_curve.json (train/valid points) and loss_curve.png from metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    train = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    valid = {r["step"]: r["loss"] for r in records if r["kind"] == "valid"}
    curve = {"train": sorted(train.items()), "valid": sorted(valid.items())}
    (run_dir / "loss_curve.json").write_text(json.dumps(curve, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4))
    if curve["train"]:
        ax.plot(*zip(*curve["train"]), label="train")
    if curve["valid"]:
        ax.plot(*zip(*curve["valid"]), "o-", label="valid")
    ax.set_xlabel("step")
    ax.set_ylabel("LM loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = run_dir / "loss_curve.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


# ---------------------------------------------------------------------------- main loop
PREEMPTED_EXIT_CODE = 85
"""Exit status of a run stopped by SIGUSR1 / SIGTERM after saving its checkpoint: a Slurm job
script seeing it requeues the job, which resumes from that checkpoint."""


class StopRequest:
    """SIGUSR1 (Slurm's warning before the time limit) or SIGTERM asks the run to stop.

    Checked once per step; every rank takes the same decision (one all-reduce), so that all of
    them save the same step and leave together.
    """

    SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

    def __init__(self):
        self.requested = False
        self._previous = {}

    def __enter__(self):
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._request)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _request(self, signum, frame):
        self.requested = True

    def agreed(self, runtime: Runtime) -> bool:
        if runtime.world_size == 1:
            return self.requested
        flag = torch.tensor([float(self.requested)], device=runtime.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def train(settings: RunSettings, run_dir: str | os.PathLike, resume: bool = False,
          device: str = "auto", max_steps: int | None = None) -> dict:
    """Train (or resume) a run; returns a summary with the first and last losses.

    ``max_steps`` stops early (after saving) without changing the schedule; so does SIGUSR1 /
    SIGTERM (``summary["preempted"]``; the CLI then exits with :data:`PREEMPTED_EXIT_CODE`).
    A later ``resume=True`` call continues the same curve.
    """
    from tqdm import tqdm

    settings.validate()
    run_dir = pathlib.Path(run_dir)
    if (run_dir / "checkpoints" / "latest").exists() and not resume:
        raise ConfigError(f"{run_dir} already holds a run; pass --resume to continue it, or "
                          "choose another --run-dir")
    runtime = init_runtime(settings, device)
    if runtime.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(settings.to_dict(), sort_keys=False))
    t = settings.train
    from megatron.core import parallel_state

    dp_size = parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    if t.global_batch_size % (t.micro_batch_size * dp_size):
        raise ConfigError(
            f"global_batch_size={t.global_batch_size} must be a multiple of micro_batch_size "
            f"({t.micro_batch_size}) x data-parallel size ({dp_size})")

    tokenizer, train_set, valid_set = prepare_datasets(settings, run_dir, runtime)
    config = transformer_config(settings, runtime)
    model = build_model(settings, config, _padded_vocab(tokenizer.vocab_size,
                                                        settings.parallel.tensor))
    model.to(runtime.device)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer, scheduler = build_optimizer(model, settings, runtime)
    start = load_checkpoint(run_dir, model, optimizer, scheduler, runtime) if resume else 0
    end = t.steps if max_steps is None else min(t.steps, max_steps)
    is_main = runtime.rank == 0
    if is_main:
        print(f"megatron-ext train: {settings.ext.pattern!r} x {config.num_layers} layers, "
              f"{n_params / 1e6:.2f}M params on rank 0, device {runtime.device}, "
              f"world {runtime.world_size}; steps {start} -> {end} of {t.steps}", flush=True)

    tokens_per_step = t.global_batch_size * settings.model.seq_length
    bar = tqdm(range(start, end), initial=start, total=t.steps, disable=not is_main,
               dynamic_ncols=True, desc="train")
    first_loss = last_loss = None

    def _run_step(step: int) -> int:
        """One optimizer step, then logging, evaluation and checkpoints; returns steps done."""
        nonlocal first_loss, last_loss
        model.train()
        begin = time.perf_counter()
        batches = _batches(train_set, step, settings, dp_rank, dp_size, runtime.device)
        loss, grad_norm = _train_step(model, optimizer, scheduler, batches, settings, runtime)
        loss = _mean_over_ranks(loss, runtime)
        elapsed = time.perf_counter() - begin
        first_loss = loss if first_loss is None else first_loss
        last_loss = loss
        done = step + 1
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_step / elapsed:,.0f}")
        if is_main and (done % t.log_interval == 0 or done == start + 1):
            _log(run_dir, {"kind": "train", "step": done, "loss": loss, "grad_norm": grad_norm,
                           "lr": scheduler.get_lr(optimizer.param_groups[0]),
                           "tokens_per_s": tokens_per_step / elapsed})
        if done % t.eval_interval == 0 or done == t.steps:
            model.eval()
            valid = sum(_forward_backward(
                model, _batches(valid_set, i, settings, dp_rank, dp_size, runtime.device),
                settings, runtime, forward_only=True) for i in range(t.eval_batches))
            valid = _mean_over_ranks(valid / t.eval_batches, runtime)
            if is_main:
                _log(run_dir, {"kind": "valid", "step": done, "loss": valid})
                bar.write(f"step {done}: train loss {loss:.4f}, valid loss {valid:.4f}")
        if done % t.save_interval == 0 or done == end:
            save_checkpoint(run_dir, done, model, optimizer, scheduler, runtime)
        return done

    preempted = False
    with StopRequest() as stop:
        for step in bar:
            done = _run_step(step)
            if stop.agreed(runtime) and done < end:
                if done % t.save_interval:
                    save_checkpoint(run_dir, done, model, optimizer, scheduler, runtime)
                if is_main:
                    bar.write(f"stop requested: checkpoint saved at step {done}; resume with "
                              "--resume")
                preempted, end = True, done
                break
    bar.close()
    summary = {"start_step": start, "end_step": end, "first_loss": first_loss,
               "last_loss": last_loss, "params": n_params, "run_dir": str(run_dir),
               "preempted": preempted}
    if is_main and end == t.steps and not preempted:
        summary["loss_curve"] = str(write_loss_curve(run_dir))
        if first_loss is None:  # resumed at the last step: nothing left to train
            print(f"done: the run in {run_dir} had finished all {t.steps} steps; curve in "
                  f"{summary['loss_curve']}", flush=True)
        else:
            print(f"done: loss {first_loss:.3f} (step {start + 1}) -> {last_loss:.3f} (step "
                  f"{end}); curve in {summary['loss_curve']}", flush=True)
    return summary
