"""MLA ('+'): megatron-core's MLASelfAttention as a pattern mixer equals DeepSeek-V2's formula
written out in fp32 (forward and the input's gradient), beside RoPE softmax layers in one
model; packed sequences equal separate ones. DSA on MLA layers ('D' under dsa_attention_type:
mla, DeepSeek-V3.2): equal to MLA where the attention is dense, to MLA masked to the keys
DeepSeek-V3.2's indexer (written out from the layer's weights) picks otherwise; its loss trains
the indexer alone. TP = 2 (+SP) and pipeline splits: tests/parallel/test_parallel_equivalence.py,
and for DSA on MLA tests/parallel/test_sparse_attention_tp.py; context parallelism of both:
tests/parallel/test_context_parallel.py."""

import pytest
import torch
import torch.nn.functional as F

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers.dsa import freeze_all_but_indexers

pytestmark = pytest.mark.usefixtures("megatron_single_process")

SIZES = dict(mla_q_lora_rank=24, mla_kv_lora_rank=16, mla_qk_head_dim=12,
             mla_qk_pos_emb_head_dim=8, mla_v_head_dim=10, mla_rotary_base=500.0)
# DSA on MLA: the sparse tests' DSA sizes (top-6 of 4 indexer heads of 8 dims).
DSA_MLA = dict(harness.SHORT_SPARSE, dsa_attention_type="mla")
SEQ = 13


def mla_layer(pattern="+*", **options):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2)
    torch.manual_seed(0)
    ext = ExtConfig(pattern=pattern, **{**SIZES, **options})
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


def rope_halves(x, base):
    """RoPE as DeepSeek-V3.2's indexer applies it: dim i and dim i + d / 2 of ``x [s, ..., d]``
    rotated together by position x theta_i, theta_i = base^(-2i / d)."""
    s, d = x.shape[0], x.shape[-1]
    theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = (torch.arange(s, dtype=torch.float64)[:, None] * theta).view(s, *[1] * (x.dim() - 2), -1)
    cos, sin = angle.cos(), angle.sin()
    x1, x2 = x.double().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def indexer_topk_mask(x, mla, config, sizes, top_k):
    """DeepSeek-V3.2's lightning indexer of ``x [s, b, h]`` from the layer's weights (queries
    from MLA's normalised query latent, keys and weights from x, MLA's RoPE on the first d_r dims
    as halves) -> the keys each query attends to, ``[b, s, s]`` bool: its ``top_k`` causal keys
    of highest score (of equal scores, such as the ReLU's zeros, the earlier key's first)."""
    indexer, eps, dr = mla.indexer, config.layernorm_epsilon, sizes["mla_qk_pos_emb_head_dim"]
    heads, dim = indexer.heads, indexer.dim
    s, b, _ = x.shape
    c_q = rms(x @ mla.linear_q_down_proj.weight.T, mla.q_layernorm.weight, eps)
    q = (c_q @ indexer.linear_q.weight.T).view(s, b, heads, dim)
    k = F.layer_norm(x @ indexer.linear_k.weight.T, (dim,), indexer.key_norm.weight,
                     indexer.key_norm.bias, eps)
    base = sizes["mla_rotary_base"]
    q = torch.cat([rope_halves(q[..., :dr], base), q[..., dr:]], dim=-1)
    k = torch.cat([rope_halves(k[..., :dr], base), k[..., dr:]], dim=-1)
    w = x @ indexer.linear_weights.weight.T / (heads * dim) ** 0.5
    scores = torch.einsum("sbh,bsht->bst", w, torch.einsum("sbhd,tbd->bsht", q, k).relu())
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    ranked = scores.masked_fill(~causal, float("-inf")).sort(dim=-1, descending=True, stable=True)
    chosen = ranked.indices[..., :top_k]
    return torch.zeros(b, s, s, dtype=torch.bool).scatter(-1, chosen, True) & causal


def mla_reference(x, mla, config, sizes, allowed=None):
    """DeepSeek-V2 MLA of ``x [s, b, h]`` from the module's weights, causal, or over the keys
    ``allowed [b, s, s]`` of each query."""
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
    if allowed is None:
        allowed = torch.ones(s, s, dtype=torch.bool).tril()[None]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
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


