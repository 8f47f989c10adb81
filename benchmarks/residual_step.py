"""Step time and peak memory of one training step with each residual scheme, same GPU, one run.

Default model: the 291M-parameter GPT of the foundation issue (20 layers, hidden 1024, FFN 2816
SwiGLU, 16 heads, 4 KV groups, vocab 32000, RoPE), sequence 4096, micro-batch 2, bf16, softmax
attention in every layer (pattern ``*``) so that only the residual scheme differs. Each variant
(``--variants``) builds the model through ``megatron-ext train``'s own code (the TransformerConfig,
``block_spec``, Megatron's DDP and optimizer, the pipeline schedule), runs ``--warmup`` steps
(which also compiles the residual ops), then ``--windows`` windows of ``--steps`` timed steps
(forward + backward + optimizer step, CUDA events); the median window counts. Each variant runs
in a process of its own (nothing of the one before is held). It also records the summed GPU kernel
time, the time the GPU idled inside the step, the number of GPU launches and the 25 costliest
kernels of one step (torch.profiler), since at this size the host launching kernels can set the
wall time, and the peak memory above the model and optimizer state.
``--sync-debug`` adds where one step makes the host wait for the GPU (torch's
sync debug mode; each place by its innermost Megatron or megatron-ext frame, with counts).

    python benchmarks/residual_step.py --out benchmarks/results/residual_step_h200.json
    python benchmarks/residual_step.py --tiny --out /tmp/residual_step_tiny.json   # CPU smoke

Variants: ``standard``; ``mhc`` (4 streams, 20 Sinkhorn iterations, learned collapse);
``mhc_recompute`` (the same, recomputing the mHC intermediates in backward); ``attnres_block``
(``--block-layers`` layers per block); ``attnres_full``. Overheads are relative to ``standard``.
Goals (issue 6): mHC <= 5 % step time (the paper reports 6.7 %), block attention residuals
<= 3 % (paper: < 4 %).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from megatron_ext.doctor import add_commit_argument, stamp

VARIANTS = {
    "standard": dict(residual="standard"),
    "mhc": dict(residual="mhc"),
    "mhc_recompute": dict(residual="mhc", mhc_recompute=True),
    "attnres_block": dict(residual="attnres_block"),
    "attnres_full": dict(residual="attnres_full"),
}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def settings_for(args, variant):
    from megatron_ext.config import ExtConfig
    from megatron_ext.train import ModelSettings, RunSettings, TrainSettings

    ext = ExtConfig(pattern="*", residual_backend=args.residual_backend,
                    attnres_block_layers=args.block_layers, **VARIANTS[variant])
    model = ModelSettings(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                          num_attention_heads=args.heads, num_query_groups=args.groups,
                          seq_length=args.seq, position_embedding_type=args.position_embedding)
    train = TrainSettings(micro_batch_size=args.batch, global_batch_size=args.batch,
                          steps=args.warmup + args.windows * args.steps + 10, warmup_steps=1,
                          lr=1e-4, min_lr=1e-5)
    return RunSettings(model=model, ext=ext, train=train).validate()


def measure(args, variant, runtime):
    from megatron_ext import residual, train
    from megatron_ext.kernels.residual import efficient

    settings = settings_for(args, variant)
    torch.manual_seed(0)
    config = train.transformer_config(settings, runtime)
    model = train.build_model(settings, config, args.vocab)
    backend = residual.ops_backend(settings.ext)
    if args.mhc_bodies:  # the model's schemes run mHC's stream ops in the PyTorch bodies
        backend = dataclasses.replace(backend, triton_mhc=False)
        for module in model.modules():
            if isinstance(module, residual.ResidualScheme):
                module.backend = backend
    model.to(runtime.device)
    n_params = sum(p.numel() for p in model.parameters())
    model, optimizer, scheduler = train.build_optimizer(model, settings, runtime)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=runtime.device)
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                 loss_mask=torch.ones(args.batch, args.seq, device=runtime.device),
                 position_ids=torch.arange(args.seq, device=runtime.device).expand(args.batch, -1))

    def step():
        model.train()
        return train._train_step(model, optimizer, scheduler, [batch], settings, runtime)[0]

    log(f"{variant}: {n_params / 1e6:.1f}M params; {args.warmup} warm-up steps")
    begin = time.perf_counter()
    for _ in range(args.warmup):
        loss = step()
    _sync(runtime)
    log(f"{variant}: warm-up took {time.perf_counter() - begin:.1f} s, loss {loss:.3f}")
    static_gib = peak_gib = None
    if runtime.cuda:
        static_gib = torch.cuda.memory_allocated() / 2**30
        torch.cuda.reset_peak_memory_stats()
    windows = []
    for _ in range(args.windows):
        windows.append(_timed(step, args.steps, runtime))
        log(f"{variant}: window {windows[-1]:.1f} ms/step")
    result = dict(variant=variant, ext=settings.ext.to_dict(), params=n_params,
                  ms_per_step=statistics.median(windows), ms_per_step_windows=windows,
                  loss_after=loss,
                  residual_ops_compiled=backend.compiled and not efficient.compile_failures(),
                  residual_triton_kernels=backend.triton,
                  mhc_triton_kernels=backend.triton and backend.triton_mhc)
    if runtime.cuda:
        peak_gib = torch.cuda.max_memory_allocated() / 2**30
        if args.sync_debug:
            result["host_syncs"] = host_syncs(step)
            log(f"{variant}: host syncs in one step: {result['host_syncs']}")
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.profile else [])
        with profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        if args.profile:  # where the host's time goes: the ops with the most own CPU time
            top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:30]
            result["host_profile"] = [dict(op=e.key[:100], calls=e.count, self_cpu_ms=e.self_cpu_time_total / 1e3,
                                           device_ms=e.self_device_time_total / 1e3) for e in top]
        # The GPU's own events (kernels, copies, memsets): with --profile the host ops are
        # recorded too, and each carries its kernels' time again. Not the GPU side of a
        # record_function range ("Optimizer.step#AdamW.step"), which spans kernels counted
        # already and would count them twice.
        on_gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                  and not getattr(e, "is_user_annotation", False)]
        slowest = sorted(on_gpu, key=lambda e: e.self_device_time_total, reverse=True)[:25]
        result.update(gpu_kernel_ms_per_step=sum(e.self_device_time_total for e in on_gpu) / 1e3,
                      gpu_idle_ms_per_step=gpu_idle_ms(prof),
                      launches_per_step=sum(e.count for e in on_gpu),
                      gpu_kernels=[dict(kernel=e.key[:100], calls=e.count,
                                        ms=e.self_device_time_total / 1e3) for e in slowest],
                      peak_memory_gib=peak_gib, static_memory_gib=static_gib,
                      activation_peak_gib=peak_gib - static_gib)
    log(f"{variant}: {result['ms_per_step']:.1f} ms/step"
        + (f" (GPU kernels {result['gpu_kernel_ms_per_step']:.1f} ms, GPU idle "
           f"{result['gpu_idle_ms_per_step']:.1f} ms), peak "
           f"{peak_gib:.2f} GiB ({peak_gib - static_gib:.2f} above weights + optimizer)"
           if runtime.cuda else ""))
    return result


def gpu_idle_ms(prof) -> float:
    """How long the GPU did nothing between the first and the last of its events in a profiled
    step (kernels, copies, memsets; not record_function ranges): the time it waited for the
    host to launch the next kernel, which a wall time above the summed kernel time is made of."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA
                   and not getattr(e, "is_user_annotation", False))
    if not spans:
        return 0.0
    busy, (start, end) = 0.0, spans[0]
    for a, b in spans[1:]:  # the union of the intervals
        if a > end:
            busy += end - start
            start, end = a, b
        else:
            end = max(end, b)
    busy += end - start  # end: the last interval of the union ends last
    return (end - spans[0][0] - busy) / 1e3


