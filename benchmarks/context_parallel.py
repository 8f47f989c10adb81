"""Context parallelism per layer: forward+backward time of one layer, and the time and bytes of
its CP collectives, for each mixer and CP method, on however many GPUs (or CPU processes) the
launcher starts; CP = the number of processes.

    torchrun --nproc-per-node 4 benchmarks/context_parallel.py --out cp_h200x4.json
    torchrun --nproc-per-node 1 benchmarks/context_parallel.py --out cp_h200x1.json  # CP = 1
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py --device cpu --seq-lens 256 \\
        --hidden 64 --heads 4 --groups 2 --warmup 1 --reps 2 --out /tmp/cp_cpu.json    # smoke

Each measurement builds Megatron's TransformerBlock of one layer (``--mixers``: pattern
symbols, e.g. ``G`` Gated DeltaNet, ``M`` Mamba-2, ``*`` softmax attention, ``B`` MoBA) with
``context_parallel_size`` = world size and ``context_parallel_method`` from ``--methods``
(state passing or all-to-all; softmax attention always gathers K/V and MoBA always uses
all-to-all, so they run once). The layer takes this rank's ``T / CP`` tokens (Megatron's
load-balanced layout) of a random hidden state, ``[T/CP, B, hidden]`` in bf16 on a GPU (fp32
on the CPU), and runs forward and backward; the median of ``--reps`` calls after ``--warmup``
counts. The CP collectives (all-gather, reduce-scatter, all-to-all) are wrapped: their count,
the bytes each brings to this rank from the others, and their time (CUDA events around each
call; our CP code does not overlap them with compute, so this is time the layer waits).
``megatron_ext/parallel/README.md`` gives the byte formulas these should match. Rank 0 writes
``--out`` (JSON) after every measurement; positions are not embedded (no RoPE), which does not
change the work of any mixer here.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import time

import torch
import torch.distributed as dist

from megatron_ext.doctor import add_commit_argument, stamp

WRAPPED = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
# Mixers whose CP method is fixed (the linear recurrences take --methods).
FIXED_METHOD = {"*": "kv_all_gather", "B": "all_to_all", "S": "all_to_all"}


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Collectives:
    """Wraps the CP collectives of torch.distributed: calls, bytes received from other ranks,
    and the time spent in them, while :meth:`counting` is active."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.originals = {name: getattr(dist, name) for name in WRAPPED}
        self.reset()

    def reset(self):
        self.calls, self.bytes, self.events, self.seconds = 0, 0, [], 0.0

    def _wrap(self, name):
        original = self.originals[name]

        def call(out, inp, *args, group=None, **kwargs):
            size = (group or dist.group.WORLD).size()
            received = out if name != "reduce_scatter_tensor" else inp
            self.calls += 1
            self.bytes += received.numel() * received.element_size() * (size - 1) // size
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                result = original(out, inp, *args, group=group, **kwargs)
                end.record()
                self.events.append((start, end))
            else:
                began = time.perf_counter()
                result = original(out, inp, *args, group=group, **kwargs)
                self.seconds += time.perf_counter() - began
            return result

        return call

    @contextlib.contextmanager
    def counting(self):
        for name in WRAPPED:
            setattr(dist, name, self._wrap(name))
        try:
            yield self
        finally:
            for name, original in self.originals.items():
                setattr(dist, name, original)

    def milliseconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(start.elapsed_time(end) for start, end in self.events)
        return self.seconds * 1e3


def build_layer(args, symbol: str, method: str, cp: int, device: torch.device):
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import block_spec

    cuda = device.type == "cuda"
    ext = ExtConfig(pattern=symbol, context_parallel_method=method if symbol not in FIXED_METHOD
                    else "state_passing", kernel_backend=args.kernel_backend,
                    moba_block_size=args.moba_block, moba_top_k=args.moba_top_k)
    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, ffn_hidden_size=4 * args.hidden,
        num_attention_heads=args.heads, num_query_groups=args.groups, context_parallel_size=cp,
        normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        bf16=cuda, params_dtype=torch.bfloat16 if cuda else torch.float32,
        pipeline_dtype=torch.bfloat16 if cuda else torch.float32, use_cpu_initialization=not cuda,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, mamba_head_dim=64, mamba_num_groups=args.groups,
        mamba_state_dim=128)
    layer = TransformerBlock(config, block_spec(config, ext=ext), post_layer_norm=False)
    return layer.to(device), config.params_dtype


def measure(args, symbol, method, seq_len, device, collectives):
    cp = dist.get_world_size()
    layer, dtype = build_layer(args, symbol, method, cp, device)
    local = seq_len // cp
    hidden = torch.randn(local, args.batch, args.hidden, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn_like(hidden)

    def step():
        out = layer(hidden, attention_mask=None)
        out.backward(grad)

    for _ in range(args.warmup):
        step()
    times, comm_ms, comm_bytes, calls = [], [], 0, 0
    for _ in range(args.reps):
        collectives.reset()
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        with collectives.counting():
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - began) * 1e3)
        comm_ms.append(collectives.milliseconds())
        comm_bytes, calls = collectives.bytes, collectives.calls
    row = dict(mixer=symbol, method=method, seq_len=seq_len, cp=cp, batch=args.batch,
               fwd_bwd_ms=statistics.median(times), comm_ms=statistics.median(comm_ms),
               comm_bytes_per_rank=comm_bytes, collectives=calls)
    if device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--seq-lens", default="32768,65536", help="comma-separated T values")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4, help="key/value heads of attention")
    parser.add_argument("--mixers", default="G,M,*,B", help="pattern symbols")
    parser.add_argument("--methods", default="state_passing,all_to_all",
                        help="CP methods of the linear recurrences")
    parser.add_argument("--kernel-backend", default="auto")
    parser.add_argument("--moba-block", type=int, default=512)
    parser.add_argument("--moba-top-k", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", required=True)
    add_commit_argument(parser)
    args = parser.parse_args()

    from megatron.core import parallel_state

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    cp = dist.get_world_size()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    else:
        from megatron.core.tensor_parallel.random import initialize_rng_tracker

        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    collectives = Collectives(cuda)
    results = dict(cp=cp, environment=stamp(args.commit), settings=vars(args), results=[])
    out = pathlib.Path(args.out)
    for seq_len in (int(t) for t in args.seq_lens.split(",")):
        for symbol in args.mixers.split(","):
            methods = [FIXED_METHOD[symbol]] if symbol in FIXED_METHOD else args.methods.split(",")
            for method in methods:
                if cp == 1 and method == "all_to_all" and symbol not in FIXED_METHOD:
                    continue  # without CP the methods are the same run
                log(f"{symbol} {method} T={seq_len} CP={cp}: building, warm-up")
                try:
                    row = measure(args, symbol, method, seq_len, device, collectives)
                except (RuntimeError, ValueError) as error:  # out of memory, a refused layout
                    row = dict(mixer=symbol, method=method, seq_len=seq_len, cp=cp,
                               error=f"{type(error).__name__}: {error}"[:500])
                    if cuda:
                        torch.cuda.empty_cache()
                log(json.dumps(row))
                results["results"].append(row)
                if dist.get_rank() == 0:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
