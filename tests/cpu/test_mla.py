"""MLA ('+'): megatron-core's MLASelfAttention as a pattern mixer equals DeepSeek-V2's formula
written out in fp32 (forward and the input's gradient), beside RoPE softmax layers in one
model. TP = 2 (+SP) and pipeline splits: tests/dist/test_parallel_equivalence.py."""

import pytest
import torch
import torch.nn.functional as F

import harness
from megatron_ext.config import ConfigError, ExtConfig

pytestmark = pytest.mark.usefixtures("megatron_single_process")

SIZES = dict(mla_q_lora_rank=24, mla_kv_lora_rank=16, mla_qk_head_dim=12,
             mla_qk_pos_emb_head_dim=8, mla_v_head_dim=10, mla_rotary_base=500.0)


def mla_layer(**sizes):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2)
    torch.manual_seed(0)
    ext = ExtConfig(pattern="+*", **{**SIZES, **sizes})
    model = GPTModel(config, block_spec(config, ext=ext), vocab_size=96, max_sequence_length=64,
                     position_embedding_type="rope")
    with torch.no_grad():  # norms away from 1, so that they are checked
        for name, p in model.named_parameters():
            if "layernorm" in name:
                p.uniform_(0.5, 1.5)
    return model, model.decoder.layers[0].self_attention, config


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_pairs(x, base):
    """DeepSeek's RoPE: dims (2i, 2i + 1) of ``x [s, ..., d]`` rotated as one complex number by
    position x theta_i, theta_i = base^(-2i / d)."""
    s, d = x.shape[0], x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta  # [s, d / 2]
    rotation = torch.polar(torch.ones_like(angle), angle).view(s, *[1] * (x.dim() - 2), d // 2)
    pairs = torch.view_as_complex(x.double().unflatten(-1, (d // 2, 2)).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def mla_reference(x, mla, config, sizes):
    """DeepSeek-V2 MLA of ``x [s, b, h]`` from the module's weights, causal."""
    heads, eps = config.num_attention_heads, config.layernorm_epsilon
    dn, dr, dv = (sizes["mla_qk_head_dim"], sizes["mla_qk_pos_emb_head_dim"],
                  sizes["mla_v_head_dim"])
    s, b, _ = x.shape
    c_q = rms(x @ mla.linear_q_down_proj.weight.T, mla.q_layernorm.weight, eps)
    q = (c_q @ mla.linear_q_up_proj.weight.T).view(s, b, heads, dn + dr)
    kv = x @ mla.linear_kv_down_proj.weight.T
    c_kv, k_rope = kv.split([sizes["mla_kv_lora_rank"], dr], dim=-1)
    k_v = (rms(c_kv, mla.kv_layernorm.weight, eps) @ mla.linear_kv_up_proj.weight.T)
    k_nope, v = k_v.view(s, b, heads, dn + dv).split([dn, dv], dim=-1)
    base = sizes["mla_rotary_base"]
    q = torch.cat([q[..., :dn], rope_pairs(q[..., dn:], base)], dim=-1)
    k_rope = rope_pairs(k_rope, base)[:, :, None].expand(s, b, heads, dr)
    k = torch.cat([k_nope, k_rope], dim=-1)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / (dn + dr) ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhst,tbhd->sbhd", F.softmax(scores, dim=-1), v).reshape(s, b, heads * dv)
    return o @ mla.linear_proj.weight.T


def test_mla_equals_the_formula():
    _, mla, config = mla_layer()
    x = torch.randn(13, 2, config.hidden_size, generator=torch.Generator().manual_seed(1))
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    out, bias = mla(x, None)
    assert bias is None or not bias.any()
    want = mla_reference(x_ref, mla, config, SIZES)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-4)


def test_hybrid_with_mla_and_rope_attention_trains():
    model, _, _ = mla_layer()
    tokens = torch.randint(0, 96, (4, 33), generator=torch.Generator().manual_seed(2))
    losses = harness.fit(model, tokens)
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("field, value", [("mla_kv_lora_rank", 0), ("mla_q_lora_rank", None),
                                          ("mla_qk_pos_emb_head_dim", 7),
                                          ("mla_rope_type", "ntk")])
def test_bad_mla_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        ExtConfig(pattern="+", **{field: value}).validate()
