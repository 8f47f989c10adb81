"""``megatron-ext pretrain``: a preset becomes Megatron flags that Megatron's own parser accepts,
and the model Megatron's builder makes from them is the preset's model. (The training loop
itself needs CUDA; benchmarks/pretrain_run.py runs it on a GPU, its H200 run in
benchmarks/results/pretrain_run_h200.json.)"""

import importlib.machinery
import signal

import pytest
import torch

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.launch import presets
from megatron_ext.pretrain import check_cuda_graph, megatron_argv, pretrain


def _parse(argv, monkeypatch, world_size=1):
    """Megatron's parsing and validation, without its global side effects (global args,
    tokenizer, signal handler) that ``parse_and_validate_args`` adds."""
    from megatron.training.arguments import parse_args, validate_args

    from megatron_ext.config import add_megatron_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr("sys.argv", ["pretrain", *argv])
    args = parse_args(add_megatron_args)
    validate_args(args, {})
    return args


@pytest.mark.parametrize("name", presets.list_presets())
def test_preset_flags_parse_as_the_preset(name, monkeypatch, tmp_path):
    settings = presets.load_settings(name)
    p = settings.parallel
    args = _parse(megatron_argv(settings, tmp_path, mock_data=True), monkeypatch,
                  world_size=p.tensor * p.pipeline)
    m, t = settings.model, settings.train
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.seq_length) == (
        m.num_layers, m.hidden_size, m.ffn_hidden_size, m.seq_length)
    assert args.num_query_groups == (m.num_query_groups or m.num_attention_heads)
    assert (args.global_batch_size, args.train_iters, args.lr, args.lr_decay_style) == (
        t.global_batch_size, t.steps, t.lr, t.decay_style)
    assert args.spec == ["megatron_ext.specs", "hybrid_block"]
    assert args.save == args.load == str(tmp_path / "checkpoints")
    assert args.exit_signal_handler and args.exit_signal == signal.SIGUSR1
    # RoPE fused (megatron_ext.rope.provide_fused_rope fills Megatron's slot in pretrain).
    assert args.apply_rope_fusion == (m.position_embedding_type == "rope")
    assert ExtConfig.from_megatron_args(args) == settings.ext


def test_flags_after_the_preset_win(monkeypatch, tmp_path):
    settings = presets.load_settings("tiny-hybrid")
    argv = megatron_argv(settings, tmp_path, mock_data=True) + ["--lr", "1e-3",
                                                                 "--ext-pattern", "G*GG"]
    args = _parse(argv, monkeypatch)
    assert args.lr == 1e-3
    assert ExtConfig.from_megatron_args(args).pattern == "G*GG"


@pytest.mark.parametrize("model", [{}, {"num_moe_experts": 4, "moe_router_enable_expert_bias": True,
                                        "mtp_num_layers": 1}], ids=["preset", "moe-bias-mtp"])
def test_megatron_builder_makes_the_preset_model(model, monkeypatch, tmp_path,
                                                 megatron_single_process):
    """gpt_config_from_args + GPTModelBuilder (what pretrain does) build the same model, with the
    same number of parameters, as `megatron-ext train` builds from the preset (also with MoE
    layers balanced by expert bias and an MTP layer)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import global_vars
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_ext.train import Runtime, _padded_vocab, build_model, transformer_config

    settings = presets.load_settings("tiny-hybrid")
    settings.train.bf16 = False
    for name, value in model.items():
        setattr(settings.model, name, value)
    args = _parse(megatron_argv(settings, tmp_path, mock_data=True) + ["--use-cpu-initialization"],
                  monkeypatch)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)  # where hybrid_block reads --ext-*
    model_config = gpt_config_from_args(args)
    vocab_size = _padded_vocab(settings.data.vocab_size, 1)
    model_config.vocab_size = vocab_size
    built = GPTModelBuilder(model_config).build_model(ProcessGroupCollection.use_mpu_process_groups())
    mixers = [type(layer.self_attention).__name__ for layer in built.decoder.layers]

    ours = build_model(settings, transformer_config(settings, Runtime(torch.device("cpu"), 0, 1)),
                       vocab_size)
    assert mixers == [type(layer.self_attention).__name__ for layer in ours.decoder.layers]
    assert mixers.count("SelfAttention") == settings.ext.pattern.count("*")
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in ours.parameters())
    for m in (built, ours):
        assert (m.mtp_process and len(m.mtp.layers)) == (model.get("mtp_num_layers") or False)
        biased = [r for r in m.modules() if getattr(r, "expert_bias", None) is not None]
        assert len(biased) == (5 if model else 0)  # 4 decoder MoE layers and the MTP layer's


def test_pretrain_without_cuda_says_what_to_use(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU message")
    with pytest.raises(ConfigError, match="megatron-ext train"):
        pretrain(presets.load_settings("tiny-hybrid"), tmp_path, mock_data=True)


def test_rearm_restores_the_exit_signal_after_a_native_library_replaced_it(monkeypatch):
    """What the H200 showed: a native library set its own SIGUSR1 action behind Python's back,
    so Megatron's handler never ran. Simulated with libc's signal(); the re-arm done at every
    forward step makes SIGUSR1 reach Megatron's handler again."""
    import ctypes
    import os

    from megatron.training import global_vars
    from megatron.training.dist_signal_handler import DistributedSignalHandler

    from megatron_ext.pretrain import _rearm_exit_signal

    previous = signal.getsignal(signal.SIGUSR1)
    handler = DistributedSignalHandler(signal.SIGUSR1).__enter__()
    monkeypatch.setattr(global_vars, "_GLOBAL_SIGNAL_HANDLER", handler)
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    try:
        libc.signal(signal.SIGUSR1, 1)  # SIG_IGN, unknown to Python's signal module
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler._signal_received is False  # lost, as on the H200
        _rearm_exit_signal()
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler._signal_received is True
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_a_run_stopped_before_its_last_iteration_is_preempted(tmp_path):
    from types import SimpleNamespace

    from megatron_ext.pretrain import _stopped_early

    args = SimpleNamespace(save=str(tmp_path), train_iters=250)
    assert not _stopped_early(args)  # no checkpoint: a failure, not a preemption
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("125")
    assert _stopped_early(args)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("250")
    assert not _stopped_early(args)


