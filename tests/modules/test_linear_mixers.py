"""The linear-recurrent mixers as Megatron modules: the delta-rule family (DeltaNet, GDN, KDA,
GDN-2), the decay family (GLA, RetNet, Lightning) and Mamba-2. Packed sequences equal separate
ones (convolution and state reset at borders), the op backends agree inside each module, and
gates, fixed decays and Mamba-2's recurrence are what the papers say."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers import decay, delta_rule
from megatron_ext.mixers.common import LinearMixerSubmodules

pytestmark = pytest.mark.usefixtures("megatron_single_process")
KINDS = delta_rule.VARIANTS + decay.VARIANTS + ("mamba2",)


def _mixer(kind, backend="auto", layer_number=1, **ext):
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(5)
    args = dict(layer_number=layer_number, ext_config=ExtConfig(kernel_backend=backend, **ext),
                pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    config, subs = harness.tiny_config(), LinearMixerSubmodules()
    if kind == "mamba2":
        return decay.Mamba2Mixer(config, subs, **args)
    if kind in decay.VARIANTS:
        return decay.DecayMixer(config, subs, variant=kind, **args)
    return delta_rule.DeltaRuleMixer(config, subs, variant=kind, **args)


@pytest.mark.parametrize("kind", KINDS)
def test_packed_sequences_equal_separate_sequences(kind):
    mixer = _mixer(kind)
    x = torch.randn(24, 1, 64, requires_grad=True)
    cu = torch.tensor([0, 7, 20, 24], dtype=torch.int32)
    packed, _ = mixer(x, packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13))
    separate = torch.cat([mixer(x[a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)
    g_packed, = torch.autograd.grad(packed.square().sum(), x)
    g_separate, = torch.autograd.grad(separate.square().sum(), x)
    torch.testing.assert_close(g_packed, g_separate, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_backend_equals_reference_inside_the_module(kind):
    x = torch.randn(70, 2, 64)  # longer than one 64-token chunk, odd length
    results = []
    for backend in ("reference", "chunked"):
        mixer = _mixer(kind, backend)
        out, _ = mixer(x)
        results.append((out, torch.autograd.grad(out.square().sum(), list(mixer.parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(results[1][1], results[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_delta_rule_gates_have_the_shapes_of_their_variant():
    params = {v: dict(_mixer(v).named_parameters()) for v in delta_rule.VARIANTS}
    assert "A_log" not in params["deltanet"]
    assert params["gated_deltanet"]["dt_bias"].shape == (4,)          # one decay per value head
    assert params["kda"]["dt_bias"].shape == (4 * 16,)                # one per key channel
    parts = {v: _mixer(v)._fused_splits["in_proj"] for v in delta_rule.VARIANTS}
    assert list(parts["gated_deltanet"]) == ["q", "k", "v", "gate", "beta", "decay"]
    assert list(parts["kda"]) == ["q", "k", "v", "gate", "beta"]      # low-rank decay apart
    assert list(parts["gated_deltanet2"]) == ["q", "k", "v", "gate", "erase", "write"]


def test_bad_head_counts_fail_with_the_fix():
    with pytest.raises(ConfigError, match="multiple of linear_num_key_heads=3"):
        _mixer("gated_deltanet", linear_num_key_heads=3, linear_num_value_heads=4)


def test_fixed_decays_follow_the_papers():
    retnet = _mixer("retnet")
    gammas = retnet.log_decay.exp()
    expected = 1 - torch.pow(2.0, -5.0 - torch.arange(4.0))
    torch.testing.assert_close(gammas, expected)
    # Lightning: ALiBi slopes, weaker decay in deeper layers (layer 4 of 4 is the last).
    first, last = _mixer("lightning", layer_number=1), _mixer("lightning", layer_number=4)
    slopes = torch.pow(2.0, -8.0 * torch.arange(1, 5.0) / 4)
    torch.testing.assert_close(-first.log_decay, slopes * (1 + 1e-5))
    assert torch.all(last.log_decay.abs() < 1e-4)


def test_mamba2_equals_the_ssm_recurrence_written_out():
    """y_t = C_t^T S_t + D x_t with S_t = exp(dt A) S_{t-1} + B_t (dt x_t)^T, per head."""
    m = _mixer("mamba2", backend="chunked")
    hidden = torch.randn(9, 1, 64)
    out, _ = m(hidden)

    parts, _ = m.split_outputs("in_proj", m.in_proj(hidden)[0])

    def proj(name):
        return parts[name][:, 0].float()  # [s, C]

    def conv(t, w):
        return F.silu(F.conv1d(t.T[None], w[:, None], padding=w.shape[1] - 1,
                               groups=w.shape[0])[0, :, : t.shape[0]].T)

    x = conv(proj("x"), m.conv_x).view(9, m.heads, m.head_dim)
    B = conv(proj("B"), m.conv_B).view(9, m.groups, m.state_dim)
    C = conv(proj("C"), m.conv_C).view(9, m.groups, m.state_dim)
    dt = F.softplus(proj("dt") + m.dt_bias)
    A = -m.A_log.exp()
    per_group = m.heads // m.groups
    state = torch.zeros(m.heads, m.state_dim, m.head_dim)
    ys = []
    for t in range(9):
        g = torch.arange(m.heads) // per_group
        state = (torch.exp(dt[t] * A)[:, None, None] * state
                 + B[t, g][:, :, None] * (dt[t][:, None] * x[t])[:, None, :])
        ys.append(torch.einsum("hn,hnp->hp", C[t, g], state) + m.D[:, None] * x[t])
    y = torch.stack(ys).reshape(9, m.groups, -1)
    z = proj("z").reshape(9, m.groups, -1)
    y = y * F.silu(z)
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + m.norm_eps) * m.norm_weight.view(m.groups, -1)
    expected, _ = m.linear_out(y.reshape(9, 1, -1))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_hgrn2_equals_its_recurrence_written_out():
    """S_t = Diag(f_t) S_{t-1} + (1 - f_t) v_t^T, o_t = S_t^T silu(q_t), per head, with the forget
    gate f = b + (1 - b) sigmoid(x W_f) above the layer's lower bound b = (l - 1) / L."""
    m = _mixer("hgrn2", backend="chunked", layer_number=3)
    hidden = torch.randn(9, 1, 64)
    out, _ = m(hidden)
    parts, _ = m.split_outputs("in_proj", m.in_proj(hidden)[0])
    q, forget_logits, v, gate = (part[:, 0].float().view(9, m.heads, -1) for part in parts.values())
    bound = 2 / 4
    forget = bound + (1 - bound) * torch.sigmoid(forget_logits)
    assert forget.min() >= bound
    state = torch.zeros(m.heads, m.key_dim, m.value_dim)
    outputs = []
    for t in range(9):
        state = forget[t][:, :, None] * state + (1 - forget[t])[:, :, None] * v[t][:, None, :]
        outputs.append(torch.einsum("hk,hkv->hv", F.silu(q[t]), state))
    o = torch.stack(outputs)
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + m.norm_eps) * m.out_norm_weight
    expected, _ = m.linear_out((o * F.silu(gate)).reshape(9, 1, -1))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)


