"""CUDA checks (skipped without a GPU): the SDPA core in bf16 against the fp32 definition, and
the Gated DeltaNet op's chunked path on the GPU against the fp32 reference."""

import math

import pytest
import torch

pytestmark = pytest.mark.gpu


def _attention_fp32(q, k, v):
    s = q.shape[0]
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(),
                                float("-inf"))
    return torch.einsum("bhqk,kbhd->qbhd", scores.softmax(-1), v).reshape(s, q.shape[1], -1)


@pytest.mark.parametrize("seq", [127, 1024])
def test_sdpa_core_bf16_close_to_fp32(seq):
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_ext.mixers.attention import SDPACoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8,
                               num_query_groups=2, bf16=True, params_dtype=torch.bfloat16,
                               attention_dropout=0.0)
    core = SDPACoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(seq, 2, 8, 64, device="cuda", generator=g)
    k = torch.randn(seq, 2, 2, 64, device="cuda", generator=g)
    v = torch.randn(seq, 2, 2, 64, device="cuda", generator=g)
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out = core(q, k, v, None).float()
    # Same bf16 inputs, fp32 math in the reference: what is left is the kernel's bf16 output
    # rounding (2^-8 relative) and its accumulation order.
    expected = _attention_fp32(q.float(), k.float(), v.float())
    # Flash-style kernels round the probabilities to bf16 before P @ V, and the output once
    # more: each costs at most 2^-8 of max |v|.
    err = (out - expected).abs().max().item()
    assert err <= 2 * 2**-8 * v.float().abs().max().item(), err


def test_gated_delta_rule_chunked_on_cuda_matches_reference():
    from megatron_ext.kernels import gated_delta_rule

    g = torch.Generator(device="cuda").manual_seed(0)
    B, T, Hk, Hv, K, V = 2, 200, 2, 4, 32, 32
    q = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, device="cuda", generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(B, T, Hk, K, device="cuda", generator=g), dim=-1)
    v = torch.randn(B, T, Hv, V, device="cuda", generator=g)
    beta = torch.rand(B, T, Hv, device="cuda", generator=g)
    decay = -torch.rand(B, T, Hv, device="cuda", generator=g) * 0.1
    inputs = [t.requires_grad_() for t in (q, k, v, beta, decay)]
    outs = {}
    for backend in ("reference", "chunked"):
        o, _ = gated_delta_rule(*inputs[:3], beta=inputs[3], g=inputs[4], backend=backend)
        grads = torch.autograd.grad(o.square().sum(), inputs)
        outs[backend] = (o, grads)
    torch.testing.assert_close(outs["chunked"][0], outs["reference"][0], rtol=1e-4, atol=1e-4)
    for a, b in zip(outs["chunked"][1], outs["reference"][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