def _assert_packed_equals_separate(layer, hidden_size: int) -> None:
    """Sequences of 10 and 19 tokens packed (thd) through ``layer`` give what each gives alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    hidden = torch.randn(29, 1, hidden_size, generator=torch.Generator().manual_seed(0))
    cu = torch.tensor([0, 10, 29], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=19, max_seqlen_kv=19)
    packed, _ = layer(hidden, None, packed_seq_params=params)
    pieces = [layer(hidden[a:b], None)[0] for a, b in ((0, 10), (10, 29))]
    torch.testing.assert_close(packed, torch.cat(pieces), rtol=1e-5, atol=1e-6)


def test_mla_packed_sequences_equal_separate_sequences():
    """thd packing: MLA's RoPE restarts and attention stays inside each sequence; the core gets
    the values at their own ``mla_v_head_dim`` (not padded to the query dims)."""
    _, mla, config = mla_layer()
    value_dims = []
    mla.core_attention.register_forward_pre_hook(
        lambda module, args: value_dims.append(args[2].shape[-1]))
    _assert_packed_equals_separate(mla, config.hidden_size)
    assert value_dims == [SIZES["mla_v_head_dim"]] * 3


@pytest.mark.parametrize("field, value", [("mla_kv_lora_rank", 0), ("mla_q_lora_rank", None),
                                          ("mla_qk_pos_emb_head_dim", 7),
                                          ("mla_rope_type", "ntk")])
def test_bad_mla_settings_are_refused(field, value):
    with pytest.raises(ConfigError, match=field):
        ExtConfig(pattern="+", **{field: value}).validate()



def dsa_mla_layers(rope="rope", **options):
    """A 'D' model under dsa_attention_type: mla, its first layer, and the first layer of the
    '+' model whose weights it loads (all but the indexer's); both with ``mla_rope_type=rope``."""
    model, dsa, config = mla_layer("D*", **{**DSA_MLA, "mla_rope_type": rope, **options})
    _, mla, _ = mla_layer("+*", mla_rope_type=rope)
    missing, unexpected = dsa.load_state_dict(mla.state_dict(), strict=False)
    assert not unexpected and missing and all(name.startswith("indexer.") for name in missing)
    return model, dsa, mla, config


def run(forward, layer, x, grad):
    """``forward(x)`` and, under the output gradient ``grad``, the gradients of x ("input")
    and of the layer's attention parameters (all but the indexer's), by name."""
    x = x.clone().requires_grad_()
    out = forward(x)
    params = {name: p for name, p in layer.named_parameters() if not name.startswith("indexer.")}
    return out, dict(zip(["input", *params], torch.autograd.grad(out, [x, *params.values()], grad)))


def assert_same_run(got, want):
    (out, grads), (out_want, grads_want) = got, want
    torch.testing.assert_close(out, out_want, atol=1e-5, rtol=1e-4)
    assert grads.keys() == grads_want.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_want[name], atol=1e-5, rtol=1e-4, msg=name)


def inputs(config):
    x = torch.randn(SEQ, 2, config.hidden_size, generator=torch.Generator().manual_seed(1))
    return x, torch.randn(x.shape, generator=torch.Generator().manual_seed(4))


@pytest.mark.parametrize("stage,top_k,rope", [("dense_warmup", 4, "rope"), ("sparse", SEQ, "rope"),
                                              ("sparse", SEQ, "yarn")])
def test_dsa_on_mla_with_dense_attention_equals_mla(stage, top_k, rope, unit_scale):
    """The dense warm-up, and a top-k that covers the sequence, are MLA: the output and the
    input's and attention parameters' gradients of the '+' layer with the same weights (the
    indexer loss adds nothing to them)."""
    _, dsa, mla, config = dsa_mla_layers(rope, dsa_stage=stage, dsa_top_k=top_k)
    x, grad = inputs(config)
    assert_same_run(run(lambda x: dsa(x, None)[0], dsa, x, grad),
                    run(lambda x: mla(x, None)[0], mla, x, grad))