def host_syncs(step) -> list[dict]:
    """Where one ``step()`` synchronises the host with the GPU: torch's sync debug mode warns at
    each synchronising call; each warning is counted at its innermost frame in Megatron or
    megatron-ext (else its innermost frame), most frequent first. Ops that C++ autograd nodes
    run on the engine's own threads warn outside Python and are not counted."""
    import collections
    import traceback
    import warnings

    counts = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):  # other warnings of the step
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "megatron" in f.filename] or frames
        where = ours[-1]
        path = where.filename.split("site-packages/")[-1]
        counts[f"{path}:{where.lineno} {where.name}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # restored by catch_warnings
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return [dict(where=where, count=count) for where, count in counts.most_common()]


def _measure_in_child(variant: str) -> dict:
    """:func:`measure` of one variant in a fresh process (this script with the same arguments),
    so that nothing of the variant before (its model, compiled graphs, cached memory) is still
    held while this one is measured."""
    with tempfile.TemporaryDirectory() as tmp:
        result = pathlib.Path(tmp) / "result.json"
        argv = [a for a in sys.argv[1:]]
        if "--variants" in argv:  # the child measures only this variant
            i = argv.index("--variants")
            del argv[i:i + 2]
        argv = [a for a in argv if not a.startswith("--variants=")]
        subprocess.run([sys.executable, __file__, *argv, "--variants", variant,
                        "--child-result", str(result)], check=True)
        return json.loads(result.read_text())


def _sync(runtime):
    if runtime.cuda:
        torch.cuda.synchronize()


def _timed(step, steps, runtime) -> float:
    """Mean ms per step over ``steps`` steps (CUDA events on a GPU, wall clock on a CPU)."""
    if runtime.cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / steps
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - begin) * 1e3 / steps


