"""CUDA checks (skipped without a GPU) of the sparse attention ops (window and sink, MoBA, NSA,
HCA's attention over its window and compressed entries, FoX's forget gates): compiled
FlexAttention and the gathered path, forward and backward, against the dense fp32 reference,
at lengths that span several 128-token blocks and are multiples of none of the block sizes;
and bf16 inputs. Also
DeepSeek-V4's KV compression, which runs compiled on CUDA (``compress_kv``).

fp32 tolerances as on the CPU (1e-4 relative, 1e-5 absolute; TF32 is off in PyTorch's default
matmul precision for fp32). bf16: the kernels round probabilities and outputs to bf16, each
costing at most 2^-8 of max |v|, as in test_cuda_paths."""

import pytest
import torch

from megatron_ext.kernels import sparse

pytestmark = pytest.mark.gpu

B, HQ, HKV, D = 2, 4, 2, 64
NSA = dict(compress_block=32, compress_stride=16, select_block=64, select_top_k=5, window=100)

CASES = {
    "window+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], window=(150, 0), sink=x["sink"], **kw),
    "causal+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], sink=x["sink"], **kw),
    "moba+sink": lambda x, **kw: sparse.moba_attention(
        x["q"], x["k"], x["v"], block_size=96, top_k=3, sink=x["sink"], **kw),
    "nsa+sink": lambda x, **kw: sparse.nsa_attention(
        x["q"], x["k"], x["v"], x["gates"], x["k_weights"], x["v_weights"], sink=x["sink"],
        **NSA, **kw),
    "hca+sink": lambda x, **kw: sparse.compressed_attention(
        x["q"], x["k"], x["v"], x["entries_k"], x["entries_v"], rate=HCA_RATE, window=64,
        sink=x["sink"], **kw),
}
HCA_RATE = 32  # HCA's entries: one per complete block of 32 tokens
# The Forgetting Transformer's forget gates: FlexAttention (a score_mod) or the reference only.
FOX_CASES = {
    "fox": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], log_forget=x["log_forget"], **kw),
    "fox+window+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], window=(150, 0), sink=x["sink"], log_forget=x["log_forget"],
        **kw),
}
CASES.update(FOX_CASES)