def test_megatron_builder_freezes_all_but_the_indexers_in_dsa_dense_warmup(
        monkeypatch, tmp_path, megatron_single_process):
    """DSA's dense warm-up through Megatron's builder: hybrid_block installs the freeze as a
    pre-wrap hook and the indexer loss's scale hook on the model config."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training import global_vars
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import GPTModelBuilder

    from megatron_ext.mixers.dsa import IndexerLoss
    from megatron_ext.train import _padded_vocab

    settings = presets.load_settings("tiny-hybrid")
    settings.train.bf16 = False
    settings.ext.pattern = "D*" * (settings.model.num_layers // 2)
    settings.ext.dsa_stage = "dense_warmup"
    args = _parse(megatron_argv(settings, tmp_path, mock_data=True) + ["--use-cpu-initialization"],
                  monkeypatch)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    model_config = gpt_config_from_args(args)
    model_config.vocab_size = _padded_vocab(settings.data.vocab_size, 1)
    chunks = GPTModelBuilder(model_config).build_distributed_models(
        ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False)
    trained = [name for name, p in chunks[0].named_parameters() if p.requires_grad]
    assert len(trained) == 5 * settings.ext.pattern.count("D")
    assert all(".indexer." in name for name in trained)
    assert model_config.experimental_attention_variant_loss_scale_func is (
        IndexerLoss.set_loss_scale)


def test_every_rank_calls_the_datasets_provider(tmp_path):
    """Megatron calls the datasets provider on every rank only when the provider says
    ``is_distributed`` (megatron.training.training.build_train_valid_test_data_loaders), else
    on tensor-parallel rank 0 alone; ours holds collectives over all ranks (the dataset
    builder's barrier), so without the flag TP > 1 hangs before its first iteration (seen on 2
    H200s)."""
    import inspect

    from megatron.training import training

    from megatron_ext.pretrain import _datasets_provider

    rule = inspect.getsource(training.build_train_valid_test_data_loaders)
    assert 'getattr(build_train_valid_test_datasets_provider, "is_distributed", False)' in rule
    provider = _datasets_provider(presets.load_settings("tiny-hybrid"), tmp_path)
    assert provider.is_distributed is True


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """Two indexed datasets tokenized by one sentencepiece model: the first trains it on its
    corpus, the second is `prepare-data --tokenizer-model` with that existing model."""
    import sysconfig
    from pathlib import Path

    from megatron_ext import data

    root = tmp_path_factory.mktemp("blend")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    first = data.prepare_data(stdlib / "json", output_dir=root / "a", vocab_size=512)
    second = data.prepare_data(stdlib / "email", output_dir=root / "b",
                               tokenizer_model=first.tokenizer_model)
    assert second.meta["settings"]["tokenizer_model"]["path"] == str(first.tokenizer_model)
    assert second.tokenizer_model.read_bytes() == first.tokenizer_model.read_bytes()
    return first, second


def test_a_blend_of_indexed_datasets_with_an_existing_tokenizer(
        two_datasets, monkeypatch, tmp_path, megatron_single_process):
    """data.paths and the tokenizer in the preset become Megatron's --data-path, --split and
    tokenizer flags, and the datasets provider builds Megatron's GPT datasets over that blend
    with Megatron's SentencePieceTokenizer (not mock data, not the preset's corpus)."""
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.training import global_vars

    from megatron_ext.pretrain import _datasets_provider

    first, second = two_datasets
    settings = presets.load_settings("tiny-hybrid")
    settings.data.paths = ["0.7", str(first.data_prefix), "0.3", str(second.data_prefix)]
    settings.data.split = "90,10,0"
    settings.data.tokenizer_type = "SentencePieceTokenizer"
    settings.data.tokenizer_model = str(first.tokenizer_model)
    argv = megatron_argv(settings, tmp_path, mock_data=False)
    assert argv[argv.index("--data-path") + 1:argv.index("--data-path") + 5] == settings.data.paths
    assert "NullTokenizer" not in argv
    args = _parse(argv, monkeypatch)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", global_vars.build_tokenizer(args))
    train, valid, test = _datasets_provider(settings, tmp_path)([64, 8, 0])
    assert isinstance(train, BlendedDataset) and len(train.datasets) == 2
    assert [d.dataset.path_prefix for d in train.datasets] == [
        str(first.data_prefix), str(second.data_prefix)]
    assert train.weights == pytest.approx([0.7, 0.3]) and len(train) >= 64 and test is None
    sample = train[0]["tokens"]
    assert sample.shape == (settings.model.seq_length,) and int(sample.max()) < 512


def test_large_presets_refuse_the_stdlib_corpus_unless_asked():
    from megatron_ext.pretrain import check_data_source

    settings = presets.load_settings("hybrid-350m")
    with pytest.raises(ConfigError, match="306M-parameter model would train on the Python "
                                          "standard library"):
        check_data_source(settings, mock_data=False, megatron_args=["--lr", "1e-4"])
    check_data_source(settings, mock_data=True)
    check_data_source(settings, mock_data=False, megatron_args=["--data-path", "/d/x"])
    check_data_source(settings, mock_data=False, megatron_args=["--train-data-path=/d/x"])
    settings.data.inputs = ["corpus/"]
    check_data_source(settings, mock_data=False)
    check_data_source(presets.load_settings("tiny-hybrid"), mock_data=False)  # 5M: a smoke test


def test_parallel_and_logging_sections_become_megatron_flags(monkeypatch, tmp_path):
    """parallel.context / pipeline / virtual_pipeline / recompute / distributed_optimizer (on by
    default when there is more than one data-parallel rank) and logging.wandb_project parse as Megatron's
    settings; TensorBoard only where the tensorboard package imports."""
    import importlib.util

    settings = presets.load_settings("hybrid-350m")
    p = settings.parallel
    p.context = 2
    argv = megatron_argv(settings, tmp_path, mock_data=True)
    assert argv[argv.index("--context-parallel-size") + 1] == "2"
    # (Megatron's validation of CP > 1 asks the CUDA device for its architecture.)
    p.pipeline, p.context, p.virtual_pipeline, p.recompute = 2, 1, 2, "full"
    settings.logging.wandb_project = "hybrids"
    monkeypatch.setenv("WORLD_SIZE", "4")  # 2 pipeline x 2 data-parallel
    args = _parse(megatron_argv(settings, tmp_path / "run", mock_data=True), monkeypatch,
                  world_size=4)
    assert args.pipeline_model_parallel_size == 2
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.use_distributed_optimizer
    assert (args.recompute_granularity, args.recompute_method) == ("full", "uniform")
    assert (args.wandb_project, args.wandb_exp_name) == ("hybrids", "run")
    has_tensorboard = importlib.util.find_spec("tensorboard") is not None
    assert args.tensorboard_dir == (str(tmp_path / "run" / "tensorboard") if has_tensorboard
                                    else None)

    monkeypatch.setenv("WORLD_SIZE", "2")  # one data-parallel rank: no distributed optimizer
    assert "--use-distributed-optimizer" not in megatron_argv(settings, tmp_path, mock_data=True)
    settings.parallel.distributed_optimizer = True
    assert "--use-distributed-optimizer" in megatron_argv(settings, tmp_path, mock_data=True)
    settings.parallel.recompute = "most"
    with pytest.raises(ConfigError, match="parallel.recompute='most'"):
        settings.validate()


def test_cuda_graph_setting_becomes_megatrons_full_iteration_graph(monkeypatch, tmp_path):
    """train.cuda_graph (on in the 350M-3B presets) asks Megatron for one CUDA graph per
    iteration, which needs its NaN check off; layouts no test captures are refused."""
    settings = presets.load_settings("hybrid-350m")
    assert settings.train.cuda_graph
    args = _parse(megatron_argv(settings, tmp_path, mock_data=True), monkeypatch)
    assert args.cuda_graph_impl == "full_iteration" and not args.check_for_nan_in_loss_and_grad
    check_cuda_graph(args)
    settings.parallel.pipeline = 2
    args = _parse(megatron_argv(settings, tmp_path, mock_data=True), monkeypatch, world_size=2)
    with pytest.raises(ConfigError, match="not verified with pipeline parallelism"):
        check_cuda_graph(args)
    check_cuda_graph(_parse(megatron_argv(settings, tmp_path, mock_data=True)
                            + ["--cuda-graph-impl", "none"], monkeypatch, world_size=2))
    tiny = presets.load_settings("tiny-hybrid")
    assert not tiny.train.cuda_graph
    assert _parse(megatron_argv(tiny, tmp_path, mock_data=True),
                  monkeypatch).cuda_graph_impl == "none"


def test_transformer_engine_only_when_asked(monkeypatch, tmp_path):
    """"auto" stays on the tested SDPA path even where TE imports; "te" without TE names the
    fix; without apex's weight-gradient kernel the fusion that needs it is off."""
    from megatron_ext import specs

    monkeypatch.setattr(specs, "HAVE_TE", True)
    assert not specs.uses_te(ExtConfig(attention_backend="auto"))
    assert specs.uses_te(ExtConfig(attention_backend="te"))
    monkeypatch.setattr(specs, "HAVE_TE", False)
    with pytest.raises(ConfigError, match="install megatron-ext\\[te\\]"):
        specs.uses_te(ExtConfig(attention_backend="te"))
    argv = megatron_argv(presets.load_settings("tiny-hybrid"), tmp_path, mock_data=True)
    assert "--no-gradient-accumulation-fusion" in argv  # no apex here


