"""``megatron-ext pretrain``: Megatron's own training loop (``megatron.training.pretrain``) on a
preset, for clusters.

It is what ``pretrain_gpt.py --spec megatron_ext.specs hybrid_block --ext-pattern ... <flags>``
does in a Megatron-LM checkout, without needing one: the preset becomes Megatron's command-line
flags (:func:`megatron_argv`), our ``--ext-*`` flags join Megatron's parser, and the data,
forward step and loss below are the GPT ones. Everything Megatron's loop offers comes with it:
DDP / distributed optimizer, TP / SP / PP / VPP schedules, distributed checkpoints, logging of
loss, throughput and memory, evaluation. Flags after ``--`` go to Megatron as they are and win
over the preset's (``megatron-ext pretrain --preset hybrid-350m -- --use-distributed-optimizer``).

Preemption: Megatron's signal handler listens for SIGUSR1 (which the Slurm job script forwards
before the time limit), and the job script also passes ``--exit-duration-in-mins`` as a backstop;
either way, at the end of the current step every rank saves a checkpoint and the process exits
with :data:`megatron_ext.train.PREEMPTED_EXIT_CODE` (any stop before the last iteration with a
checkpoint saved), so the job script requeues the job. ``--load`` and ``--save`` are the same directory (``RUN_DIR/checkpoints``): a restarted run
continues from the newest checkpoint, a new one starts from step 0.

Megatron's training loop needs CUDA (it allocates on ``"cuda"`` while initialising); on a CPU
use ``megatron-ext train``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import signal
import sys

import torch
import yaml

from megatron_ext.config import ConfigError, ExtConfig, format_overrides
from megatron_ext.train import PREEMPTED_EXIT_CODE, RunSettings, prepared_data

def _ext_flags(ext: ExtConfig) -> list[str]:
    flags = []
    for name, value in ext.to_dict().items():
        if value is None:
            continue
        if name == "pattern" and not isinstance(value, str):
            value = ",".join(value)
        if name == "kernel_overrides":
            if not value:
                continue
            value = format_overrides(value)
        flags += ["--ext-" + name.replace("_", "-"), str(value)]
    return flags


def megatron_argv(settings: RunSettings, run_dir: str | os.PathLike, *, mock_data: bool,
                  transformer_impl: str = "local") -> list[str]:
    """Megatron's command-line flags for a preset (the run's settings), before user overrides."""
    m, t, p = settings.model, settings.train, settings.parallel
    checkpoints = str(pathlib.Path(run_dir) / "checkpoints")
    argv = [
        "--num-layers", m.num_layers, "--hidden-size", m.hidden_size,
        "--ffn-hidden-size", m.ffn_hidden_size or 4 * m.hidden_size,
        "--num-attention-heads", m.num_attention_heads,
        "--seq-length", m.seq_length, "--max-position-embeddings", m.seq_length,
        "--position-embedding-type", m.position_embedding_type, "--rotary-base", int(m.rotary_base),
        "--normalization", m.normalization, "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
        "--hidden-dropout", m.hidden_dropout, "--attention-dropout", m.attention_dropout,
        "--micro-batch-size", t.micro_batch_size, "--global-batch-size", t.global_batch_size,
        "--train-iters", t.steps, "--lr", t.lr, "--min-lr", t.min_lr,
        "--lr-warmup-iters", t.warmup_steps, "--lr-decay-iters", t.steps,
        "--lr-decay-style", t.decay_style,
        "--weight-decay", t.weight_decay, "--clip-grad", t.clip_grad,
        "--adam-beta1", 0.9, "--adam-beta2", 0.95, "--seed", t.seed,
        "--log-interval", t.log_interval, "--eval-interval", t.eval_interval,
        "--eval-iters", t.eval_batches, "--save-interval", t.save_interval,
        "--tensor-model-parallel-size", p.tensor, "--pipeline-model-parallel-size", p.pipeline,
        "--transformer-impl", transformer_impl, "--spec", "megatron_ext.specs", "hybrid_block",
        "--save", checkpoints, "--load", checkpoints,
        "--exit-signal-handler", "--exit-signal", "SIGUSR1",
        "--log-throughput",
    ]
    d = settings.data
    if d.paths:
        argv += ["--data-path", *d.paths, "--split", d.split, "--tokenizer-type", d.tokenizer_type]
        if d.tokenizer_model:
            argv += ["--tokenizer-model", d.tokenizer_model]
    else:  # mock data, or a corpus tokenized by our own sentencepiece model (ids < vocab_size)
        argv += ["--tokenizer-type", "NullTokenizer", "--vocab-size", d.vocab_size]
    if m.num_query_groups:
        argv += ["--group-query-attention", "--num-query-groups", m.num_query_groups]
    if m.num_moe_experts:
        argv += ["--num-experts", m.num_moe_experts, "--moe-router-topk", m.moe_router_topk]
        if m.moe_router_enable_expert_bias:
            argv += ["--moe-router-enable-expert-bias", "--moe-router-score-function", "sigmoid",
                     "--moe-router-bias-update-rate", m.moe_router_bias_update_rate]
    if m.mtp_num_layers:
        argv += ["--mtp-num-layers", m.mtp_num_layers,
                 "--mtp-loss-scaling-factor", m.mtp_loss_scaling_factor]
    if t.decay_style == "WSD":
        argv += ["--lr-wsd-decay-style", t.wsd_decay_style,
                 "--lr-wsd-decay-iters", t.wsd_decay_steps]
    if t.bf16:
        argv.append("--bf16")
    if p.sequence_parallel and p.tensor > 1:
        argv.append("--sequence-parallel")
    argv += _parallel_flags(settings)
    argv += _logging_flags(settings, run_dir)
    # Megatron's fused cross-entropy slot, which pretrain fills with megatron_ext.cross_entropy's
    # kernels (Megatron's torch.compile'd version where they do not run).
    argv += ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "native"]
    # Accumulating weight gradients in the GEMM needs apex's fused_weight_gradient_mlp_cuda, or
    # megatron_ext.wgrad's in its place (pretrain registers it first where it runs).
    if importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None:
        argv.append("--no-gradient-accumulation-fusion")
    if transformer_impl == "local":
        # The fused kernels behind these defaults come from Transformer Engine or apex. (The
        # bias-dropout-add fusion is torch.compile'd instead; it is left off, not shown to help.)
        # RoPE fusion stays on (Megatron's default): megatron_ext.rope.provide_fused_rope fills
        # the fused-RoPE slot that Transformer Engine would.
        argv += ["--no-masked-softmax-fusion", "--no-bias-dropout-fusion",
                 "--no-persist-layer-norm"]
    if t.cuda_graph:
        argv += ["--cuda-graph-impl", "full_iteration", "--no-check-for-nan-in-loss-and-grad"]
    if mock_data:
        argv.append("--mock-data")
    return [str(a) for a in argv] + _ext_flags(settings.ext)


def check_cuda_graph(args) -> None:
    """Megatron's full-iteration CUDA graph replays the first captured iteration's kernels, so
    everything in it must keep its shapes and never wait for the host. It is verified here for
    one pipeline stage and no context parallelism or MoE (our pipeline sends, context-parallel
    exchanges and Megatron's token routing are not captured by any test); refuse the rest."""
    if args.cuda_graph_impl != "full_iteration":
        return
    unverified = [name for name, on in (
        ("pipeline parallelism", args.pipeline_model_parallel_size > 1),
        ("context parallelism", args.context_parallel_size > 1),
        ("MoE", bool(args.num_experts))) if on]
    if unverified:
        raise ConfigError(f"the full-iteration CUDA graph (train.cuda_graph) is not verified with "
                          f"{', '.join(unverified)}: set train.cuda_graph: false in the preset, or "
                          "pass --cuda-graph-impl none after --")


# The Megatron flags that name the training data (any of them: the run has its own data).
DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--data-args-path",
              "--per-split-data-args-path")
