"""Time each fused residual-stream op (kernels/residual/triton_mhc.py, triton_depth.py) against
its PyTorch body, alone.

One op at a time on one GPU, the shapes of a training step of ``benchmarks/residual_step.py``
by default (T = 2 x 4096 tokens, h = 1024, bf16): mHC's ``pre_forward``, ``pre_backward``,
``update_forward`` and ``update_backward`` (n = 4 streams, fp32 coefficients), and Attention
Residuals' ``depth_forward`` and ``depth_backward`` (``--depth-sources`` sources, as block
AttnRes's FFN reads them: the packed state, its last slot plus the mixer's output, and the
gradient the state has from its later use), each as the Triton launcher
and as the eager PyTorch body of kernels/residual/efficient.py it equals. Per op: the
mean of ``--reps`` calls after ``--warmup`` (CUDA events), and the bandwidth that time implies
for the bytes the op must move at least (its inputs read once, its outputs written once): an
op far below the GPU's HBM bandwidth (~4.8 TB/s on an H200) is bound by something else.
Each op's row also lists the GPU kernels of one Triton call and their time (torch.profiler),
and their sum: where the launcher's host work takes longer than its kernels, the calls' time
is the host's, and the kernels' sum is what the op costs the GPU.

    python benchmarks/residual_ops.py --tokens 32768 --out benchmarks/results/residual_ops_h200.json
    python benchmarks/residual_ops.py --tokens 1024 --out /tmp/residual_ops.json  # a quick run

``--depth-sweep`` and ``--mhc-sweep`` also time the depth and the mHC kernels at other launch
configurations (the kernels' GPU time; for mHC with each result's difference from the current
configuration's), which is how their sizes were chosen.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch

from megatron_ext.doctor import add_commit_argument, stamp

EPS = 1e-6


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def inputs(tokens, n, h, dtype, device, depth_sources):
    """Streams-like tensors in ``dtype``; parameters and coefficients fp32."""
    g = torch.Generator().manual_seed(0)
    width = (2 + n) * n

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(device)

    return dict(streams=randn(tokens, n, h, dtype=dtype), y=randn(tokens, h, dtype=dtype),
                grad_u=randn(tokens, h, dtype=dtype), grad=randn(tokens, n, h, dtype=dtype),
                weight=randn(width, n * h, scale=(n * h) ** -0.5), bias=randn(width),
                gate=randn(3, scale=0.5), grad_post=randn(tokens, n), dres=randn(tokens, n, n),
                post=randn(tokens, n), res=torch.softmax(randn(tokens, n, n), -2),
                sources=randn(tokens, depth_sources, h, dtype=dtype), query=randn(h, scale=0.1),
                sources_grad=randn(tokens, depth_sources, h, dtype=dtype))


def nbytes(*tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


DEPTH_CONFIGS = [dict(BLOCK_T=t, BLOCK_H=c, num_warps=w)
                 for t in (8, 16, 32) for c in (128, 256) for w in (2, 4, 8)]
MHC_CONFIGS = [dict(BLOCK_T=t, BLOCK_H=c, num_warps=w)
               for t in (16, 32, 64) for c in (32, 64, 128) for w in (4, 8)]
MHC_SWEPT = ("pre_forward", "pre_backward", "update_forward", "update_backward")


def ops(x):
    """name -> (triton call, PyTorch body call, the bytes the op moves at least)."""
    from megatron_ext.kernels.residual import efficient, triton_depth, triton_mhc

    s, w, b, gate = x["streams"], x["weight"], x["bias"], x["gate"]
    y, post, res, grad = x["y"], x["post"], x["res"], x["grad"]
    forward = efficient._mhc_pre_forward_body(s, w, b, gate, EPS)
    mixes = forward[3]
    pre_grads = (s, w, b, gate, mixes, x["grad_u"], x["grad_post"], x["dres"], EPS)
    update = (s, y, post, res)
    # Block AttnRes's FFN read: the packed state, its last slot plus the mixer's output y, passed
    # on with y added, and in backward the gradient the passed state has from its later use.
    packed, query, g = x["sources"], x["query"], x["grad_u"]
    groups, passed = [packed], torch.empty_like(packed)
    _, z, r, alpha = efficient._depth_forward(query, efficient._with_last_plus(groups, y), EPS)
    first_grad = x["sources_grad"]
    return {
        "pre_forward": (lambda: triton_mhc.pre_forward(s, w, b, gate, EPS),
                        lambda: efficient._mhc_pre_forward_body(s, w, b, gate, EPS),
                        nbytes(s, w, *forward)),
        "pre_backward": (lambda: triton_mhc.pre_backward(*pre_grads),
                         lambda: efficient._mhc_pre_vjp(*pre_grads),
                         nbytes(s, w, mixes, x["grad_u"], x["grad_post"], x["dres"], s, w)),
        "update_forward": (lambda: triton_mhc.update_forward(*update),
                           lambda: efficient._stream_update_forward_body(*update),
                           nbytes(*update, s)),
        "update_backward": (lambda: triton_mhc.update_backward(*update, grad),
                            lambda: efficient._stream_update_vjp(*update, grad),
                            nbytes(*update, grad, s, y, post, res)),
        "depth_forward": (lambda: triton_depth.forward(query, groups, EPS, y, passed),
                          lambda: efficient._depth_forward(
                              query, efficient._with_last_plus(groups, y), EPS),
                          nbytes(packed, y, g, z, r, alpha, passed)),
        "depth_backward": (lambda: triton_depth.backward(query, groups, g, z, r, alpha, EPS, y,
                                                         first_grad),
                           lambda: efficient._depth_backward_pytorch(
                               query, groups, g, z, r, alpha, y, first_grad),
                           nbytes(packed, y, g, z, r, alpha, first_grad, packed, y)),
    }


def kernel_times(fn, reps=5) -> list[dict]:
    """The GPU kernels ``fn()`` launches and their mean time per call, longest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages()
              if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [dict(kernel=e.key[:80], calls=e.count / reps, ms=e.self_device_time_total / 1e3 / reps)
            for e in events]


