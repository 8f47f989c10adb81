"""Test-only support for running megatron-core on a CPU over gloo.

megatron-core 0.19 hard-codes CUDA in a few places that a CPU test reaches: ``device="cuda"``
literals (schedules, optimizer, grad buffers), ``torch.cuda.current_device()`` for buffers and
RoPE, CUDA streams in DDP, and the CUDA RNG tracker. :func:`use_cpu` redirects those to the CPU
for the current process. Nothing in the package imports this module.

:func:`spawn` runs a function in N gloo processes and returns what each returned.
"""

from __future__ import annotations

import contextlib
import os
import socket
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
    _applied = True


def init_parallel(tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1) -> None:
    """Megatron process groups on the already-initialised gloo world, and a CPU RNG tracker."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import initialize_rng_tracker

    use_cpu()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=cp)
    # The CUDA RNG tracker cannot hold CPU generator states; the inference tracker turns its
    # fork() into a no-op, so dropout (off in our tests) would use the default generator.
    initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    use_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        results[rank] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        results[rank] = ("error", traceback.format_exc())
    finally:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def spawn(fn, world_size: int, *args):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; list of results.

    ``fn`` must be importable (a module-level function). A failure on any rank raises here with
    that rank's traceback.
    """
    os.environ.setdefault("PYTHONWARNINGS", "ignore")  # children inherit it: keep logs readable
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = _free_port()
        mp.start_processes(_worker, args=(world_size, port, fn, args, results),
                           nprocs=world_size, join=True, start_method="spawn")
        out = dict(results)
    errors = [f"rank {r}:\n{msg}" for r, (status, msg) in sorted(out.items()) if status != "ok"]
    if errors or len(out) != world_size:
        raise RuntimeError("distributed test failed\n" + "\n".join(errors))
    return [out[r][1] for r in range(world_size)]


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