# Presets this large refuse the standard-library corpus unless asked (parameters).
SMOKE_TEST_CORPUS_LIMIT = 100e6


def check_data_source(settings: RunSettings, *, mock_data: bool,
                      megatron_args: list[str] | None = None) -> None:
    """Refuse to pretrain a large model on the standard-library corpus by default: a preset of
    at least SMOKE_TEST_CORPUS_LIMIT parameters needs data.paths, data.inputs, a Megatron data
    flag after ``--`` or ``--mock-data``."""
    from megatron_ext.launch.presets import parameter_count

    d = settings.data
    if mock_data or d.paths or d.inputs is not None or any(
            arg.split("=")[0] in DATA_FLAGS for arg in megatron_args or []):
        return
    count = parameter_count(settings)
    if count >= SMOKE_TEST_CORPUS_LIMIT:
        raise ConfigError(
            f"this {count / 1e6:,.0f}M-parameter model would train on the Python standard "
            "library, a smoke-test corpus. Give it data: data.paths and data.tokenizer_type / "
            "data.tokenizer_model in the preset, or `-- --data-path PREFIX ... --tokenizer-type "
            "... --tokenizer-model ...` (Megatron indexed datasets, e.g. from `megatron-ext "
            "prepare-data --tokenizer-model`), or data.inputs (text files tokenized in the job); "
            "or --mock-data to measure speed")