def _inputs(seq, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = dict(q=(B, seq, HQ, D), k=(B, seq, HKV, D), v=(B, seq, HKV, D), sink=(HQ,))
    x = {name: torch.randn(shape, device="cuda", generator=g) for name, shape in shapes.items()}
    x["gates"] = torch.rand(B, seq, HQ, 3, device="cuda", generator=g)
    x["k_weights"] = torch.rand(HKV, NSA["compress_block"], device="cuda", generator=g)
    x["v_weights"] = torch.rand(HKV, NSA["compress_block"], device="cuda", generator=g)
    for name in ("entries_k", "entries_v"):
        x[name] = torch.randn(B, seq // HCA_RATE, HKV, D, device="cuda", generator=g)
    x["log_forget"] = torch.nn.functional.logsigmoid(
        torch.randn(B, seq, HQ, device="cuda", generator=g) + 2)
    return {name: t.to(dtype).requires_grad_() for name, t in x.items()}


def _run(case, backend, x):
    for t in x.values():
        t.grad = None
    out = CASES[case](x, backend=backend)
    g = torch.Generator(device="cuda").manual_seed(1)
    weights = torch.randn(out.shape, device="cuda", generator=g)
    (out.float() * weights).sum().backward()
    return out.detach().float(), {n: t.grad.float() for n, t in x.items() if t.grad is not None}


@pytest.mark.parametrize("backend", ["flex", "gathered"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("seq", [300, 1000])
def test_fp32_matches_reference(case, backend, seq):
    if case in FOX_CASES and backend == "gathered":
        pytest.skip("the gathered form does not take forget gates")
    x = _inputs(seq)
    expected, expected_grads = _run(case, "reference", x)
    out, grads = _run(case, backend, x)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    for name in expected_grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-4,
                                   msg=f"grad of {name}")


# NSA's bf16 path rounds its compressed keys and values to bf16 (the compression's output) and
# ranks the selection blocks with them, so it is further from the fp32 reference than the
# output's rounding: on these inputs (H200) 0.137 against the 0.054 bound, 4 of 4000 (row,
# key/value head) choosing another block, and 0.082 on rows whose choice agrees.
NSA_BF16 = pytest.mark.xfail(strict=True, reason="NSA's compressed keys are rounded to bf16 "
                             "before its scores and its selection; see the comment above")


@pytest.mark.parametrize("case", [pytest.param(c, marks=NSA_BF16) if c == "nsa+sink" else c
                                  for c in CASES])
def test_bf16_flex_close_to_fp32_reference(case):
    x = _inputs(1000, torch.bfloat16)
    out = CASES[case](x, backend="flex")
    assert out.dtype == torch.bfloat16
    with torch.no_grad():
        expected = CASES[case]({n: t.float() for n, t in x.items()}, backend="reference")
    err = (out.float() - expected).abs().max().item()
    assert err <= 3 * 2**-8 * x["v"].float().abs().max().item(), err


def test_small_head_dim_auto_runs_gathered_and_flex_refuses():
    """FlexAttention's CUDA kernels need head dims >= 16: at 8, "auto" runs the gathered path
    (equal to the reference) and an explicit "flex" says why it cannot."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, 40, HQ if i == 0 else HKV, 8, device="cuda", generator=g)
               for i in range(3))
    out = sparse.moba_attention(q, k, v, block_size=16, top_k=2, backend="auto")
    expected = sparse.moba_attention(q, k, v, block_size=16, top_k=2, backend="reference")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="head dim of at least 16"):
        sparse.moba_attention(q, k, v, block_size=16, top_k=2, backend="flex")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("overlap,rate", [(False, 32), (True, 4)])
def test_compiled_compression_matches_reference(overlap, rate, packed, dtype):
    """compress_kv on CUDA (torch.compile'd arithmetic; blocks as a view of the tokens, or
    gathered per entry for packed sequences) against the fp32 reference, forward and backward,
    on 1000 tokens (a partial last block; packed: three sequences of lengths no multiple of
    the rate). bf16: the inputs rounded, the fp32 arithmetic of both the same but for order."""
    g = torch.Generator(device="cuda").manual_seed(2)
    rows, channels = (1 if packed else B), (2 * D if overlap else D)
    cu_seqlens = torch.tensor([0, 333, 701, 1000], device="cuda") if packed else None
    x = {"kv": torch.randn(rows, 1000, HKV, channels, device="cuda", generator=g).to(dtype),
         "gate": torch.randn(rows, 1000, HKV, channels, device="cuda", generator=g).to(dtype),
         "bias": torch.randn(HKV, rate, channels, device="cuda", generator=g)}
    results = []
    for backend, cast in (("reference", torch.float32), ("auto", dtype)):
        leaves = {n: t.detach().to(cast if n != "bias" else torch.float32).requires_grad_()
                  for n, t in x.items()}
        out = sparse.compress_kv(leaves["kv"], leaves["gate"], leaves["bias"], rate=rate,
                                 overlap=overlap, cu_seqlens=cu_seqlens, backend=backend)
        weights = torch.randn(out.shape, device="cuda", generator=torch.Generator(
            device="cuda").manual_seed(3))
        grads = torch.autograd.grad((out.float() * weights).sum(), list(leaves.values()))
        results.append([out.float(), *(grad.float() for grad in grads)])
    # fp32: the same sums in another order; bf16: the output and gradients rounded once
    rtol, atol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 2e-2)
    for name, got, want in zip(("out", "kv", "gate", "bias"), *results[::-1]):
        scale = max(1.0, want.abs().max().item())
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol * scale, msg=name)