def test_gradient_accumulation_fusion_is_not_provided_without_cuda(monkeypatch, tmp_path):
    """megatron_ext.wgrad registers its weight-gradient GEMM only on a GPU (addmm's fp32
    out_dtype is CUDA-only); without it pretrain's flags keep the fusion off. Where it is
    registered (a module of apex's name that find_spec sees), the flag is dropped."""
    import sys
    import types

    from megatron_ext import wgrad

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not wgrad.provide_gradient_accumulation_fusion()
    assert wgrad.MODULE not in sys.modules
    module = types.ModuleType(wgrad.MODULE)
    module.__spec__ = importlib.machinery.ModuleSpec(wgrad.MODULE, loader=None)
    monkeypatch.setitem(sys.modules, wgrad.MODULE, module)
    assert wgrad.provide_gradient_accumulation_fusion()
    argv = megatron_argv(presets.load_settings("tiny-hybrid"), tmp_path, mock_data=True)
    assert "--no-gradient-accumulation-fusion" not in argv


def test_an_indexed_dataset_with_a_hugging_face_tokenizer_directory(
        monkeypatch, tmp_path, megatron_single_process):
    """A tokenizer directory saved by transformers (built here offline: a byte-level BPE trained
    on a few stdlib files) serves as Megatron's HuggingFaceTokenizer for data.paths."""
    import sysconfig
    from pathlib import Path

    import numpy
    pytest.importorskip("transformers")
    from megatron.core.datasets.indexed_dataset import (IndexedDatasetBuilder, get_bin_path,
                                                        get_idx_path)
    from megatron.training import global_vars
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.pretrain import _datasets_provider

    texts = [p.read_text() for p in sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))]
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
    hf = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", unk_token="<unk>")
    hf.save_pretrained(tmp_path / "tokenizer")
    prefix = str(tmp_path / "json_text_document")
    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=numpy.uint16)
    for text in texts:
        ids = hf(text)["input_ids"] + [hf.eos_token_id]
        builder.add_document(numpy.asarray(ids, dtype=numpy.uint16), [len(ids)])
    builder.finalize(get_idx_path(prefix))

    settings = presets.load_settings("tiny-hybrid")
    settings.data.paths = [prefix]
    settings.data.split = "50,50,0"  # a handful of documents: each split must get some
    settings.data.tokenizer_type = "HuggingFaceTokenizer"
    settings.data.tokenizer_model = str(tmp_path / "tokenizer")
    args = _parse(megatron_argv(settings, tmp_path, mock_data=False), monkeypatch)
    tokenizer = global_vars.build_tokenizer(args)
    assert tokenizer.tokenize("import json") == hf("import json")["input_ids"]
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    monkeypatch.setattr(global_vars, "_GLOBAL_TOKENIZER", tokenizer)
    train, valid, _ = _datasets_provider(settings, tmp_path)([16, 2, 0])
    assert len(train) >= 16 and int(train[0]["tokens"].max()) < 300