def _parallel_flags(settings: RunSettings) -> list:
    """Context and virtual pipeline parallelism, the distributed optimizer and recompute."""
    p, m = settings.parallel, settings.model
    flags = []
    if p.context > 1:
        flags += ["--context-parallel-size", p.context]
    if p.virtual_pipeline:
        flags += ["--num-layers-per-virtual-pipeline-stage",
                  m.num_layers // (p.pipeline * p.virtual_pipeline)]
    data_parallel = int(os.environ.get("WORLD_SIZE", "1")) // (p.tensor * p.pipeline * p.context)
    if p.distributed_optimizer or (p.distributed_optimizer is None and data_parallel > 1):
        flags.append("--use-distributed-optimizer")
    if p.recompute == "selective":
        flags += ["--recompute-granularity", "selective"]
    elif p.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", 1]
    return flags


def _logging_flags(settings: RunSettings, run_dir) -> list:
    """TensorBoard in RUN_DIR/tensorboard (where tensorboard imports: Megatron's writer needs it),
    Weights & Biases when a project is set."""
    log = settings.logging
    flags = []
    if log.tensorboard and importlib.util.find_spec("tensorboard") is not None:
        flags += ["--tensorboard-dir", str(pathlib.Path(run_dir) / "tensorboard"),
                  "--log-timers-to-tensorboard", "--log-memory-to-tensorboard"]
    if log.wandb_project:
        flags += ["--wandb-project", log.wandb_project,
                  "--wandb-exp-name", log.wandb_exp_name or pathlib.Path(run_dir).name,
                  "--wandb-save-dir", str(pathlib.Path(run_dir) / "wandb")]
    return flags


def _datasets_provider(settings: RunSettings, run_dir: pathlib.Path):
    """Megatron's ``train_valid_test_dataset_provider``: Megatron's GPT datasets over the blend
    that ``--data-path`` / ``--train-data-path`` ... name (with Megatron's tokenizer), mock data,
    or the preset's text corpus (tokenizer and indexed dataset built once by rank 0, as
    ``megatron-ext train`` does)."""
    from megatron.core import parallel_state
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_args, get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    from megatron_ext import data

    def provide(num_samples):
        args = get_args()
        blend, blend_per_split = get_blend_and_blend_per_split(args)
        if blend is not None or blend_per_split is not None:
            config = GPTDatasetConfig(
                random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                blend_per_split=blend_per_split, split=args.split,
                path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
                reset_position_ids=args.reset_position_ids,
                reset_attention_mask=args.reset_attention_mask,
                eod_mask_loss=args.eod_mask_loss, create_attention_mask=False)
            return BlendedMegatronDatasetBuilder(
                GPTDataset, num_samples,
                lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()
        if args.mock_data:
            # No blend: the config switches itself to mock data.
            config = GPTDatasetConfig(
                random_seed=args.seed, sequence_length=args.seq_length,
                tokenizer=get_tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                eod_mask_loss=False, create_attention_mask=False, split="98,2,0")
            return BlendedMegatronDatasetBuilder(
                MockGPTDataset, num_samples,
                lambda: parallel_state.get_tensor_model_parallel_rank() == 0, config).build()
        prepared = prepared_data(settings, run_dir, torch.distributed.get_rank())
        if prepared.tokenizer.vocab_size > args.padded_vocab_size:
            raise ConfigError(
                f"the tokenizer in {prepared.output_dir} has {prepared.tokenizer.vocab_size} "
                f"pieces but the model's vocabulary is {args.padded_vocab_size}; set "
                "data.vocab_size in the preset to the tokenizer's size")
        train, valid = data.build_gpt_datasets(
            prepared.data_prefix, prepared.tokenizer, args.seq_length,
            max(1, num_samples[0]), max(1, num_samples[1]), args.seed)
        return train, valid, None

    # Every rank calls the provider: both paths hold collectives over all ranks (the builder's
    # barrier, prepared_data). Without this flag Megatron calls it on tensor-parallel rank 0
    # only, whose barrier then waits for ranks that never come: TP > 1 hangs before its first
    # iteration. Megatron's pretrain_gpt sets it too; the mock builder still builds on TP rank 0
    # only (is_built_on_rank).
    provide.is_distributed = True
    return provide


_BATCH_KEYS = (("tokens", torch.int64), ("labels", torch.int64),
               ("loss_mask", torch.float32), ("position_ids", torch.int64))


def _batch_on_this_rank(data_iterator) -> dict[str, torch.Tensor]:
    """The micro-batch: read by tensor-parallel rank 0 (the only one with a data loader) and
    broadcast to the other ranks of its TP group; under context parallelism, this rank's two of
    the sequence's ``2 * CP`` chunks (Megatron's load-balanced layout, as its ``pretrain_gpt``)."""
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank
    from megatron.training import get_args

    args = get_args()
    shape = (args.micro_batch_size, args.seq_length)
    if parallel_state.get_tensor_model_parallel_rank() == 0:
        sample = next(data_iterator)
        batch = {key: sample[key].to("cuda", dtype, non_blocking=True) for key, dtype in _BATCH_KEYS}
    else:
        batch = {key: torch.empty(shape, dtype=dtype, device="cuda") for key, dtype in _BATCH_KEYS}
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        for key, _ in _BATCH_KEYS:
            torch.distributed.broadcast(batch[key], parallel_state.get_tensor_model_parallel_src_rank(),
                                        group=parallel_state.get_tensor_model_parallel_group())
    return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                     cp_group=parallel_state.get_context_parallel_group())


def _loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    """Summed LM loss, its token count, and the pair for Megatron's token-weighted logging."""
    mask = loss_mask.view(-1).float()
    total = torch.sum(per_token_loss.view(-1).float() * mask)
    tokens = mask.sum()
    return total, tokens.to(torch.int), {"lm loss": torch.stack([total.detach(), tokens])}


def _rearm_exit_signal() -> None:
    """Make Megatron's exit-signal handler the process's handler again.

    On the H200 machine a native library replaced the process's SIGUSR1 action during CUDA
    initialisation, after Megatron had installed its handler: at the first forward step the
    OS-level handler was no longer Python's, ``signal.getsignal`` still named Megatron's, and a
    SIGUSR1 set no flag, so the run never stopped (``benchmarks/pretrain_run.py --stop-with
    signal`` checks a stop and resume on a GPU).
    ``signal.signal`` registers Python's trampoline again for Megatron's handler; it costs one
    system call, so it is done at every forward step, after anything initialised lazily."""
    from megatron.training import global_vars

    handler = global_vars._GLOBAL_SIGNAL_HANDLER
    if handler is not None:
        signal.signal(handler.sig, signal.getsignal(handler.sig))


def forward_step(data_iterator, model):
    """Megatron's ``forward_step_func`` for a GPT model."""
    _rearm_exit_signal()
    batch = _batch_on_this_rank(data_iterator)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(_loss, batch["loss_mask"])


def _stopped_early(args) -> bool:
    """Whether Megatron left before the last iteration with a checkpoint saved: on the exit
    signal, or at ``--exit-duration-in-mins`` / ``--exit-interval`` (Megatron saves first)."""
    tracker = pathlib.Path(args.save or "") / "latest_checkpointed_iteration.txt"
    try:
        saved = int(tracker.read_text().strip())
    except (OSError, ValueError):
        return False
    return saved < args.train_iters


def _use_shipped_dataset_helpers() -> None:
    """megatron-core wheels ship the dataset index helpers compiled (``helpers_cpp``) but not
    their Makefile, and Megatron's initialisation runs ``make`` in that folder unconditionally and
    exits when it fails. Where the compiled module imports there is nothing to build, so the
    build step is skipped; a source checkout without it still compiles."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return
    from megatron.core.datasets import utils

    utils.compile_helpers = lambda: None


def pretrain(settings: RunSettings, run_dir: str | os.PathLike, *, mock_data: bool = False,
             megatron_args: list[str] | None = None) -> int:
    """Train with Megatron's loop; returns the process exit status: 0, or
    :data:`PREEMPTED_EXIT_CODE` when it stopped early after saving (SIGUSR1,
    ``--exit-duration-in-mins`` or ``--exit-interval``)."""
    if not torch.cuda.is_available():
        raise ConfigError("megatron-ext pretrain runs Megatron's training loop, which needs CUDA "
                          "GPUs; on a CPU use `megatron-ext train`")
    from megatron.core.enums import ModelType
    from megatron.training import pretrain as megatron_pretrain
    from megatron.training.argument_utils import (
        gpt_config_from_args,
        pretrain_cfg_container_from_args,
    )
    from megatron.training.arguments import parse_and_validate_args

    from megatron_ext.config import add_megatron_args
    from megatron_ext.cross_entropy import provide_fused_cross_entropy
    from megatron_ext.multi_tensor import use_foreach_multi_tensor_ops
    from megatron_ext.rope import provide_fused_rope
    from megatron_ext.specs import uses_te
    from megatron_ext.wgrad import provide_gradient_accumulation_fusion

    settings.validate()
    if settings.model.rope_scaling != "none":
        raise ConfigError(
            f"model.rope_scaling={settings.model.rope_scaling!r} is applied by `megatron-ext "
            "train` and the exported model; Megatron's loop builds its own rotary table: give it "
            "Megatron's flags after -- (--rotary-seq-len-interpolation-factor, "
            "--position-embedding-type yarn ...)")
    check_data_source(settings, mock_data=mock_data, megatron_args=megatron_args)
    run_dir = pathlib.Path(run_dir)
    # A lone process (no torchrun, no Slurm task) is rank 0 of 1.
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                        ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"),
                        ("CUDA_DEVICE_MAX_CONNECTIONS", "1")):
        os.environ.setdefault(name, value)
    if os.environ["RANK"] == "0":
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(yaml.safe_dump(settings.to_dict(), sort_keys=False))
    provide_gradient_accumulation_fusion()
    argv = megatron_argv(settings, run_dir, mock_data=mock_data,
                         transformer_impl="transformer_engine" if uses_te(settings.ext) else "local")
    provide_fused_rope()
    provide_fused_cross_entropy()
    sys.argv = ["megatron-ext pretrain", *argv, *(megatron_args or [])]
    args = parse_and_validate_args(extra_args_provider=add_megatron_args)
    check_cuda_graph(args)
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    _use_shipped_dataset_helpers()
    if use_foreach_multi_tensor_ops() and os.environ["RANK"] == "0":
        print("megatron-ext pretrain: gradient clipping and the fp32-to-16-bit parameter copy "
              "run on torch's multi-tensor ops (megatron_ext.multi_tensor; neither apex nor "
              "Transformer Engine provides them here)", flush=True)
    try:
        megatron_pretrain(config, _datasets_provider(settings, run_dir),
                          ModelType.encoder_or_decoder, forward_step)
    except SystemExit as stop:  # Megatron leaves through sys.exit after an exit condition
        if stop.code in (0, None) and _stopped_early(args):
            print("megatron-ext pretrain: stopped before the last iteration after saving a "
                  "checkpoint; run the same command again to resume", flush=True)
            return PREEMPTED_EXIT_CODE
        return stop.code if isinstance(stop.code, int) else 1
    return 0
