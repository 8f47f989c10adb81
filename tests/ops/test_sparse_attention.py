"""Windowed / sink / sparse softmax attention ops (megatron_ext.kernels.sparse): the gathered
backend against the dense fp32 reference, forward and backward; FlexAttention's forward and
block mask on the CPU; causality; the sink; XSA; the Forgetting Transformer's forget gates.

Lengths (37) are multiples of none of the block sizes (MoBA 5, NSA 4/2/8, layout blocks 8 x 4
and the default 64 x 64). fp32 throughout; both paths accumulate the same products in a
different order, so they agree to ~1e-6; 1e-4 relative / 1e-5 absolute leaves room and still
catches a wrong mask (errors of order 1e-1).
"""
import itertools
import math

import pytest
import torch

from megatron_ext.kernels import sparse
from megatron_ext.kernels.sparse import flex, gathered, reference
from megatron_ext.kernels.sparse.flex import block_mask
from megatron_ext.kernels.sparse.layout import BlockLayout, interval_layout

B, T, HQ, HKV, D = 2, 37, 4, 2, 8
NSA = dict(compress_block=4, compress_stride=2, select_block=8, select_top_k=4, window=6)


def _inputs(seed=0, length=T):
    g = torch.Generator().manual_seed(seed)
    tensors = dict(q=torch.randn(B, length, HQ, D, generator=g),
                   k=torch.randn(B, length, HKV, D, generator=g),
                   v=torch.randn(B, length, HKV, D, generator=g),
                   sink=torch.randn(HQ, generator=g),
                   gates=torch.rand(B, length, HQ, 3, generator=g),
                   k_weights=torch.rand(HKV, NSA["compress_block"], generator=g),
                   v_weights=torch.rand(HKV, NSA["compress_block"], generator=g))
    return {name: t.requires_grad_() for name, t in tensors.items()}


# name -> op(inputs, **kwargs); every case uses q, k, v and the sink where it says so.
CASES = {
    "window+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], window=(5, 0), sink=x["sink"], **kw),
    "causal+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], sink=x["sink"], **kw),
    "bidirectional window": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], causal=False, window=(3, 2), **kw),
    "packed+window+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"][:1], x["k"][:1], x["v"][:1], window=(6, 0), sink=x["sink"],
        cu_seqlens=torch.tensor([0, 11, 30, T]), **kw),
    "mask+sink": lambda x, **kw: sparse.softmax_attention(
        x["q"], x["k"], x["v"], sink=x["sink"],
        allowed=torch.rand(B, 1, T, T, generator=torch.Generator().manual_seed(5)) > 0.3, **kw),
    "moba": lambda x, **kw: sparse.moba_attention(
        x["q"], x["k"], x["v"], block_size=5, top_k=3, **kw),
    "moba+window+sink": lambda x, **kw: sparse.moba_attention(
        x["q"], x["k"], x["v"], block_size=5, top_k=3, window=(12, 0), sink=x["sink"], **kw),
    "nsa": lambda x, **kw: sparse.nsa_attention(
        x["q"], x["k"], x["v"], x["gates"], x["k_weights"], x["v_weights"], **NSA, **kw),
    "nsa+sink": lambda x, **kw: sparse.nsa_attention(
        x["q"], x["k"], x["v"], x["gates"], x["k_weights"], x["v_weights"], sink=x["sink"],
        **NSA, **kw),
}


def _run(case, backend, inputs, layout_blocks=None):
    """Output and the gradients of a fixed random projection of it, per input."""
    for t in inputs.values():
        t.grad = None
    out = CASES[case](inputs, backend=backend, layout_blocks=layout_blocks)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * weights).sum().backward()
    return out.detach(), {name: t.grad for name, t in inputs.items() if t.grad is not None}


