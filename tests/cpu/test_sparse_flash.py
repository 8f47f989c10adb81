"""kernels/sparse/flash.py on the CPU: the sink and its gradients around the FlashAttention
kernels, with the two kernels replaced by a PyTorch emulation of what FlashAttention-2 computes
(the forward's output and natural-log log-sum-exp ``[H, total]``; the backward's gradients from
the output and log-sum-exp it is given, with ``D = rowsum(dO * O)``), against the fp32
reference, in fp64. The kernels themselves run in tests/gpu/test_sparse_flash.py.
"""
import pytest
import torch

from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse import flash
from megatron_ext.kernels.selfcheck import relative_error
from megatron_ext.kernels.sparse.reference import softmax_attention_reference


def _visible(cu_seqlens, causal, left, right):
    """bool ``[total, total]``: key j is in query i's sequence and window."""
    total = int(cu_seqlens[-1])
    ids = torch.searchsorted(cu_seqlens[1:], torch.arange(total), right=True)
    offset = torch.arange(total)[None, :] - torch.arange(total)[:, None]
    mask = ids[:, None] == ids[None, :]
    if causal:
        right = 0
    if left >= 0:
        mask &= offset >= -left
    if right >= 0:
        mask &= offset <= right
    return mask


def _scores(q, k, cu_seqlens, causal, left, right, scale):
    """Scaled scores ``[H, total, total]`` (-inf where not visible); k repeated per group."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = scale * torch.einsum("ihd,jhd->hij", q, k)
    return scores.masked_fill(~_visible(cu_seqlens, causal, left, right), float("-inf")), scale


def emulated_forward(q, k, v, cu_seqlens, max_len, causal, left, right, scale):
    scores, _ = _scores(q, k, cu_seqlens, causal, left, right, scale)
    lse = torch.logsumexp(scores, dim=-1)  # [H, total]
    probs = torch.exp(scores - lse[..., None])
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.einsum("hij,jhd->ihd", probs, v).to(q.dtype), lse


def emulated_backward(d_out, q, k, v, out, lse, cu_seqlens, max_len, causal, left, right, scale):
    scores, scale = _scores(q, k, cu_seqlens, causal, left, right, scale)
    group = q.shape[1] // k.shape[1]
    probs = torch.exp(scores - lse[..., None])  # recomputed from the lse given
    v_rep = v.repeat_interleave(group, dim=1)
    k_rep = k.repeat_interleave(group, dim=1)
    d_probs = torch.einsum("ihd,jhd->hij", d_out, v_rep)
    delta = (d_out * out).sum(-1).t()  # [H, total], from the output given
    d_scores = probs * (d_probs - delta[..., None])
    dq = scale * torch.einsum("hij,jhd->ihd", d_scores, k_rep)
    dk = scale * torch.einsum("hij,ihd->jhd", d_scores, q)
    dv = torch.einsum("hij,ihd->jhd", probs, d_out)

    def per_kv_head(x):
        return x.unflatten(1, (k.shape[1], group)).sum(2)

    return dq, per_kv_head(dk), per_kv_head(dv)


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(flash, "_kernel_forward", emulated_forward)
    monkeypatch.setattr(flash, "_kernel_backward", emulated_backward)


def _outputs_and_grads(run, leaves, grad, **options):
    inputs = {name: x.clone().requires_grad_() for name, x in leaves.items()}
    out = run(inputs["q"], inputs["k"], inputs["v"], sink=inputs.get("sink"), **options)
    return [out, *torch.autograd.grad(out, list(inputs.values()), grad)]


CALLS = [
    dict(batch=2, seq_len=45, causal=True, window=None, sink=True),
    dict(batch=2, seq_len=45, causal=True, window=(6, 0), sink=True),
    dict(batch=1, seq_len=45, causal=False, window=(5, 3), sink=True),
    dict(batch=1, seq_len=45, causal=False, window=None, sink=False),
    dict(batch=1, seq_len=50, causal=True, window=(7, 0), sink=True, cu_seqlens=[0, 13, 13, 50]),
]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_sink_and_gradients_equal_the_reference(emulated, call):
    generator = torch.Generator().manual_seed(0)
    batch, seq_len = call["batch"], call["seq_len"]

    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    leaves = {"q": randn(batch, seq_len, 4, 8), "k": randn(batch, seq_len, 2, 8),
              "v": randn(batch, seq_len, 2, 8)}
    if call["sink"]:
        leaves["sink"] = randn(4)
    cu_seqlens = call.get("cu_seqlens")
    options = dict(causal=call["causal"], window=call["window"],
                   cu_seqlens=None if cu_seqlens is None else torch.tensor(cu_seqlens))
    grad = randn(batch, seq_len, 4, 8)
    got = _outputs_and_grads(flash.flash_attention, leaves, grad, **options)
    want = _outputs_and_grads(softmax_attention_reference, leaves, grad, **options)
    for name, a, b in zip(["o", *leaves], got, want):  # the reference computes in fp32
        assert relative_error(a, b) < 1e-6, name


def test_a_sink_of_minus_infinity_is_plain_softmax(emulated):
    generator = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 30, 2, 8, generator=generator, dtype=torch.float64) for _ in range(3))
    sink = torch.full((2,), float("-inf"), dtype=torch.float64, requires_grad=True)
    out = flash.flash_attention(q, k, v, sink=sink)
    (d_sink,) = torch.autograd.grad(out.sum(), sink)
    torch.testing.assert_close(out, flash.flash_attention(q, k, v), rtol=0, atol=0)
    assert torch.equal(d_sink, torch.zeros_like(d_sink))


def test_flash_refuses_what_it_does_not_cover():
    def qkv(dtype=torch.bfloat16, dim=16, keys=10):
        return (torch.zeros(1, 10, 2, dim, dtype=dtype), torch.zeros(1, keys, 2, dim, dtype=dtype),
                torch.zeros(1, keys, 2, dim, dtype=dtype))

    assert "fp16 or bf16" in flash.unavailable_reason(*qkv(torch.float32))
    assert "multiples of 8" in flash.unavailable_reason(*qkv(dim=12))
    assert "not as long" in flash.unavailable_reason(*qkv(keys=11))
    assert "extra mask" in flash.unavailable_reason(*qkv(), allowed=torch.ones(1, 1, 10, 10, dtype=torch.bool))
    assert flash.unavailable_reason(*qkv()) == "FlashAttention runs on CUDA only"
    with pytest.raises(ValueError, match="backend='flash' cannot run this call: FlashAttention runs on CUDA only"):
        sparse.softmax_attention(*qkv(), backend="flash")