def test_dsa_on_mla_attends_to_the_indexers_top_k(unit_scale):
    """With top-4 of 13 tokens: MLA's attention (per-head latent keys and values, shared RoPE
    key) masked to the 4 causal keys of highest DeepSeek-V3.2 indexer score, in output and
    gradients."""
    _, dsa, config = mla_layer("D*", **{**DSA_MLA, "dsa_top_k": 4})
    with torch.no_grad():  # the indexer's key norm away from its initial identity
        dsa.indexer.key_norm.weight.uniform_(0.5, 1.5)
        dsa.indexer.key_norm.bias.uniform_(-0.5, 0.5)
    x, grad = inputs(config)
    allowed = indexer_topk_mask(x, dsa, config, SIZES, top_k=4)
    assert allowed.sum(-1).max() == 4 and not torch.equal(allowed[0], allowed[1])
    assert_same_run(run(lambda x: dsa(x, None)[0], dsa, x, grad),
                    run(lambda x: mla_reference(x, dsa, config, SIZES, allowed), dsa, x, grad))


def test_dsa_on_mla_indexer_learns_from_its_loss_alone(unit_scale):
    """The indexer (its queries from the query latent) gets gradients from its KL loss, which
    reaches no other parameter: with and without the loss every other gradient is the same."""
    model, dsa, _ = mla_layer("D*", **DSA_MLA)
    assert dsa.indexer.linear_q.in_features == SIZES["mla_q_lora_rank"]
    harness.sparse_loss(model).backward()
    with_loss = harness.named_grads(model)
    model.zero_grad(set_to_none=True)
    dsa.core_attention.ext.dsa_indexer_loss_coeff = 0.0
    harness.sparse_loss(model).backward()
    without = harness.named_grads(model)
    assert sum(harness.is_indexer(name) for name in with_loss) == 5
    for name, grad in with_loss.items():
        if harness.is_indexer(name):
            assert grad is not None and grad.abs().sum() > 0 and without[name] is None, name
        else:
            torch.testing.assert_close(grad, without[name], rtol=0, atol=0, msg=name)


def test_dsa_on_mla_dense_warmup_trains_only_the_indexer(unit_scale, indexer_losses):
    """Dense warm-up: only the indexer moves, and its KL loss to MLA's attention falls."""
    losses = indexer_losses
    model, _, _ = mla_layer("D*", **{**DSA_MLA, "dsa_stage": "dense_warmup"})
    freeze_all_but_indexers(model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(8):
        harness.sparse_loss(model).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        assert (not torch.equal(p, before[name])) == harness.is_indexer(name), name
    assert losses[-1] < 0.7 * losses[0], losses


def test_hybrid_with_dsa_on_mla_trains(unit_scale):
    model, _, _ = mla_layer("D*", **DSA_MLA)
    tokens = torch.randint(0, 96, (4, 33), generator=torch.Generator().manual_seed(2))
    losses = harness.fit(model, tokens)
    assert losses[-1] < losses[0] - 0.5, losses


def test_dsa_on_mla_packed_sequences_equal_separate_sequences(unit_scale):
    """thd packing: MLA's and the indexer's RoPE restart and the choice stays inside each
    sequence."""
    _, dsa, config = mla_layer("D*", **{**DSA_MLA, "dsa_top_k": 4})
    _assert_packed_equals_separate(dsa, config.hidden_size)


def test_dsa_on_mla_refuses_what_it_cannot_do():
    from megatron_ext.mixers.mla import mla_spec

    def build(ext_options=(), **config_options):
        ext = ExtConfig(pattern="D*", **{**SIZES, **DSA_MLA, **dict(ext_options)})
        return harness.sparse_model(ext, "rope", **config_options)

    with pytest.raises(ConfigError, match="dsa_indexer_dim=4 is smaller than "
                                          "mla_qk_pos_emb_head_dim=8"):
        build(dict(dsa_indexer_dim=4))
    with pytest.raises(ConfigError, match="Transformer Engine's MLA is not wired in"):
        mla_spec(ExtConfig(attention_backend="te", **DSA_MLA), harness.tiny_config(),
                 indexer=True)
    with pytest.raises(ConfigError, match=r"do not take recompute_modules=\['core_attn'\]"):
        build(recompute_granularity="selective")
    with pytest.raises(ConfigError, match="DSA picks its own keys"):
        build(window_size=(6, 0))
    with pytest.raises(ConfigError, match="DSA cannot decode incrementally yet"):
        build().decoder.layers[0].self_attention(torch.zeros(3, 1, 64), None,
                                                 inference_context=object())
    with pytest.raises(ConfigError, match=r"dsa_attention_type='gpa' is not one of \['gqa', "
                                          r"'mla'\]"):
        ExtConfig(dsa_attention_type="gpa").validate()