def _assert_gathered_matches_reference(case, layout_blocks):
    inputs = _inputs()
    expected, expected_grads = _run(case, "reference", inputs)
    out, grads = _run(case, "gathered", inputs, layout_blocks)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    assert grads.keys() == expected_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-4, atol=1e-5,
                                   msg=f"grad of {name}")


@pytest.mark.parametrize("layout_blocks", [(8, 4), None])
@pytest.mark.parametrize("case", list(CASES))
def test_gathered_matches_reference(case, layout_blocks):
    _assert_gathered_matches_reference(case, layout_blocks)


@pytest.mark.parametrize("case", ["window+sink", "moba+window+sink", "nsa+sink"])
def test_gathered_in_many_chunks_matches_reference(case, monkeypatch):
    """Few scores per chunk: query blocks run (and are recomputed in backward) chunk by chunk."""
    monkeypatch.setattr(gathered, "MAX_SCORES", 256)
    _assert_gathered_matches_reference(case, (8, 4))


@pytest.mark.parametrize("case", list(CASES))
def test_flex_forward_matches_reference_on_cpu(case):
    """torch 2.11's FlexAttention runs on the CPU without grad (unfused, rule only)."""
    inputs = _inputs()
    with torch.no_grad():
        expected = CASES[case](inputs, backend="reference")
        out = CASES[case](inputs, backend="flex", layout_blocks=(8, 4))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_flex_refuses_cpu_backward_clearly():
    with pytest.raises(RuntimeError, match="backend 'flex' cannot run.*backend='gathered'"):
        CASES["window+sink"](_inputs(), backend="flex")