def overheads(results):
    """Step-time and memory overheads of every variant relative to ``standard``."""
    by_name = {r["variant"]: r for r in results}
    base = by_name.get("standard")
    if base is None:
        return {}
    table = {}
    for name, r in by_name.items():
        if name == "standard":
            continue
        row = dict(step_time_pct=100 * (r["ms_per_step"] / base["ms_per_step"] - 1))
        if "gpu_kernel_ms_per_step" in r:
            row["gpu_kernel_time_pct"] = 100 * (r["gpu_kernel_ms_per_step"]
                                                / base["gpu_kernel_ms_per_step"] - 1)
            row["peak_memory_gib"] = r["peak_memory_gib"] - base["peak_memory_gib"]
            row["peak_memory_pct"] = 100 * (r["peak_memory_gib"] / base["peak_memory_gib"] - 1)
        table[name] = row
    return table


def plot(results, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [("ms_per_step", "ms / step (fwd + bwd + optimizer)")]
    if "peak_memory_gib" in results[0]:
        keys.append(("peak_memory_gib", "peak memory (GiB)"))
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.4), squeeze=False)
    names = [r["variant"] for r in results]
    for ax, (key, label) in zip(axes[0], keys):
        ax.bar(names, [r[key] for r in results], color="#2a7")
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=20)
        for i, r in enumerate(results):
            ax.text(i, r[key], f"{r[key]:.1f}", ha="center", va="bottom")
    fig.suptitle(title)
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
    p.add_argument("--batch", type=int, default=2, help="micro-batch size (one per step)")
    p.add_argument("--position-embedding", default="rope")
    p.add_argument("--block-layers", type=int, default=4,
                   help="layers per block of attnres_block (20 layers: 5 blocks + embedding)")
    p.add_argument("--residual-backend", default="auto", choices=("auto", "eager", "compile"),
                   help="ExtConfig.residual_backend: auto runs our Triton Sinkhorn and depth-"
                        "attention kernels on CUDA with compiled PyTorch bodies for the rest, "
                        "compile the compiled PyTorch bodies only")
    p.add_argument("--mhc-bodies", action="store_true",
                   help="with --residual-backend auto, run mHC's stream ops in the compiled "
                        "PyTorch bodies instead of our fused Triton kernels (the default)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="steps per timed window")
    p.add_argument("--windows", type=int, default=3, help="timed windows; the median counts")
    p.add_argument("--variants", default="standard,mhc,mhc_recompute,attnres_block,attnres_full")
    p.add_argument("--tiny", action="store_true",
                   help="a 4-layer, hidden-64 model on whatever device there is (smoke test)")
    p.add_argument("--out", default="benchmarks/results/residual_step.json")
    add_commit_argument(p)
    p.add_argument("--sync-debug", action="store_true",
                   help="also record where one step synchronises the host with the GPU")
    p.add_argument("--profile", action="store_true",
                   help="on a GPU, also record the host-side profile of one step (the top ops "
                        "by own CPU time)")
    p.add_argument("--child-result", help=argparse.SUPPRESS)  # one variant, in a child process
    args = p.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.heads, args.groups = 4, 64, 128, 4, 2
        args.vocab, args.seq, args.block_layers = 256, 64, 2
        args.warmup, args.steps, args.windows = 1, 2, 1
        if not torch.cuda.is_available():
            args.position_embedding = "none"  # megatron-core's RoPE needs CUDA
    unknown = sorted(set(args.variants.split(",")) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variant(s) {unknown}; known: {sorted(VARIANTS)}")

    if args.child_result:
        from megatron_ext.train import init_runtime

        runtime = init_runtime(settings_for(args, args.variants), "auto")
        log(f"device {runtime.device}, torch {torch.__version__}")
        pathlib.Path(args.child_result).write_text(json.dumps(measure(args, args.variants, runtime)))
        return
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for variant in args.variants.split(","):
        results.append(_measure_in_child(variant))
        table = overheads(results)
        if variant in table:
            log(f"{variant} vs standard: "
                + ", ".join(f"{k} {v:+.2f}" for k, v in table[variant].items()))
        record = dict(environment=stamp(args.commit), settings=vars(args),
                      results=results, overhead_vs_standard=table)
        out.write_text(json.dumps(record, indent=1))  # after every variant: partial runs count
    plot(results, out.with_suffix(".png"),
         f"GPT {results[0]['params'] / 1e6:.0f}M, {args.layers} layers, seq {args.seq}, "
         f"micro-batch {args.batch}: residual schemes")
    log(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
