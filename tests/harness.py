"""Test-only support for running megatron-core on a CPU over gloo.

megatron-core 0.19 hard-codes CUDA in a few places that a CPU test reaches: ``device="cuda"``
literals (schedules, optimizer, grad buffers), ``torch.cuda.current_device()`` for buffers and
RoPE, the CUDA index of RoPE's per-CP-rank slice, CUDA streams in DDP, and the CUDA RNG tracker.
:func:`use_cpu` redirects those to the CPU for the current process. Nothing in the package imports this module.

:func:`spawn` runs a function in N gloo processes and returns what each returned. With
``MEGATRON_EXT_TEST_DIST=nccl`` in the environment it runs them instead on N GPUs of this host
over NCCL (one GPU per rank, TF32 off, the CUDA RNG tracker): the multi-process tests of
tests/parallel then check the same equalities on GPUs (``python -m pytest -m dist tests/parallel``
on a machine with several GPUs; a world larger than the GPUs skips). Models built by
:func:`build_layout` move to the rank's GPU and take their inputs there. A world whose ranks
have not all finished after ``MEGATRON_EXT_TEST_SPAWN_TIMEOUT`` seconds (default
:data:`SPAWN_TIMEOUT_S`) fails the test: each rank first prints the stacks of its threads to
stderr (where a hung rank waits; pytest shows them under the failure), then all are killed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib.util
import os
import pathlib
import signal
import socket
import sys
import time
import traceback
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Modules whose module-global ``torch`` is swapped for one that maps device="cuda" to the CPU.
_CUDA_LITERAL_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.utils",
    "megatron.core.transformer.utils",
)


class _NoStream:
    def wait_event(self, *a, **k):
        pass

    def wait_stream(self, *a, **k):
        pass

    def synchronize(self):
        pass

    def record_event(self, *a, **k):
        return None


def _torch_on_cpu() -> types.ModuleType:
    shim = types.ModuleType("torch_on_cpu")
    shim.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")})

    def on_cpu(factory):
        def call(*args, device=None, **kwargs):
            if device is not None and str(device).startswith("cuda"):
                device = "cpu"
            return factory(*args, device=device, **kwargs)

        return call

    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like",
                 "empty_like", "ones_like"):
        setattr(shim, name, on_cpu(getattr(torch, name)))
    return shim


_applied = False


def use_cpu() -> None:
    """Make this process's megatron-core run on the CPU (idempotent)."""
    global _applied
    if _applied:
        return
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.nvtx.range = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.nvtx.range_push = lambda *a, **k: None
    torch.cuda.nvtx.range_pop = lambda *a, **k: None
    import importlib

    shim = _torch_on_cpu()
    for name in _CUDA_LITERAL_MODULES:
        importlib.import_module(name).torch = shim

    def pos_emb_on_this_cp_rank(pos_emb, seq_dim, cp_group):
        # Megatron's, whose chunk index is a pinned CUDA tensor: chunks rank and
        # 2 CP - 1 - rank of 2 CP along seq_dim.
        size, rank = cp_group.size(), cp_group.rank()
        index = torch.tensor([rank, 2 * size - 1 - rank], device=pos_emb.device)
        chunks = pos_emb.unflatten(seq_dim, (2 * size, -1)).index_select(seq_dim, index)
        return chunks.flatten(seq_dim, seq_dim + 1)

    # RoPE under CP: every module that imported the name.
    for name in ("rope_utils", "rotary_pos_embedding", "yarn_rotary_pos_embedding"):
        module = importlib.import_module(f"megatron.core.models.common.embeddings.{name}")
        module.get_pos_emb_on_this_cp_rank = pos_emb_on_this_cp_rank
    _applied = True


