"""Windowed and sparse softmax attention ops on one device: forward and forward+backward time and
peak memory of each beside torch SDPA (causal, the yardstick), in one run.

Ops (``--ops`` takes families, e.g. ``moba``, backends, e.g. ``flex``, or single ops, e.g.
``nsa/gathered``):

    swa_sink      softmax_attention with a sliding window of ``--window`` tokens and a
                  learnable sink per head (gpt-oss / DeepSeek-V4 style SWA layers)
    causal_sink   softmax_attention, causal, with a sink (what a '*' layer with
                  softmax_type="learnable" runs)
    moba          moba_attention, ``--moba-block`` tokens per block, ``--moba-top-k`` blocks
    nsa           nsa_attention, ``--nsa`` = compress block, stride, select block, top-k, window
                  (the paper's 32,16,64,16,512), with its gates and compression weights
    dsa           a DSA layer's sparse stage: dsa_select, dsa_attention and dsa_indexer_loss,
                  ``--dsa`` = top-k, indexer heads, indexer dim (the paper's 2048,64,128)
    hca, csa      DeepSeek-V4's layers: compression, then attention over window + entries
                  (+ CSA's selection and indexer loss); ``--hca`` = rate, window (128,128),
                  ``--csa`` = rate, top-k, window, indexer heads, indexer dim
                  (4,512,128,64,128)
    fox           softmax_attention with the Forgetting Transformer's forget gates (causal;
                  flex only: the gathered form does not take them)
    sdpa          torch SDPA, causal (flash on CUDA)

each with the backends of ``megatron_ext.kernels.sparse``: flex (FlexAttention, compiled; CUDA
only, its CPU form has no backward) and gathered (PyTorch); swa_sink, causal_sink, moba and nsa
also with flash (torch's FlashAttention-2 kernels, the sink through their log-sum-exp; NSA's
compressed branch on flex; CUDA only); dsa and csa also with triton (our Triton kernels,
kernels/sparse/triton.py and triton_indexer.py, for the attention and the indexer loss's
target and KL; the selection's scores in triton_indexer.py, its top-k in PyTorch; CUDA only);
dsa/flex and csa/flex run the attention on FlexAttention over the selection's bitmap and the
rest as "auto" does; dsa/flash runs the attention on cuDNN's fused attention with the selection
as a bias (flash.py's causal_selection_attention) and the rest as "auto" does;
swa_sink and causal_sink also with fla (fla-core's ``parallel_attn`` with ``window_size`` and ``sink_bias``; CUDA only, skipped
where fla-core does not import). Before an fla op's first timing, fla's op and ours (flex) are
each compared with the fp32 reference on one sequence of 2 * ``--window`` tokens, output and
every gradient; the relative errors go to the log and to each fla row's "check", and an fla op
further off than ``CHECK_TOLERANCE`` (2e-2 relative, or twice ours) is not timed.

Shapes: B = batch_tokens / T sequences, H heads for q, ``--kv-heads`` (default H) for k and v,
head dim D; bf16 q, k, v
and gates, fp32 sink and compression weights, as in the layers. Timing and memory as in
``benchmarks/kernels.py`` (whose measurement this script reuses): median of ``--reps`` calls
after ``--warmup``, each started on an idle GPU (so the time includes any wait for the host),
peak allocated memory over the timed calls, inputs included, and its ``--slow-call-s`` rule
for slow ops; fwd+bwd takes the gradients of every input. On CUDA, fwd+bwd is also timed with
``--reps`` calls issued back to back (``fwd_bwd_back_to_back_ms``: the host queues a call while
the GPU runs the one before, as in a training step). The first flex call of each shape compiles
(tens of seconds).
Results are written to ``--out`` after every op and T; with ``--resume`` a run keeps what
``--out`` holds and measures only the (op, T) rows missing from it.

    source benchmarks/gpu_setup.sh && python benchmarks/sparse_attention.py    # on the GPU machine
    python benchmarks/sparse_attention.py --device cpu --seq-lens 128,256 --batch-tokens 512 \\
        --heads 2 --head-dim 16 --window 32 --moba-block 32 --moba-top-k 2 --nsa 8,4,16,3,32 \\
        --dsa 16,2,8 --hca 16,32 --csa 4,8,32,2,8
"""
from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys

