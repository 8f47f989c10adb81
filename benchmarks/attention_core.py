"""Megatron's local attention core vs our SDPA core, same GPT model, same GPU, one run.

Default model: the 291M configuration of the foundation issue (20 layers, hidden 1024, FFN 2816
SwiGLU, 16 heads, 4 KV groups, vocab 32000, RoPE), sequence 4096, micro-batch 2, bf16. Each
core runs a few warm-up steps, then ``--windows`` windows of ``--steps`` timed forward+backward
steps (no optimizer); the median window counts.

    python benchmarks/attention_core.py --out benchmarks/results/attention_core_h200.json

Model FLOPs per step (for TFLOP/s): 6 * (parameters except the input embedding) * tokens plus
causal attention 6 * layers * batch * seq^2 * hidden (QK^T and AV, half of the square, x3 for
forward + backward).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import pathlib
import time

import torch

from megatron_ext.doctor import add_commit_argument, stamp


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def setup():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)


def build(args, backend):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import block_spec

    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.groups, normalization="RMSNorm",
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16,
        # The fusions megatron-core offers without TE or apex (torch-jit SwiGLU and cross
        # entropy); both cores get them. The apex softmax kernel of the local core is absent.
        bias_activation_fusion=True, cross_entropy_loss_fusion=True,
        cross_entropy_fusion_impl="native", bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False)
    torch.manual_seed(0)
    model = GPTModel(config, block_spec(config, ext=ExtConfig(pattern="*",
                                                              attention_backend=backend)),
                     vocab_size=args.vocab, max_sequence_length=args.seq,
                     position_embedding_type="rope").cuda()
    return model


def model_flops(model, args):
    params = sum(p.numel() for n, p in model.named_parameters() if "word_embeddings" not in n)
    tokens = args.batch * args.seq
    return 6 * params * tokens + 6 * args.layers * args.batch * args.seq ** 2 * args.hidden


def measure(args, backend):
    model = build(args, backend)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")
    positions = torch.arange(args.seq, device="cuda").expand(args.batch, -1)

    def step():
        loss = model(tokens, positions, None, labels=tokens).float().mean()
        loss.backward()
        return loss

    log(f"{backend}: {n_params / 1e6:.1f}M params; warm-up")
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    windows = []
    for _ in range(args.windows):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            step()
        end.record()
        torch.cuda.synchronize()
        windows.append(start.elapsed_time(end) / args.steps)
    ms = sorted(windows)[len(windows) // 2]  # median window
    # GPU time of one step (sum of kernel times), independent of how fast the host launches.
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_kernel_ms = sum(e.self_device_time_total for e in events) / 1e3
    if args.profile:
        log(f"{backend}: top CUDA kernels of one step\n"
            + events.table(sort_by="cuda_time_total", row_limit=15))
        with profile(activities=[ProfilerActivity.CPU]) as cpu_prof:
            step()
            torch.cuda.synchronize()
        log(f"{backend}: top host-side (CPU) ops of one step\n"
            + cpu_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    result = dict(backend=backend, params=n_params, ms_per_step=ms, ms_per_step_windows=windows,
                  gpu_kernel_ms_per_step=gpu_kernel_ms,
                  peak_memory_gib=torch.cuda.max_memory_allocated() / 2**30,
                  model_tflops=model_flops(model, args) / (ms * 1e-3) / 1e12)
    log(f"{backend}: {ms:.1f} ms/step (GPU kernels {gpu_kernel_ms:.1f} ms), "
        f"{result['model_tflops']:.0f} TFLOP/s, peak {result['peak_memory_gib']:.1f} GiB")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def sdpa_backends(args):
    """fwd+bwd ms of the attention op alone under each SDPA backend, at the model's shapes."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    shape_q = (args.batch, args.heads, args.seq, args.hidden // args.heads)
    shape_kv = (args.batch, args.groups, args.seq, args.hidden // args.heads)
    q = torch.randn(shape_q, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(shape_kv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    timings = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION, None):
        name = "default" if backend is None else backend.name.lower()

        def run():
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            out.sum().backward()

        try:
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                run()
            torch.cuda.synchronize()
            timings[name] = (time.perf_counter() - t0) / 10 * 1e3
        except RuntimeError as e:
            timings[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
        log(f"SDPA backend {name}: {timings[name]}")
    return timings


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    names = [r["backend"] for r in results]
    for ax, key, label in ((axes[0], "ms_per_step", "fwd+bwd ms / step"),
                           (axes[1], "peak_memory_gib", "peak memory (GiB)")):
        ax.bar(names, [r[key] for r in results], color=["#999", "#2a7"][: len(names)])
        ax.set_title(label)
        for i, r in enumerate(results):
            ax.text(i, r[key], f"{r[key]:.1f}", ha="center", va="bottom")
    fig.suptitle("GPT 291M, seq 4096, micro-batch 2, bf16: attention core")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=20)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows; the median counts")
    p.add_argument("--backends", default="local,sdpa")
    p.add_argument("--profile", action="store_true", help="print each core's top CUDA kernels")
    p.add_argument("--out", default="benchmarks/results/attention_core.json")
    add_commit_argument(p)
    args = p.parse_args()

    setup()
    backend_ms = sdpa_backends(args)
    results = [measure(args, b) for b in args.backends.split(",")]
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = dict(environment=stamp(args.commit), settings=vars(args), results=results,
                  sdpa_backend_ms_per_layer_fwd_bwd=backend_ms)
    by_name = {r["backend"]: r for r in results}
    if {"local", "sdpa"} <= by_name.keys():
        local, sdpa = by_name["local"], by_name["sdpa"]
        record["speedup_sdpa_over_local"] = local["ms_per_step"] / sdpa["ms_per_step"]
        record["gpu_kernel_speedup_sdpa_over_local"] = (local["gpu_kernel_ms_per_step"]
                                                        / sdpa["gpu_kernel_ms_per_step"])
        record["memory_ratio_local_over_sdpa"] = local["peak_memory_gib"] / sdpa["peak_memory_gib"]
        log(f"SDPA over local: {record['speedup_sdpa_over_local']:.2f}x faster per step "
            f"({record['gpu_kernel_speedup_sdpa_over_local']:.2f}x in GPU kernel time), "
            f"{record['memory_ratio_local_over_sdpa']:.2f}x less peak memory")
    out.write_text(json.dumps(record, indent=1))
    plot(results, out.with_suffix(".png"))
    log(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