def load_script(path: pathlib.Path, name: str) -> types.ModuleType:
    """The Python file ``path`` (a benchmark script, not in a package) as module ``name``
    (registered in sys.modules, where dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def dist_backend() -> str:
    """The backend :func:`spawn` uses: ``gloo`` (CPU) unless MEGATRON_EXT_TEST_DIST says nccl."""
    backend = os.environ.get("MEGATRON_EXT_TEST_DIST", "gloo")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"MEGATRON_EXT_TEST_DIST={backend!r}: use gloo or nccl")
    return backend


def on_gpu() -> bool:
    """Whether this process runs its ranks' work on a GPU (an NCCL world)."""
    return dist.is_initialized() and dist.get_backend() == "nccl"


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1) -> None:
    """Megatron process groups on the already-initialised world, and an RNG tracker: on a CPU a
    tracker that does not fork, on a GPU Megatron's CUDA tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import (initialize_rng_tracker,
                                                       model_parallel_cuda_manual_seed)

    if not on_gpu():
        use_cpu()
    destroy_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp)
    if on_gpu():
        model_parallel_cuda_manual_seed(1234)
        return
    # The CUDA RNG tracker cannot hold CPU generator states; the inference tracker turns its
    # fork() into a no-op, so dropout (off in our tests) would use the default generator.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def destroy_parallel() -> None:
    """Megatron's parallel state, and the process groups it made (all but the world's).

    ``destroy_model_parallel`` forgets most of its groups without destroying them: a process
    that builds layout after layout would keep every set alive, each gloo group with threads
    and sockets of its own."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        for group in list(dist.distributed_c10d._world.pg_map):
            if group is not dist.group.WORLD:
                dist.destroy_process_group(group)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_single_process(backend: str) -> None:
    """A world of one process on ``backend`` (if none is initialised yet), then Megatron's
    parallel state on it (TP = PP = 1, :func:`init_parallel`)."""
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(_free_port())
        dist.init_process_group(backend, rank=0, world_size=1)
    init_parallel()


