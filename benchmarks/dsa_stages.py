"""Where a DSA layer's sparse stage spends its time: the selection (``dsa_select``: the
indexer's scores, in Triton on CUDA, and the top-k), the attention over it (``dsa_attention``,
forward and forward+backward, on each backend of ``--attention``: "triton", our kernels that
gather each query's keys; "flex", FlexAttention over the selection's bitmap, whose making is
also timed alone as ``flex_bitmap``; "flash", cuDNN's fused attention with the selection as a
bias; every backend told the selection is causal) and the indexer loss (``dsa_indexer_loss`` on the
selected keys, forward and forward+backward, on the backend "auto" picks: on CUDA our Triton
kernels once their first-use check passed; with "flash" among the backends also as
``loss_given_lse``, given the log-sum-exp that cuDNN's attention returns, as the DSA layer
gives it), each timed alone.

Shapes as ``benchmarks/sparse_attention.py``'s dsa op: B = batch_tokens / T, H heads for q and
(``--kv-heads``, default H) for k and v, head dim D, bf16; ``--dsa`` = top-k, indexer heads,
indexer dim (the paper's 2048,64,128). Each stage: the fastest of ``--reps`` calls after one
untimed call, from an idle GPU.

    source benchmarks/gpu_setup.sh && python benchmarks/dsa_stages.py     # on the GPU machine
    python benchmarks/dsa_stages.py --device cpu --seq-lens 128 --batch-tokens 512 --heads 2 \\
        --head-dim 16 --dsa 16,2,8
"""
from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from megatron_ext.doctor import add_commit_argument, stamp
from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse import layout


def fastest_ms(fn, device: torch.device, reps: int) -> float:
    """The fastest of ``reps`` calls of ``fn`` after one untimed call, in ms."""
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def stages(seq_len: int, args) -> dict[str, float]:
    """The stages' ms at one T."""
    device = torch.device(args.device)
    batch = args.batch_tokens // seq_len
    top_k, index_heads, index_dim = args.dsa

    def leaf(*shape):
        return torch.randn(*shape, device=device).bfloat16().requires_grad_()

    q = leaf(batch, seq_len, args.heads, args.head_dim)
    k, v = (leaf(batch, seq_len, args.kv_heads, args.head_dim) for _ in range(2))
    index = (leaf(batch, seq_len, index_heads, index_dim), leaf(batch, seq_len, index_dim),
             leaf(batch, seq_len, index_heads))
    sink = torch.randn(args.heads, device=device, requires_grad=True)
    selected = sparse.dsa_select(*index, top_k=top_k)

    def attention(backend):
        return lambda: sparse.dsa_attention(q, k, v, selected, sink=sink, causal=True,
                                            backend=backend)

    def loss(lse=None):
        return sparse.dsa_indexer_loss(q, k, *index, selected=selected, sink=sink, lse=lse)

    calls = {"select": lambda: sparse.dsa_select(*index, top_k=top_k)}
    for backend in args.attention:
        calls[f"{backend}_attention_fwd"] = attention(backend)
        calls[f"{backend}_attention_fwd_bwd"] = lambda run=attention(backend): run().sum().backward()
    if "flex" in args.attention:
        calls["flex_bitmap"] = lambda: layout.key_selection_layout(selected, seq_len, 128, 128)
    calls.update(loss_fwd=loss, loss_fwd_bwd=lambda: loss().backward())
    if "flash" in args.attention:
        with torch.no_grad():
            _, lse = sparse.dsa_attention(q, k, v, selected, sink=sink, causal=True,
                                          backend="flash", return_lse=True)
        calls.update(loss_given_lse_fwd=lambda: loss(lse),
                     loss_given_lse_fwd_bwd=lambda: loss(lse).backward())
    return {name: round(fastest_ms(fn, device, args.reps), 2) for name, fn in calls.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", default="4096,16384", help="comma-separated T values")
    parser.add_argument("--batch-tokens", type=int, default=32768, help="B * T, for every T")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, help="key/value heads (default: --heads)")
    parser.add_argument("--attention",
                        help="the attention's backends to time, of auto, triton, flex and "
                             "flash (default: triton,flex on CUDA, else auto)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dsa", default="2048,64,128", help="top-k, indexer heads, indexer dim")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", help="also write the results here (JSON)")
    add_commit_argument(parser)
    args = parser.parse_args(argv)
    args.dsa = [int(value) for value in args.dsa.split(",")]
    args.kv_heads = args.kv_heads or args.heads
    args.attention = (args.attention or ("triton,flex" if args.device == "cuda" else "auto")
                      ).split(",")
    if len(args.dsa) != 3:
        parser.error("--dsa takes 3 numbers: top-k, indexer heads, indexer dim")
    results = []
    for seq_len in (int(value) for value in args.seq_lens.split(",")):
        ms = stages(seq_len, args)
        results.append({"seq_len": seq_len, "batch": args.batch_tokens // seq_len, **ms})
        print(f"DSA T={seq_len} B={args.batch_tokens // seq_len} H={args.heads} on {args.kv_heads}: "
              + ", ".join(f"{name} {value:.1f} ms" for name, value in ms.items()), flush=True)
        if args.device == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(
            {"environment": stamp(args.commit),
             "settings": {k: v for k, v in vars(args).items() if k not in ("out", "commit")},
             "results": results}, indent=1))


if __name__ == "__main__":
    main()