import torch
import torch.nn.functional as F

from megatron_ext.doctor import add_commit_argument
from megatron_ext.kernels import sparse
from megatron_ext.kernels.backends import fla_unavailable_reason
from megatron_ext.kernels.first_use import relative_error


def _kernel_benchmark():
    """benchmarks/kernels.py, for its Op, measure and environment (loaded by path: benchmarks/ is
    a folder of scripts, not a package)."""
    path = pathlib.Path(__file__).with_name("kernels.py")
    spec = importlib.util.spec_from_file_location("kernel_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _kernel_benchmark()
log = bench.log
# The inputs of each family (the gradients of all of them are taken).
INPUTS = {"swa_sink": ["q", "k", "v", "sink"], "causal_sink": ["q", "k", "v", "sink"],
          "moba": ["q", "k", "v"], "nsa": ["q", "k", "v", "gates", "k_weights", "v_weights"],
          "dsa": ["q", "k", "v", "sink", "index_q", "index_k", "index_weights"],
          "hca": ["q", "k", "v", "sink", "kv", "gate", "bias"],
          "csa": ["q", "k", "v", "sink", "kv2", "gate2", "bias2", "index_q", "index_kv", "index_gate",
                  "index_bias", "index_weights"],
          "fox": ["q", "k", "v", "log_forget"]}
BACKENDS = ["flex", "gathered"]
FLASH_FAMILIES = ["swa_sink", "causal_sink", "moba", "nsa", "dsa", "csa"]  # what "flash" runs
FLA_FAMILIES = ["swa_sink", "causal_sink"]  # what fla-core's parallel_attn runs
TRITON_FAMILIES = ["dsa", "csa"]  # what our selected-attention kernels run
# The largest relative error (output or any gradient) fla's op may have against the fp32
# reference, or twice our op's where that is larger. bf16 rounding gives a few 1e-3; a sink in
# log2 units instead of ln gives 0.35 in the sink's gradient, a wrong scale or layout order 1.
# One key more or less in the window gives 0.13 at a window of 32 but only 0.02 at 512 (T = 2W,
# measured with the reference): that convention is checked by reading fla's kernel (query i
# sees keys with i - j < window_size), and the timing would not depend on it.
CHECK_TOLERANCE = 2e-2


def make_inputs(args, family, batch, seq_len, heads, dim):
    device = torch.device(args.device)

    def randn(*shape):
        return torch.randn(*shape, device=device)

    compress_block = args.nsa[0]
    kv_heads = args.kv_heads
    _, index_heads, index_dim = args.dsa
    hca_rate, csa_rate = args.hca[0], args.csa[0]
    index_heads_csa, index_dim_csa = args.csa[3], args.csa[4]
    inputs = dict(
        kv=randn(batch, seq_len, kv_heads, dim).bfloat16(),
        gate=randn(batch, seq_len, kv_heads, dim).bfloat16(),
        bias=torch.zeros(kv_heads, hca_rate, dim, device=device),
        kv2=randn(batch, seq_len, kv_heads, 2 * dim).bfloat16(),
        gate2=randn(batch, seq_len, kv_heads, 2 * dim).bfloat16(),
        bias2=torch.zeros(kv_heads, csa_rate, 2 * dim, device=device),
        index_kv=randn(batch, seq_len, 1, 2 * index_dim_csa).bfloat16(),
        index_gate=randn(batch, seq_len, 1, 2 * index_dim_csa).bfloat16(),
        index_bias=torch.zeros(1, csa_rate, 2 * index_dim_csa, device=device),
        index_q=randn(batch, seq_len, *((index_heads_csa, index_dim_csa) if family == "csa"
                                        else (index_heads, index_dim))).bfloat16(),
        index_k=randn(batch, seq_len, index_dim).bfloat16(),
        index_weights=randn(batch, seq_len, index_heads_csa if family == "csa" else index_heads).bfloat16(),
        q=randn(batch, seq_len, heads, dim).bfloat16(),
        k=randn(batch, seq_len, kv_heads, dim).bfloat16(),
        v=randn(batch, seq_len, kv_heads, dim).bfloat16(), sink=randn(heads),
        gates=torch.sigmoid(randn(batch, seq_len, heads, 3)).bfloat16(),
        k_weights=torch.full((kv_heads, compress_block), 1 / compress_block, device=device),
        v_weights=torch.full((kv_heads, compress_block), 1 / compress_block, device=device),
        log_forget=F.logsigmoid(randn(batch, seq_len, heads) + 2))
    return {name: inputs[name] for name in INPUTS[family]}


def family_run(family, backend, args):
    """``run(**inputs) -> output`` of one op."""
    if backend == "fla":
        return functools.partial(fla_attention, window_size=args.window if family == "swa_sink" else None)
    compress_block, compress_stride, select_block, select_top_k, window = args.nsa
    calls = {
        "swa_sink": lambda x: sparse.softmax_attention(
            x["q"], x["k"], x["v"], window=(args.window - 1, 0), sink=x["sink"], backend=backend),
        "causal_sink": lambda x: sparse.softmax_attention(
            x["q"], x["k"], x["v"], sink=x["sink"], backend=backend),
        "moba": lambda x: sparse.moba_attention(
            x["q"], x["k"], x["v"], block_size=args.moba_block, top_k=args.moba_top_k,
            backend=backend),
        "nsa": lambda x: sparse.nsa_attention(
            x["q"], x["k"], x["v"], x["gates"], x["k_weights"], x["v_weights"],
            compress_block=compress_block, compress_stride=compress_stride,
            select_block=select_block, select_top_k=select_top_k, window=window,
            backend=backend),
        "dsa": lambda x: dsa_layer_op(x, args.dsa[0], backend),
        "hca": lambda x: hca_layer_op(x, *args.hca, backend),
        "csa": lambda x: csa_layer_op(x, *args.csa[:3], backend),
        "fox": lambda x: sparse.softmax_attention(
            x["q"], x["k"], x["v"], log_forget=x["log_forget"], backend=backend),
    }
    return lambda **x: calls[family](x)


def fla_attention(q, k, v, sink, window_size):
    """fla-core's parallel_attn in our conventions: the same layout [B, T, H, D] and scale
    (D ** -0.5); query i sees keys i - window_size + 1 .. i (ours: window=(window_size - 1, 0)),
    or every earlier key with None; sink_bias [H] (fp32) adds exp(sink) to the denominator, as
    our sink does."""
    from fla.ops.attn import parallel_attn

    return parallel_attn(q, k, v, window_size=window_size, sink_bias=sink)


def fla_unavailable(device: torch.device) -> str | None:
    """Why fla-core's parallel_attn cannot run here, or None (kernels.backends' rules)."""
    return fla_unavailable_reason("attn", device, requires_grad=True)


def fla_check(family, args) -> dict:
    """fla's op and ours (flex; gathered off CUDA), each against the fp32 reference on one
    sequence of 2 * window tokens (so that the window cuts) with the benchmark's heads and head
    dim: the relative error (Frobenius) of the output and of each input's gradient (of a fixed
    random projection of the output). "failed" says which of fla's exceeds the tolerance."""
    ours = "flex" if torch.device(args.device).type == "cuda" else "gathered"
    shape = (1, 2 * args.window, args.heads, args.head_dim)
    inputs = make_inputs(args, family, *shape)
    projection = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(inputs["q"])

    def output_and_grads(backend):
        leaves = {name: t.detach().clone().requires_grad_() for name, t in inputs.items()}
        out = family_run(family, backend, args)(**leaves)
        grads = torch.autograd.grad(out, list(leaves.values()), projection)
        return dict(out=out, **dict(zip(leaves, grads)))

    reference = output_and_grads("reference")
    errors = {backend: {name: relative_error(got, reference[name])
                        for name, got in output_and_grads(backend).items()}
              for backend in ("fla", ours)}
    limits = {name: max(CHECK_TOLERANCE, 2 * error) for name, error in errors[ours].items()}
    over = [f"{name} {errors['fla'][name]:.1e} > {limits[name]:.1e}"
            for name in limits if errors["fla"][name] > limits[name]]
    check = dict(against="fp32 reference", shape=list(shape), relative_errors=errors)
    if over:
        check["failed"] = "fla-core's op is off the reference: " + ", ".join(over)
    shown = "; ".join(f"{backend}: " + ", ".join(f"{name} {error:.1e}" for name, error in by_name.items())
                      for backend, by_name in errors.items())
    log(f"{family}/fla: check against the fp32 reference at [B, T, H, D] = {shape}, relative errors "
        f"{shown}: {'FAILED' if over else 'passed'}")
    return check


def dsa_layer_op(x, top_k, backend):
    """What a DSA layer runs in its sparse stage: the selection, the attention over it, and the
    indexer's loss on the selected keys, attached to the output as the layer attaches it."""
    from megatron_ext.mixers.dsa import IndexerLoss

    index = (x["index_q"], x["index_k"], x["index_weights"])
    rest = "auto" if backend == "flash" else backend  # "flash" is the attention's only
    selected = sparse.dsa_select(*index, top_k=top_k, backend=rest)
    out, lse = sparse.dsa_attention(x["q"], x["k"], x["v"], selected, sink=x["sink"],
                                    causal=True, backend=backend, return_lse=True)
    loss = sparse.dsa_indexer_loss(x["q"], x["k"], *index, selected=selected, sink=x["sink"],
                                   backend=rest, lse=lse)
    return IndexerLoss.apply(out, loss)


def hca_layer_op(x, rate, window, backend):
    """An HCA layer's attention: the compression of every block of ``rate`` tokens (per head),
    then one softmax over the window, the entries and the sink."""
    entries = sparse.compress_kv(x["kv"], x["gate"], x["bias"], rate=rate, overlap=False, backend=backend)
    return sparse.compressed_attention(x["q"], x["k"], x["v"], entries, entries, rate=rate,
                                       window=window, sink=x["sink"], backend=backend)


def csa_layer_op(x, rate, top_k, window, backend):
    """A CSA layer's sparse stage: the overlapping compression of values and of the indexer's
    keys, the selection, the attention over window + selected entries + sink, and the indexer
    loss attached to the output."""
    from megatron_ext.mixers.dsa import IndexerLoss

    rest = "auto" if backend == "flash" else backend  # "flash" is the attention's only
    entries = sparse.compress_kv(x["kv2"], x["gate2"], x["bias2"], rate=rate, overlap=True, backend=rest)
    index_k = sparse.compress_kv(x["index_kv"], x["index_gate"], x["index_bias"], rate=rate,
                                 overlap=True, backend=rest)[:, :, 0]
    index = (x["index_q"], index_k, x["index_weights"])
    selected = sparse.csa_select(*index, rate=rate, top_k=top_k, backend=rest)
    out, lse = sparse.csa_attention(x["q"], x["k"], x["v"], entries, entries, selected,
                                    window=window, sink=x["sink"], backend=backend, rate=rate,
                                    return_lse=True)
    loss = sparse.csa_indexer_loss(x["q"], entries, *index, rate=rate, selected=selected,
                                   sink=x["sink"], backend=rest, lse=lse)
    return IndexerLoss.apply(out, loss)


def build_ops(args) -> list:
    device = torch.device(args.device)
    fla_skip = fla_unavailable(device)
    ops = []
    for family in INPUTS:
        make = lambda *shape, family=family: make_inputs(args, family, *shape)  # noqa: E731
        for backend in BACKENDS:
            skip = None
            if backend == "flex" and device.type != "cuda":
                skip = "FlexAttention has no backward on the CPU"
            if backend == "gathered" and family == "fox":
                skip = "the gathered form does not take forget gates"
            ops.append(bench.Op(family, backend, make, family_run(family, backend, args), skip))
        if family in FLASH_FAMILIES:
            skip = None if device.type == "cuda" else "FlashAttention runs on CUDA only"
            ops.append(bench.Op(family, "flash", make, family_run(family, "flash", args), skip))
        if family in TRITON_FAMILIES:
            skip = None if device.type == "cuda" else "the Triton kernels run on CUDA only"
            ops.append(bench.Op(family, "triton", make, family_run(family, "triton", args), skip))
        if family in FLA_FAMILIES:
            check = functools.cache(functools.partial(fla_check, family, args))
            ops.append(bench.Op(family, "fla", make, family_run(family, "fla", args), fla_skip, check))
    ops.append(bench.Op("sdpa", "torch",
                        lambda *shape: bench.sdpa_inputs(*shape, device, args.kv_heads),
                        lambda **x: F.scaled_dot_product_attention(
                            x["q"], x["k"], x["v"], is_causal=True,
                            enable_gqa=x["k"].shape[1] < x["q"].shape[1])))
    return ops


def plot(record: dict, path: pathlib.Path) -> None:
    """fwd+bwd time (solid; fwd dashed) and peak memory against T, one line per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in record["results"] if "fwd_ms" in r})
    with_memory = any(r.get("fwd_bwd_peak_gib") for r in record["results"])
    fig, axes = plt.subplots(1, 2 if with_memory else 1, figsize=(13 if with_memory else 7, 5),
                             squeeze=False)
    for index, op in enumerate(ops):
        rows = sorted((r for r in record["results"] if r["op"] == op), key=lambda r: r["seq_len"])
        color = f"C{index % 10}"
        for key, style, label in (("fwd_bwd_ms", "-", op), ("fwd_ms", "--", None)):
            points = [(r["seq_len"], r[key]) for r in rows if key in r]
            if points:
                axes[0, 0].plot(*zip(*points), style, color=color, marker="o", label=label)
        memory = [(r["seq_len"], r["fwd_bwd_peak_gib"]) for r in rows if r.get("fwd_bwd_peak_gib")]
        if with_memory and memory:
            axes[0, 1].plot(*zip(*memory), "-", color=color, marker="o", label=op)
    axes[0, 0].set(xscale="log", yscale="log", xlabel="T (B = batch_tokens / T)",
                   ylabel="ms (median): fwd+bwd solid, fwd dashed")
    if with_memory:
        axes[0, 1].set(xscale="log", xlabel="T", ylabel="peak GiB, fwd+bwd (inputs included)")
    for axis in axes[0]:
        axis.legend(fontsize=7)
        axis.grid(alpha=0.3)
    s = record["settings"]
    fig.suptitle(f"{record['device']}: B*T = {s['batch_tokens']}, H = {s['heads']}, "
                 f"Hkv = {s.get('kv_heads') or s['heads']}, "
                 f"D = {s['head_dim']}, window {s['window']}, MoBA {s['moba_block']}/top-"
                 f"{s['moba_top_k']}, NSA {s['nsa']}, bf16", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summary(record: dict) -> None:
    """Each op's fwd+bwd time as a fraction of SDPA's at the same T; on CUDA also with the calls
    issued back to back (the host ahead of the GPU, as in training)."""
    rows = record["results"]
    sdpa = {r["seq_len"]: r for r in rows if r["op"] == "sdpa/torch"}
    for r in rows:
        base = sdpa.get(r["seq_len"], {})
        if r["op"] != "sdpa/torch" and r.get("fwd_bwd_ms") and base.get("fwd_bwd_ms"):
            line = (f"{r['op']} T={r['seq_len']}: fwd+bwd {r['fwd_bwd_ms']:.2f} ms = "
                    f"{r['fwd_bwd_ms'] / base['fwd_bwd_ms']:.2f}x SDPA")
            if r.get("fwd_bwd_back_to_back_ms") and base.get("fwd_bwd_back_to_back_ms"):
                line += (f" (back to back {r['fwd_bwd_back_to_back_ms']:.2f} ms = "
                         f"{r['fwd_bwd_back_to_back_ms'] / base['fwd_bwd_back_to_back_ms']:.2f}x)")
            log(f"{line}, peak {r.get('fwd_bwd_peak_gib') or float('nan'):.2f} GiB")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="4096,16384,32768", help="comma-separated T values")
    parser.add_argument("--batch-tokens", type=int, default=32768,
                        help="B * T, the same for every T")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int,
                        help="key/value heads (default: --heads); fewer share them among groups "
                             "of query heads, for every op, SDPA included")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--window", type=int, default=512, help="swa_sink: tokens in the window (the fla check runs T = 2 * window)")
    parser.add_argument("--moba-block", type=int, default=512)
    parser.add_argument("--moba-top-k", type=int, default=3)
    parser.add_argument("--nsa", default="32,16,64,16,512",
                        help="compress block, stride, select block, top-k, window")
    parser.add_argument("--profile", action="store_true",
                        help="also profile one fwd+bwd call: GPU time per kernel, host time "
                             "per op")
    parser.add_argument("--dsa", default="2048,64,128",
                        help="dsa: top-k, indexer heads, indexer dim (the paper's)")
    parser.add_argument("--hca", default="128,128", help="hca: compression rate, window (V4's)")
    parser.add_argument("--csa", default="4,512,128,64,128",
                        help="csa: compression rate, top-k, window, indexer heads, indexer dim (V4's)")
    parser.add_argument("--ops", default="all",
                        help="comma-separated families, backends or ops (default: all)")
    parser.add_argument("--warmup", type=int, help="untimed calls first (default: 2; 1 on CPU)")
    parser.add_argument("--reps", type=int, help="timed calls (default: 10; 3 on CPU)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="benchmarks/results/sparse_attention_h200.json")
    add_commit_argument(parser)
    parser.add_argument("--resume", action="store_true",
                        help="keep the results already in --out and measure only what is missing "
                             "(to finish a run that was cut short, or to add ops)")
    bench.add_slow_call_argument(parser)
    args = bench.finish_timing_args(parser, parser.parse_args(argv))
    args.kv_heads = args.kv_heads or args.heads
    if args.heads % args.kv_heads:
        parser.error(f"--kv-heads {args.kv_heads} must divide --heads {args.heads}")
    args.nsa = [int(value) for value in args.nsa.split(",")]
    if len(args.nsa) != 5:
        parser.error("--nsa takes 5 numbers: compress block, stride, select block, top-k, window")
    for name, count in (("dsa", 3), ("hca", 2), ("csa", 5)):
        values = [int(value) for value in getattr(args, name).split(",")]
        if len(values) != count:
            parser.error(f"--{name} takes {count} numbers (see --help)")
        setattr(args, name, values)
    return args


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    ops = bench.select_ops(build_ops(args), args.ops)
    out = pathlib.Path(args.out)
    log(f"{len(ops)} ops x T in {args.seq_lens}")
    record = bench.measure_all(ops, args, bench.environment(device, args.commit), out)
    summary(record)
    plot(record, out.with_suffix(".png"))
    log(f"wrote {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