def test_hedgehog_equals_normalised_feature_map_attention():
    """o_t = sum_{j<=t} (phi(q_t) . phi(k_j)) v_j / sum_{j<=t} phi(q_t) . phi(k_j), with
    phi(x) = [softmax(x W + b), softmax(-(x W + b))] per head, then the output projection."""
    m = _mixer("hedgehog", backend="chunked")
    with torch.no_grad():
        m.feature_map.add_(0.3 * torch.randn_like(m.feature_map))
        m.feature_bias.normal_()
    hidden = torch.randn(11, 1, 64)
    out, _ = m(hidden)
    parts, _ = m.split_outputs("in_proj", m.in_proj(hidden)[0])
    assert set(parts) == {"q", "k", "v"}
    q, k, v = (parts[name][:, 0].float().view(11, m.heads, -1) for name in ("q", "k", "v"))

    def phi(x):
        z = torch.einsum("shk,hkf->shf", x, m.feature_map) + m.feature_bias
        return torch.cat([z.softmax(-1), (-z).softmax(-1)], dim=-1)

    scores = torch.einsum("thf,jhf->htj", phi(q), phi(k)).tril()  # [heads, t, j], causal
    o = torch.einsum("htj,jhv->thv", scores / scores.sum(-1, keepdim=True), v)
    expected, _ = m.linear_out(o.reshape(11, 1, -1))
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