def test_flex_block_mask_is_the_layout():
    """What the CUDA kernel skips by: the BlockMask's blocks are the layout's, a layout per
    key/value group repeated over its query heads."""
    active = torch.rand(B, HKV, 5, 10, generator=torch.Generator().manual_seed(2)) > 0.5
    layout = BlockLayout(8, 4, active, lambda b, h, q, kv: kv <= q)
    dense = block_mask(layout, HQ, T, T).to_dense()
    torch.testing.assert_close(dense.bool(), active.repeat_interleave(HQ // HKV, dim=1))


def test_flex_repeats_grouped_heads_only_for_dense_columns(monkeypatch):
    """A layout with ``dense_columns`` runs FlexAttention on the key/value heads repeated per
    query head (flex.py), to the grouped call's result; other layouts run grouped."""
    repeated = []
    repeat_heads = flex._repeat_heads
    monkeypatch.setattr(flex, "_repeat_heads",
                        lambda t, group: repeated.append(group) or repeat_heads(t, group))
    x = {name: t.detach() for name, t in _inputs().items()}
    rule = lambda b, h, q, kv: kv <= q  # noqa: E731
    out = {dense: flex.flex_attention_layout(
        x["q"], x["k"], x["v"], interval_layout(T, T, 8, 4, torch.zeros_like, lambda t: t, rule,
                                                "cpu", dense_columns=dense), sink=x["sink"])
        for dense in (False, True)}
    assert repeated == [HQ // HKV] * 2  # k and v, once, for the dense layout
    torch.testing.assert_close(out[True], out[False], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[True], CASES["causal+sink"](x, backend="reference"),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("case", [case for case in CASES if case != "bidirectional window"])
@pytest.mark.parametrize("backend", ["reference", "gathered"])
def test_future_tokens_do_not_change_earlier_outputs(case, backend):
    first_changed = 21
    inputs = {name: t.detach() for name, t in _inputs().items()}
    before = CASES[case](inputs, backend=backend)
    for name in ("q", "k", "v", "gates"):
        inputs[name] = inputs[name].clone()
        inputs[name][:, first_changed:] += 3 * torch.randn_like(inputs[name][:, first_changed:])
    after = CASES[case](inputs, backend=backend)
    torch.testing.assert_close(after[:, :first_changed], before[:, :first_changed], rtol=1e-5,
                               atol=1e-6)
    assert not torch.allclose(after[:, first_changed:], before[:, first_changed:])


@pytest.mark.parametrize("backend", ["reference", "gathered", "flex"])
@pytest.mark.parametrize("case", ["window+sink", "moba+window+sink", "nsa+sink"])
def test_sink_of_minus_infinity_is_plain_softmax(case, backend):
    inputs = {name: t.detach() for name, t in _inputs().items()}
    without = dict(inputs, sink=None)
    plain = CASES[case](without, backend=backend)
    inputs["sink"] = torch.full((HQ,), float("-inf"))
    torch.testing.assert_close(CASES[case](inputs, backend=backend), plain, rtol=1e-6, atol=1e-6)


def test_sink_joins_the_denominator():
    """One query, two keys: p_i = exp(z_i) / (exp(z_1) + exp(z_2) + exp(sink))."""
    q = torch.tensor([1.0, 0.0]).view(1, 1, 1, 2)
    k = torch.tensor([[2.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    v = torch.tensor([[1.0, 0.0], [0.0, 1.0]]).view(1, 2, 1, 2)
    sink = torch.tensor([0.5])
    out = reference.masked_attention(q, k, v, torch.ones(1, 2, dtype=torch.bool), sink=sink,
                                     scale=1.0)
    denominator = math.exp(2.0) + math.exp(0.0) + math.exp(0.5)
    expected = torch.tensor([math.exp(2.0), math.exp(0.0)]) / denominator
    torch.testing.assert_close(out.flatten(), expected)


def test_xsa_output_is_orthogonal_to_own_value():
    inputs = {name: t.detach() for name, t in _inputs().items()}
    out = CASES["window+sink"](inputs, backend="gathered")
    z = sparse.exclusive_self_attention(out, inputs["v"])
    own = inputs["v"].repeat_interleave(HQ // HKV, dim=2)  # each query head's group value
    # Relative to |y| |v|: the first token sees only itself, so its y is parallel to v and z ~ 0.
    along_v = (z * own).sum(-1) / (out.norm(dim=-1) * own.norm(dim=-1))
    assert along_v.abs().max() < 1e-5
    # What is removed is only the component along v: z + c v = y for some c per head and token.
    residual = out - z
    parallel = (residual * own).sum(-1, keepdim=True) / own.square().sum(-1, keepdim=True) * own
    torch.testing.assert_close(residual, parallel, rtol=1e-4, atol=1e-5)


def test_top_k_beyond_the_blocks_fails_clearly():
    x = {name: t.detach() for name, t in _inputs().items()}
    with pytest.raises(ValueError, match=r"top_k=9 is more than the 8 blocks"):
        sparse.moba_attention(x["q"], x["k"], x["v"], block_size=5, top_k=9)
    with pytest.raises(ValueError, match=r"top_k=6 is more than the 5 blocks"):
        sparse.nsa_attention(x["q"], x["k"], x["v"], x["gates"], x["k_weights"], x["v_weights"],
                             **dict(NSA, select_top_k=6))
    with pytest.raises(ValueError, match="multiples of compress_stride=3"):
        sparse.nsa_attention(x["q"], x["k"], x["v"], x["gates"], x["k_weights"], x["v_weights"],
                             **dict(NSA, compress_stride=3))


def test_moba_with_every_block_is_causal_attention():
    """top_k = number of blocks keeps every finished block: MoBA is then dense causal."""
    x = {name: t.detach() for name, t in _inputs().items()}
    moba = sparse.moba_attention(x["q"], x["k"], x["v"], block_size=5, top_k=8, backend="gathered")
    dense = sparse.softmax_attention(x["q"], x["k"], x["v"], backend="reference")
    torch.testing.assert_close(moba, dense, rtol=1e-4, atol=1e-5)


def test_gathered_bf16_is_close_to_fp32_reference():
    """bf16 inputs, fp32 math inside, bf16 output: within bf16 rounding of the output."""
    x = {name: t.detach() for name, t in _inputs().items()}
    low = {name: t.bfloat16() for name, t in x.items()}
    for case in ("window+sink", "moba+window+sink", "nsa+sink"):
        out = CASES[case](low, backend="gathered")
        expected = CASES[case]({name: t.float() for name, t in low.items()}, backend="reference")
        assert out.dtype == torch.bfloat16
        assert (out.float() - expected).abs().max() < 2e-2, case


def _forget_inputs(length=23, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, length, 4, 16, generator=gen)
    k, v = (torch.randn(2, length, 2, 16, generator=gen) for _ in range(2))
    log_forget = torch.nn.functional.logsigmoid(torch.randn(2, length, 4, generator=gen) + 1.5)
    return q, k, v, log_forget


def test_forget_gates_are_the_fox_bias_written_out():
    """Query i attends to key j <= i with logit q_i.k_j / sqrt(D) + sum_{j < l <= i} log f_l
    (per query head; grouped key/value heads), in fp64 pair by pair."""
    q, k, v, log_forget = (t.double() for t in _forget_inputs(length=9))
    out = sparse.softmax_attention(q, k, v, log_forget=log_forget, backend="reference")
    expected = torch.zeros_like(q)
    for b, h, i in itertools.product(range(2), range(4), range(9)):
        logits = torch.stack([q[b, i, h] @ k[b, j, h // 2] / 4 + log_forget[b, j + 1:i + 1, h].sum()
                              for j in range(i + 1)])
        expected[b, i, h] = logits.softmax(0) @ v[b, :i + 1, h // 2]
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


def test_open_forget_gates_are_plain_causal_attention():
    q, k, v, log_forget = _forget_inputs()
    plain = sparse.softmax_attention(q, k, v, backend="reference")
    torch.testing.assert_close(sparse.softmax_attention(q, k, v, log_forget=log_forget * 0,
                                                        backend="reference"), plain)
    assert not torch.allclose(sparse.softmax_attention(q, k, v, log_forget=log_forget), plain)


@pytest.mark.parametrize("options", [{}, {"window": (6, 0)}, {"sink": "learnable"},
                                     {"cu_seqlens": [0, 7, 23]}])
def test_forget_gates_on_flex_forward_match_reference_on_cpu(options):
    """FlexAttention's score_mod adds c_i - c_j (c the cumsum of the log forget gates) with the
    window, the sink and packed sequences (one cumsum over the packed sequences)."""
    q, k, v, log_forget = _forget_inputs()
    options = dict(options)
    if "sink" in options:
        options["sink"] = torch.randn(4, generator=torch.Generator().manual_seed(5))
    if "cu_seqlens" in options:
        options["cu_seqlens"] = torch.tensor(options["cu_seqlens"])
        q, k, v, log_forget = q[:1], k[:1], v[:1], log_forget[:1]
    with torch.no_grad():
        fast = sparse.softmax_attention(q, k, v, log_forget=log_forget, backend="flex", **options)
    slow = sparse.softmax_attention(q, k, v, log_forget=log_forget, backend="reference", **options)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-6)


def test_forget_gates_refuse_what_they_cannot_run():
    q, k, v, log_forget = _forget_inputs()
    with pytest.raises(ValueError, match="need causal self-attention"):
        sparse.softmax_attention(q, k, v, causal=False, log_forget=log_forget)
    with pytest.raises(ValueError, match=r"expected \[B, T, Hq\] = \[2, 23, 4\]"):
        sparse.softmax_attention(q, k, v, log_forget=log_forget[..., :2])
    with pytest.raises(ValueError, match="backend 'gathered' cannot run forget gates"):
        sparse.softmax_attention(q, k, v, log_forget=log_forget, backend="gathered")
    # "auto" on the CPU runs the reference, with gradients
    q.requires_grad_()
    sparse.softmax_attention(q, k, v, log_forget=log_forget).sum().backward()
    assert q.grad is not None