def timed_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def depth_autograd(x):
    """efficient.depth_attention forward and backward, as a block AttnRes FFN calls it."""
    from megatron_ext.kernels.residual import efficient

    packed = x["sources"].detach().requires_grad_()
    mixer_output = x["y"].detach().requires_grad_()
    query = x["query"].detach().requires_grad_()
    out, passed = efficient.depth_attention(query, [packed], last_plus=mixer_output,
                                            pass_through=True)
    torch.autograd.backward([out, passed], [x["grad_u"], x["sources_grad"]])


def host_ms(fn, calls):
    """The time of one call of ``fn`` among ``calls`` back-to-back ones (on tiny inputs: the
    host's time)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e3


def depth_sweep(x, reps):
    """The depth kernels' GPU time (the kernels of a call, not the host's launch) at each
    launch configuration of DEPTH_CONFIGS."""
    from megatron_ext.kernels.residual import triton_depth

    fixed = dict(BLOCK_H=triton_depth.BLOCK_H, forward=triton_depth._FORWARD_LAUNCH,
                 backward=triton_depth._BACKWARD_LAUNCH)
    launchers = ops(x)  # the launchers read the configuration when called
    rows = []
    try:
        for config in DEPTH_CONFIGS:
            triton_depth.BLOCK_H = config["BLOCK_H"]
            launch = dict(BLOCK_T=config["BLOCK_T"], num_warps=config["num_warps"])
            triton_depth._FORWARD_LAUNCH = triton_depth._BACKWARD_LAUNCH = launch
            row = dict(config)
            for name in ("depth_forward", "depth_backward"):
                kernels = kernel_times(launchers[name][0], reps)
                row[f"{name}_ms"] = sum(k["ms"] for k in kernels)
            rows.append(row)
            log(f"depth sweep {config}: forward {row['depth_forward_ms']:.4f} ms, "
                f"backward {row['depth_backward_ms']:.4f} ms")
    finally:
        triton_depth.BLOCK_H = fixed["BLOCK_H"]
        triton_depth._FORWARD_LAUNCH = fixed["forward"]
        triton_depth._BACKWARD_LAUNCH = fixed["backward"]
    return rows


def mhc_sweep(x, reps):
    """The mHC kernels' GPU time (the kernels of a call) at each launch configuration of
    MHC_CONFIGS, one launcher at a time (``triton_mhc.LAUNCH``), and the largest difference of
    the results from those at the launcher's own configuration, relative to their largest
    value (the sums run in another order: rounding, not a slip, for a few 1e-3 in bf16)."""
    from megatron_ext.kernels.residual import triton_mhc

    launchers = ops(x)
    rows = []
    for name in MHC_SWEPT:
        fixed = triton_mhc.LAUNCH[name]
        launcher = launchers[name][0]

        def call():
            out = launcher()
            return out if isinstance(out, tuple) else (out,)

        expected = [t.float() for t in call()]
        try:
            for config in MHC_CONFIGS:
                triton_mhc.LAUNCH[name] = config
                got = call()
                diff = max(((a.float() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
                           for a, b in zip(got, expected))
                ms = sum(k["ms"] for k in kernel_times(call, reps))
                rows.append(dict(op=name, **config, kernel_ms=ms, max_rel_diff=diff,
                                 current=config == fixed))
                log(f"mhc sweep {name} {config}: {ms * 1e3:.1f} us (max rel diff {diff:.1e})")
        finally:
            triton_mhc.LAUNCH[name] = fixed
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--depth-sources", type=int, default=5,
                   help="sources of the depth ops (block AttnRes, 20 layers in blocks of 4: 2-7)")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--host-calls", type=int, default=0,
                   help="also time this many back-to-back calls of each launcher on 16 tokens")
    p.add_argument("--depth-sweep", action="store_true",
                   help="also time the depth kernels at each launch configuration")
    p.add_argument("--mhc-sweep", action="store_true",
                   help="also time the mHC kernels at each launch configuration")
    p.add_argument("--out", required=True)
    add_commit_argument(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("residual_ops.py times CUDA kernels: no CUDA device here", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    x = inputs(args.tokens, args.streams, args.hidden, dtype, "cuda", args.depth_sources)
    rows = []
    for name, (kernel, body, moved) in ops(x).items():
        row = dict(op=name, min_bytes=moved)
        for impl, fn in (("triton", kernel), ("pytorch", body)):
            ms = timed_ms(fn, args.warmup, args.reps)
            row[f"{impl}_ms"] = ms
            row[f"{impl}_gb_per_s"] = moved / ms / 1e6
        row["triton_kernels"] = kernel_times(kernel)
        row["triton_kernel_ms"] = sum(k["ms"] for k in row["triton_kernels"])
        row["triton_kernel_gb_per_s"] = moved / row["triton_kernel_ms"] / 1e6
        rows.append(row)
        log(f"{name}: triton {row['triton_ms']:.3f} ms a call, kernels {row['triton_kernel_ms']:.3f} "
            f"ms ({row['triton_kernel_gb_per_s']:.0f} GB/s), "
            f"pytorch {row['pytorch_ms']:.3f} ms ({row['pytorch_gb_per_s']:.0f} GB/s), "
            f"{moved / 1e6:.1f} MB at least")
        for k in row["triton_kernels"]:
            log(f"    {k['ms']:.3f} ms  {k['kernel']}")
    host = {}
    if args.host_calls:
        tiny = inputs(16, args.streams, args.hidden, dtype, "cuda", args.depth_sources)
        for name, (kernel, body, _) in ops(tiny).items():
            host[name] = dict(triton_ms=host_ms(kernel, args.host_calls),
                              pytorch_ms=host_ms(body, args.host_calls))
            log(f"host, {name}: triton launcher {host[name]['triton_ms'] * 1e3:.1f} us a call, "
                f"pytorch body {host[name]['pytorch_ms'] * 1e3:.1f} us")
        host["depth_attention_autograd"] = dict(triton_ms=host_ms(
            lambda: depth_autograd(tiny), args.host_calls))
        log(f"host, depth_attention forward + backward through autograd: "
            f"{host['depth_attention_autograd']['triton_ms'] * 1e3:.1f} us a call")
    sweep = depth_sweep(x, args.reps) if args.depth_sweep else []
    mhc = mhc_sweep(x, args.reps) if args.mhc_sweep else []
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(environment=stamp(args.commit), settings=vars(args),
                                   results=rows, host=host, depth_sweep=sweep, mhc_sweep=mhc),
                              indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