def _worker(rank, world_size, port, backend, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # spawn's deadline asks for the stacks
    if backend == "nccl":
        torch.cuda.set_device(rank)
        # fp32 matmuls in fp32, so that layouts compare at the CPU runs' tolerances
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
        use_cpu()
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
    finally:
        destroy_parallel()
        dist.destroy_process_group()


def can_spawn(world_size: int) -> bool:
    """Whether :func:`spawn` can run this many ranks here (on NCCL: one GPU each)."""
    return dist_backend() == "gloo" or world_size <= torch.cuda.device_count()


SPAWN_TIMEOUT_S = 900  # test_context_parallel's three worlds take 160 to 175 s in all on 2 CPU cores


def _join_by(context, world_size: int, timeout: float) -> None:
    """Wait for the ranks of ``context``; past ``timeout`` seconds have each print its stacks,
    kill them all and raise."""
    deadline = time.monotonic() + timeout
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for pid in context.pids():  # one at a time, so that their stacks do not interleave
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
                time.sleep(1)
            for process in context.processes:
                process.kill()
            raise RuntimeError(f"distributed test failed: its {world_size} ranks did not finish in "
                               f"{timeout:.0f} s (MEGATRON_EXT_TEST_SPAWN_TIMEOUT); each rank's "
                               "stacks are in the captured stderr")


def spawn(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes (gloo, or NCCL: see the
    module docstring); list of results. Skips the test when the GPUs are too few.

    ``fn`` must be importable (a module-level function). A failure on any rank raises here with
    that rank's traceback; ranks that outrun the deadline (module docstring) raise too.
    """
    import pytest

    backend = dist_backend()
    if not can_spawn(world_size):
        pytest.skip(f"{world_size} NCCL ranks need {world_size} GPUs; "
                    f"this host has {torch.cuda.device_count()}")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # children inherit it: keep logs readable
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        context = mp.start_processes(_worker, args=(world_size, port, backend, fn, args, results),
                                     nprocs=world_size, join=False, start_method="spawn")
        _join_by(context, world_size, float(os.environ.get("MEGATRON_EXT_TEST_SPAWN_TIMEOUT",
                                                           SPAWN_TIMEOUT_S)))
        out = dict(results)
    errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(out.items()) if status != "ok"]
    if errors or len(out) != world_size:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [out[r][1] for r in range(world_size)]


def saved_bytes(fn, *args, **kwargs):
    """``(bytes, fn(...))``: the bytes of the distinct storages autograd keeps for backward
    while ``fn`` runs (views of one storage count once)."""
    kept = []  # holding them keeps a freed storage's address from being reused meanwhile

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args, **kwargs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return sum(storages.values()), out


# Sizes of the sparse attentions (MoBA, NSA, DSA, CSA, HCA) for the short sequences of these
# tests (12 tokens or more); the papers' defaults need sequences of thousands of tokens.
SHORT_SPARSE = dict(moba_block_size=4, moba_top_k=2, nsa_compress_block=4, nsa_compress_stride=2,
                    nsa_select_block=4, nsa_select_top_k=3, nsa_window=8, dsa_top_k=6,
                    dsa_indexer_heads=4, dsa_indexer_dim=8, csa_compress_rate=4, csa_top_k=3,
                    csa_indexer_heads=4, csa_indexer_dim=8, csa_window=6, hca_compress_rate=8,
                    hca_window=8)


def sparse_ext(pattern: str, **options):
    """The ExtConfig of the sparse-layer tests: ``pattern`` on the SDPA core with the
    :data:`SHORT_SPARSE` sizes (``options`` override them)."""
    from megatron_ext.config import ExtConfig

    return ExtConfig(pattern=pattern, attention_backend="sdpa", **dict(SHORT_SPARSE, **options))


def is_indexer(name: str) -> bool:
    """Whether a parameter name belongs to a DSA / CSA lightning indexer."""
    return ".indexer." in name


def sparse_model(ext, position_embedding_type="none", **cfg):
    """A tiny GPTModel of ``ext``'s pattern (the sparse-layer tests), the same weights each call."""
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = tiny_config(num_layers=len(ext.pattern), **cfg)
    torch.manual_seed(7)
    return GPTModel(config, block_spec(config, ext=ext), vocab_size=96, max_sequence_length=48,
                    position_embedding_type=position_embedding_type)


SPARSE_SEQ = 21


def sparse_loss(model, seed=3):
    """The mean LM loss of :func:`sparse_model` on two random sequences of SPARSE_SEQ tokens."""
    tokens = torch.randint(0, 96, (2, SPARSE_SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return model(tokens[:, :-1], torch.arange(SPARSE_SEQ).expand(2, -1), None,
                 labels=tokens[:, 1:]).mean()


def assert_packed_equals_separate(model, lengths=(10, 19)) -> None:
    """The first layer's attention of a RoPE :func:`sparse_model` on ``thd``-packed sequences of
    ``lengths`` equals it on each sequence alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = model.decoder.layers[0].self_attention
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    hidden = torch.randn(bounds[-1], 1, model.config.hidden_size,
                         generator=torch.Generator().manual_seed(0))
    freqs = model.rotary_pos_emb(max(lengths))
    cu = torch.tensor(bounds, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    packed, _ = attention(hidden, None, rotary_pos_emb=freqs, packed_seq_params=params)
    pieces = [attention(hidden[a:b], None, rotary_pos_emb=freqs[:b - a])[0]
              for a, b in zip(bounds, bounds[1:])]
    torch.testing.assert_close(packed, torch.cat(pieces), rtol=1e-5, atol=1e-6)


def named_grads(model):
    """Each parameter's gradient (a copy), or None."""
    return {name: None if p.grad is None else p.grad.clone() for name, p in model.named_parameters()}


def projected_grads(out, inputs):
    """Gradients of a fixed random projection of ``out``, per input that gets one."""
    for t in inputs.values():
        t.grad = None
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    return {name: t.grad for name, t in inputs.items() if t.grad is not None}


def assert_same_output_and_grads(out, grads, expected, expected_grads):
    """fp32 agreement of an op's output and its :func:`projected_grads` with a reference's."""
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-5,
                                   msg=f"grad of {name}")


def fit(model, tokens: torch.Tensor, steps: int = 8, lr: float = 3e-3) -> list[float]:
    """The next-token losses of ``steps`` AdamW steps of ``model`` (a GPTModel) on the fixed
    batch ``tokens [b, s + 1]``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    positions = torch.arange(tokens.shape[1] - 1).expand(tokens.shape[0], -1)
    losses = []
    for _ in range(steps):
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def tiny_preset(**train) -> dict:
    """A preset (as YAML would load it) of a 2-layer ``G*`` model small enough for the CLI
    and launcher tests on two CPU cores; ``train`` adds to its ``train`` section."""
    return {
        "model": {"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 128,
                  "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 64,
                  "position_embedding_type": "none"},
        "ext": {"pattern": "G*"},
        "data": {"vocab_size": 512},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "warmup_steps": 1,
                  "log_interval": 1, "eval_batches": 1, **train},
    }


def tiny_config(**overrides):
    """A TransformerConfig small enough for multi-process tests on two CPU cores."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, use_cpu_initialization=True, hidden_dropout=0.0,
                  attention_dropout=0.0, normalization="RMSNorm", bias_dropout_fusion=False,
                  gradient_accumulation_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, pipeline_dtype=torch.float32, add_bias_linear=False,
                  mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8)
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


# ---------------------------------------------------------------------- incremental decoding
DECODING_VOCAB = 96
# The sparse layers have no incremental decoding yet: they raise a ConfigError that names
# decoding.
CANNOT_DECODE = {"dsa", "csa", "hca", "moba", "nsa"}


def decoding_model(pattern: str, seed: int = 0, config_options=None, **ext_options):
    """A tiny GPTModel of ``pattern`` (fp32, on the CPU, in eval mode) for the decoding tests."""
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import block_spec

    config = tiny_config(num_layers=len(pattern), **(config_options or {}))
    torch.manual_seed(seed)
    ext = ExtConfig(pattern=pattern, **SHORT_SPARSE, **ext_options)
    model = GPTModel(config, block_spec(config, ext=ext), vocab_size=DECODING_VOCAB,
                     max_sequence_length=64, position_embedding_type="learned_absolute")
    return model.eval()


def decode(model, tokens: torch.Tensor, prompt: int, step: int = 1) -> torch.Tensor:
    """Logits ``[b, s, vocab]``: the prompt in one forward, then ``step`` tokens per forward
    (in Megatron's decode mode when ``step`` is 1; as chunks of prefill otherwise)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    b, s = tokens.shape
    context = StaticInferenceContext(max_batch_size=b, max_sequence_length=64)
    context.materialize_only_last_token_logits = False
    pieces, start = [], 0
    for end in [prompt, *range(prompt + step, s, step), s]:
        if end <= start:
            continue
        positions = torch.arange(start, end, device=tokens.device).expand(b, -1)
        pieces.append(model(tokens[:, start:end], positions, None, inference_context=context))
        context.sequence_len_offset += end - start
        if step == 1:  # Megatron's decode mode: one token per sequence, no mask
            context.enable_decode_mode()
        start = end
    return torch.cat(pieces, dim=1)


# ------------------------------------------------------------------------------------- export
def settings_of(pattern: str, position_embedding_type: str = "none", **ext):
    """The RunSettings of a small model of ``pattern`` for the export tests."""
    from megatron_ext import train

    # hidden 256: megatron-core's default Mamba-2 sizes (head dim 64, 8 groups) need 8 heads.
    return train.RunSettings.from_dict({
        "model": {"num_layers": len(pattern), "hidden_size": 256, "ffn_hidden_size": 256,
                  "num_attention_heads": 4, "num_query_groups": 2, "seq_length": 64,
                  "position_embedding_type": position_embedding_type},
        "ext": {"pattern": pattern, **SHORT_SPARSE, **ext},
        "data": {"vocab_size": 500},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "steps": 1},
    })


def random_model(settings, seed: int = 0):
    """The GPTModel of ``settings`` (fp32, CPU, eval mode) with N(0, 0.05^2) weights."""
    from megatron_ext import train
    from megatron_ext.hf import build_gpt_model

    model = build_gpt_model(settings, train._padded_vocab(settings.data.vocab_size, 1))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return model.eval()


def run_dir_with(tmp_path, settings, step: int = 3) -> tuple[pathlib.Path, pathlib.Path]:
    """A run directory as ``train`` leaves it: config.yaml and checkpoints/latest."""
    import yaml

    run = tmp_path / "run"
    folder = run / "checkpoints" / f"iter_{step:07d}"
    folder.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(settings.to_dict()))
    (run / "checkpoints" / "latest").write_text(f"{step}\n")
    return run, folder


def load_exported(out, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, **kwargs)


def exported_random_model(tmp_path, settings, **load_options):
    """A random model of ``settings`` saved as a CPU train run's checkpoint, and its export
    loaded with transformers (``load_options``: ``from_pretrained``'s dtype, device_map)."""
    from megatron_ext.export import export

    model = random_model(settings)
    run, folder = run_dir_with(tmp_path, settings)
    (folder / "model").mkdir()
    torch.save(model.state_dict(), folder / "model" / "model.pt")
    return model, load_exported(export(run, tmp_path / "hf"), **load_options)



# --------------------------------------------------------------- parallel-layout equivalence
# One training step of a tiny GPTModel in a given TP/PP/VPP layout, from the weights of a
# single-process run's dist checkpoint (fresh initialisation cannot be compared across PP: each
# stage draws only its own layers' weights). Used by the tests in tests/parallel.
SEQ, BATCH, VOCAB, MICRO_BATCHES = 24, 2, 96, 2


def layout_batches():
    """The micro-batches, on this rank's GPU in an NCCL world (Megatron's CP split indexes them
    there)."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, BATCH, SEQ + 1), generator=g)
    device = "cuda" if on_gpu() else "cpu"
    return [dict(tokens=t[:, :-1].to(device), labels=t[:, 1:].to(device),
                 position_ids=torch.arange(SEQ, device=device).expand(BATCH, SEQ)) for t in tokens]


def build_layout(ext, tp=1, pp=1, vpp=None, sequence_parallel=False, spec="block",
                 config_overrides=None, cp=1, position_embedding_type="none"):
    """Model chunks of this rank (one per virtual stage), same seed on every layout.

    ``ext`` is the model's ExtConfig; ``spec="block"``: this stage's per-layer specs
    (block_spec); ``spec="layer"``: one PatternTransformerLayer spec for all layers, which picks
    its mixer by global layer number. ``config_overrides`` go to :func:`tiny_config`
    (``num_layers`` defaults to the pattern's length).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_ext.specs import PatternTransformerLayer, block_spec

    init_parallel(tp=tp, pp=pp, vpp=vpp, cp=cp)
    overrides = {"num_layers": len(ext.pattern), **(config_overrides or {})}
    config = tiny_config(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                         virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp,
                         sequence_parallel=sequence_parallel, **overrides)
    chunks = []
    for v in range(vpp or 1):
        vp = v if vpp else None
        torch.manual_seed(1234)
        if spec == "block":
            layer_spec = block_spec(config, ext=ext, vp_stage=vp)
        else:
            layer_spec = ModuleSpec(module=PatternTransformerLayer, params={"ext": ext})
        chunks.append(GPTModel(
            config, layer_spec,
            vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type=position_embedding_type,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            vp_stage=vp))
    if on_gpu():
        for chunk in chunks:
            chunk.cuda()
            chunk.register_forward_pre_hook(_inputs_to_gpu, with_kwargs=True)
    return chunks, config


def _inputs_to_gpu(module, args, kwargs):
    """Forward pre-hook: the tensors (and packed-sequence bounds) a test built on the CPU go to
    the model's GPU."""
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.cuda()
        if type(x).__name__ == "PackedSeqParams":
            return dataclasses.replace(x, **{f.name: move(getattr(x, f.name))
                                             for f in dataclasses.fields(x)})
        return x

    return tuple(move(a) for a in args), {k: move(v) for k, v in kwargs.items()}


def run_schedule(chunks):
    """Megatron's forward-backward schedule over the micro-batches; losses on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(iterator, model):
        b = next(iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
        return out, lambda o: (o.mean(), {"loss": o.mean().detach()})

    iterators = [iter(layout_batches()) for _ in chunks]
    reduced = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks, num_microbatches=MICRO_BATCHES, seq_length=SEQ,
        micro_batch_size=BATCH, forward_only=False)
    return [float(r["loss"]) for r in reduced]


def global_grads(chunks, config):
    """Gradients keyed by global layer number, with TP shards gathered later by the test.

    Replicated weights that each TP rank applies to its own part of the work hold partial
    gradients: norms under sequence parallelism (each rank's slice of the sequence) and the
    QK-norm weights (each rank's heads). Megatron's finalize_model_grads sums them over TP, and
    so do we here.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    for chunk in chunks:
        for name, p in chunk.named_parameters():
            qk_norm = config.qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name)
            if getattr(p, "sequence_parallel", False) or qk_norm:
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
    grads = {}
    for v, chunk in enumerate(chunks):
        offset = get_transformer_layer_offset(config, vp_stage=v if len(chunks) > 1 else None)
        for name, p in chunk.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(int(parts[2]) + offset)
            grads[".".join(parts)] = (p.grad.cpu().clone(), getattr(p, "partition_dim", None)
                                      if getattr(p, "tensor_model_parallel", False) else None,
                                      getattr(p, "fused_part_sizes", None))
    return grads


def run_layout(rank, world_size, ckpt_dir, ext, tp=1, pp=1, vpp=None, sequence_parallel=False,
               save=False, spec="block", perturb=None, config_overrides=None):
    """Build this layout, load (or, for the reference, save) the checkpoint, run one step.

    ``perturb``: before saving, parameters whose name contains this string (or one of this
    tuple of strings) get N(0, 0.05)
    noise, so that terms which start at zero (routing projections, pseudo-queries) are
    exercised.
    """
    from megatron.core import parallel_state as ps

    chunks, config = build_layout(ext, tp, pp, vpp, sequence_parallel, spec, config_overrides)
    save_or_load(chunks, ckpt_dir, save, perturb)
    losses = run_schedule(chunks)
    return dict(losses=losses if ps.is_pipeline_last_stage() else None,
                tp_rank=ps.get_tensor_model_parallel_rank(),
                grads=global_grads(chunks, config))


def run_layouts(rank, world_size, jobs):
    """:func:`run_layout` for each ``(name, ckpt_dir, ext, kwargs)`` of ``jobs`` in turn, in
    this one process; results by name."""
    return {name: run_layout(rank, world_size, ckpt_dir, ext, **kwargs)
            for name, ckpt_dir, ext, kwargs in jobs}


def spawn_layouts(world_size, jobs):
    """Every job of :func:`run_layouts` in one spawn of ``world_size`` ranks (process start-up,
    NCCL set-up and kernel compilation are paid once, not per layout); merged results
    (:func:`merge_layout`) by name."""
    per_rank = spawn(run_layouts, world_size, jobs)
    return {name: merge_layout([r[name] for r in per_rank]) for name, *_ in jobs}


def save_or_load(chunks, ckpt_dir, save, perturb=None):
    """The reference run saves its weights (after ``perturb``, see :func:`run_layout`) as a
    dist checkpoint; every other layout loads them, resharded to its own split."""
    from megatron.core import dist_checkpointing

    perturbed = (perturb,) if isinstance(perturb, str) else perturb or ()
    # Keys inside the checkpoint are global (per-layer numbers), so chunks never collide.
    state = {f"chunk{v}": chunk.sharded_state_dict() for v, chunk in enumerate(chunks)}
    if save:
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if any(part in name for part in perturbed):
                    with torch.no_grad():
                        p.add_(0.05 * torch.randn_like(p))
        dist_checkpointing.save(state, ckpt_dir)
    else:
        for chunk in chunks:  # prove that every weight comes from the checkpoint
            for p in chunk.parameters():
                torch.nn.init.normal_(p)
        loaded = dist_checkpointing.load(state, ckpt_dir)
        for v, chunk in enumerate(chunks):
            chunk.load_state_dict(loaded[f"chunk{v}"])


def merge_layout(results):
    """Losses from the last stage, and full gradients (TP shards concatenated)."""
    losses = next(r["losses"] for r in results if r["losses"] is not None)
    merged = {}
    for name in {n for r in results for n in r["grads"]}:
        owners = sorted((r for r in results if name in r["grads"]), key=lambda r: r["tp_rank"])
        _, dim, part_sizes = owners[0]["grads"][name]
        shards = [r["grads"][name][0] for r in owners]
        shards = [shards[i] for i in sorted({r["tp_rank"]: i for i, r in enumerate(owners)}.values())]
        if dim is None:
            merged[name] = shards[0]
        elif part_sizes is None:
            merged[name] = torch.cat(shards, dim=dim)
        else:  # a fused projection: each rank holds its slice of every part, in order
            pieces = [shard.split(part_sizes, dim=dim) for shard in shards]
            merged[name] = torch.cat([torch.cat(part, dim=dim) for part in zip(*pieces)], dim=dim)
    return losses, merged


def assert_same_run(single, parallel, atol=2e-5):
    """Merged (losses, gradients) of a parallel layout equal those of the single process."""
    losses_1, grads_1 = single
    losses_n, grads_n = parallel
    torch.testing.assert_close(torch.tensor(losses_n), torch.tensor(losses_1), rtol=1e-5, atol=1e-6)
    assert grads_n.keys() == grads_1.keys()
    for name in grads_1:
        torch.testing.assert_close(grads_n[name], grads_1[name], rtol=1e-4, atol=atol, msg=name)
