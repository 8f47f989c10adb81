"""The softmax-attention options and the sparse layers inside Megatron models: sliding window
and sink against Megatron's own local core, XSA, every option at once in a hybrid of '*', MoBA
and NSA, FoX's forget gate, and the errors for settings that cannot work."""

import pytest
import torch

import harness
from megatron.core.transformer.enums import AttnMaskType

from megatron_ext.config import ConfigError, ExtConfig

pytestmark = pytest.mark.usefixtures("megatron_single_process")


def _model(backend, pattern="*", ext_options=None, **cfg):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=len(pattern), **cfg)
    torch.manual_seed(7)
    ext = ExtConfig(pattern=pattern, attention_backend=backend, **(ext_options or {}))
    return GPTModel(config, block_spec(config, ext=ext), vocab_size=96, max_sequence_length=48,
                    position_embedding_type="none")


def _loss(model, seq=37):
    tokens = torch.randint(0, 96, (3, seq), generator=torch.Generator().manual_seed(3))
    return model(tokens, torch.arange(seq).expand(3, -1), None, labels=tokens.roll(-1, 1)).mean()


@pytest.mark.parametrize("options", [
    dict(window_size=(6, 0)),
    dict(softmax_type="learnable"),
    dict(softmax_type="off-by-one"),
    dict(window_size=(6, 0), softmax_type="learnable", window_attn_skip_freq=2),
])
def test_window_and_sink_equal_megatron_local_core(options):
    """Same weights (the sink is ``softmax_offset`` in both), fp32: Megatron's unfused core and
    ours give the same loss and gradients."""
    local = _model("local", "**", **options)
    ours = _model("sdpa", "**", **options)
    ours.load_state_dict(local.state_dict())
    if options.get("softmax_type") == "learnable":  # a sink that matters, not init_method's ~0
        with torch.no_grad():
            for m in (local, ours):
                for layer in m.decoder.layers:
                    layer.self_attention.core_attention.softmax_offset.copy_(
                        torch.tensor([1.0, -2.0, 0.5, 3.0]))
    losses = []
    for m in (local, ours):
        loss = _loss(m)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(local.named_parameters(), ours.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def _core(ext=None, layer_number=1, **cfg):
    from megatron_ext.mixers.attention import SDPACoreAttention

    return SDPACoreAttention(harness.tiny_config(**cfg), layer_number=layer_number,
                             attn_mask_type=AttnMaskType.causal, ext=ext)


def _qkv(s=29, b=2):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(s, b, 4, 16, generator=g), torch.randn(s, b, 2, 16, generator=g),
            torch.randn(s, b, 2, 16, generator=g))


def test_window_skips_the_layers_window_attn_skip_freq_names():
    assert _core(layer_number=1, window_size=(6, 0), window_attn_skip_freq=2).window == (6, 0)
    assert _core(layer_number=2, window_size=(6, 0), window_attn_skip_freq=2).window is None


def test_sink_of_minus_infinity_is_the_plain_core():
    q, k, v = _qkv()
    core = _core(softmax_type="learnable")
    assert core.softmax_offset.tensor_model_parallel and core.softmax_offset.partition_dim == 0
    with torch.no_grad():
        core.softmax_offset.fill_(float("-inf"))
    torch.testing.assert_close(core(q, k, v, None), _core()(q, k, v, None), rtol=1e-5, atol=1e-6)


def _emulated_flash(monkeypatch) -> list:
    """FlashAttention's kernels emulated (flash_emulation.py) and let run on the CPU, so that
    "auto" takes kernels/sparse/flash.py; returns the names of the flash.py functions called."""
    from flash_emulation import allow_flash, emulate

    from megatron_ext.kernels.sparse import flash

    emulate(monkeypatch)
    allow_flash(monkeypatch)
    monkeypatch.setattr(flash, "checked", lambda device, dtype: True)
    calls = []
    for name in ("flash_attention", "block_selection_attention"):
        run = getattr(flash, name)
        monkeypatch.setattr(flash, name, lambda *a, run=run, name=name, **kw:
                            calls.append(name) or run(*a, **kw))
    return calls


@pytest.mark.parametrize("on_flash", [False, True], ids=["auto", "flash emulated"])
def test_packed_sequences_with_window_and_sink_equal_separate_sequences(on_flash, monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams

    calls = _emulated_flash(monkeypatch) if on_flash else []
    q, k, v = (x[:, 0] for x in _qkv())
    cu = torch.tensor([0, 10, 29], dtype=torch.int32)
    core = _core(window_size=(4, 0), softmax_type="off-by-one")
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=19, max_seqlen_kv=19)
    packed = core(q, k, v, None, packed_seq_params=params)
    pieces = [core(q[a:b, None], k[a:b, None], v[a:b, None], None)[:, 0]
              for a, b in ((0, 10), (10, 29))]
    torch.testing.assert_close(packed, torch.cat(pieces), rtol=1e-5, atol=1e-6)
    assert len(calls) == (3 if on_flash else 0)


@pytest.mark.parametrize("pattern", ["B", "S", "F"])
def test_sparse_layers_on_packed_sequences_equal_separate_sequences(pattern):
    """thd packing: each sequence's blocks count from its own start (the core runs the
    sequences as the rows of a padded batch); outputs and input gradients."""
    from megatron.core.packed_seq_params import PackedSeqParams

    attention = _model("sdpa", pattern, ext_options=harness.SHORT_SPARSE,
                       softmax_type="learnable").decoder.layers[0].self_attention
    bounds = ((0, 10), (10, 29))
    cu = torch.tensor([0, 10, 29], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=19, max_seqlen_kv=19)
    hidden = torch.randn(29, 1, 64, generator=torch.Generator().manual_seed(0))
    weights = torch.randn(29, 1, 64, generator=torch.Generator().manual_seed(1))
    runs = []
    for packed in (True, False):
        x = hidden.clone().requires_grad_()
        if packed:
            out = attention(x, None, packed_seq_params=params)[0]
        else:
            out = torch.cat([attention(x[a:b], None)[0] for a, b in bounds])
        (out * weights).sum().backward()
        runs.append((out, x.grad))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=1e-5, atol=1e-6)


def test_xsa_core_output_is_orthogonal_to_own_value():
    q, k, v = _qkv()
    out = _core(ext=ExtConfig(attention_xsa=True), window_size=(6, 0))(q, k, v, None)
    plain = _core(window_size=(6, 0))(q, k, v, None)
    own = v.repeat_interleave(2, dim=2).flatten(2)  # [s, b, heads * d], each head's group value
    heads = lambda x: x.unflatten(-1, (4, 16))  # noqa: E731
    along_v = (heads(out) * heads(own)).sum(-1) / (heads(plain).norm(dim=-1)
                                                    * heads(own).norm(dim=-1))
    assert along_v.abs().max() < 1e-5
    assert not torch.allclose(out, plain)


def test_every_option_at_once_trains_in_a_sparse_hybrid():
    """MoBA, NSA and '*' with a learnable sink, output gate, QK-norm, XSA and a window on the
    MoBA and '*' layers (not NSA, which has its own)."""
    # Megatron compiles the output gate with torch.compile, which costs ~30 s on two CPU cores;
    # the gate's math is the same eagerly.
    with torch._dynamo.config.patch(disable=True):
        model = _model("sdpa", "BS*", ext_options=dict(attention_xsa=True, **harness.SHORT_SPARSE),
                       softmax_type="learnable", attention_output_gate=True, qk_layernorm=True,
                       window_size=(15, 0), window_attn_skip_freq=[1, 0, 1])
        names = [name for name, _ in model.named_parameters()]
        for expected in ("layers.0.self_attention.core_attention.softmax_offset",
                         "layers.1.self_attention.core_attention.compress_k_weights",
                         "layers.1.self_attention.linear_branch_gate.weight",
                         "layers.2.self_attention.q_layernorm.weight"):
            assert any(name.endswith(expected) for name in names), expected
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(6):
            loss = _loss(model, seq=40)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.parametrize("options,message", [
    (dict(nsa_compress_block=30), "nsa_compress_block=30 is not a multiple of nsa_compress_stride"),
    (dict(nsa_select_top_k=2), "nsa_select_top_k=2 must be >= 3"),
    (dict(moba_top_k=0), "moba_top_k=0 must be a positive integer"),
    (dict(sparse_backend="triton"), "sparse_backend='triton' is not one of"),
])
def test_invalid_sizes_fail_clearly(options, message):
    with pytest.raises(ConfigError, match=message):
        ExtConfig(**options).validate()


def test_top_k_beyond_the_blocks_of_the_sequence_fails_clearly():
    model = _model("sdpa", "B", ext_options=dict(moba_block_size=16, moba_top_k=4))
    with pytest.raises(ConfigError, match=r"moba_top_k=4 is more than the 3 blocks of "
                                          r"moba_block_size=16 in a sequence of 37 tokens"):
        _loss(model)


def test_settings_that_cannot_work_fail_clearly():
    with pytest.raises(ConfigError, match="attention_xsa=True needs our attention core"):
        _model("local", ext_options=dict(attention_xsa=True))
    with pytest.raises(ConfigError, match=r"NSA has its own sliding-window branch \(nsa_window\)"):
        _model("sdpa", "S", window_size=(6, 0))
    with pytest.raises(NotImplementedError, match="attention_dropout=0.1 is not supported"):
        _model("sdpa", "B", attention_dropout=0.1)


def test_sparse_layers_keep_the_attention_input_norm():
    """MoBA and NSA are SelfAttention: the input norm is filed as the '*' layer's is (for TE
    checkpoints), so a '*' checkpoint's keys fit them."""
    attention, moba = _model("sdpa", "*"), _model("sdpa", "B")
    assert attention.sharded_state_dict().keys() == moba.sharded_state_dict().keys()


def test_layers_on_the_flash_path_equal_the_gathered_path(monkeypatch):
    """With FlashAttention's kernels emulated, "auto" sends '*' with a window and a sink and
    MoBA to kernels/sparse/flash.py (NSA stays on its block layout): a model of all three gives
    the gathered path's loss and gradients (fp32)."""
    calls = _emulated_flash(monkeypatch)
    # the window on the first layer only ('*'): MoBA with a window stays on FlexAttention
    options = dict(window_size=(6, 0), softmax_type="learnable", window_attn_skip_freq=[1, 0, 0])
    models = [_model("sdpa", "*BS", ext_options=dict(harness.SHORT_SPARSE, sparse_backend=backend),
                     **options) for backend in ("auto", "gathered")]
    models[1].load_state_dict(models[0].state_dict())
    losses = []
    for model in models:
        loss = _loss(model)
        loss.backward()
        losses.append(loss)
    assert {"flash_attention", "block_selection_attention"} <= set(calls)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(models[1].named_parameters(), models[0].parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_fox_layer_with_open_forget_gates_is_the_attention_layer():
    """FoX is '*' plus a forget gate per head: with the gate's projection at weight 0 and bias
    30 (f = sigmoid(30), log f ~ -1e-13) it gives the '*' layer's outputs and gradients for the
    same weights; with the projection as initialised (bias 0, f ~ 1/2 a token) it does not, and
    its gradient reaches the gate."""
    attention, fox = _model("sdpa", "*"), _model("sdpa", "F")
    gate = fox.decoder.layers[0].self_attention.linear_forget_gate
    assert tuple(gate.weight.shape) == (4, 64) and not gate.bias.abs().any()
    fox.load_state_dict(attention.state_dict(), strict=False)
    initial = _loss(fox)
    initial.backward()
    assert gate.weight.grad.abs().sum() > 0 and gate.bias.grad.abs().sum() > 0
    with torch.no_grad():
        gate.weight.zero_()
        gate.bias.fill_(30.0)
    losses = [_loss(model) for model in (attention, fox)]
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    assert abs(initial.item() - losses[1].item()) > 1e-3
    for model, loss in zip((attention, fox), losses):
        model.zero_grad()
        loss.backward()
    for name, parameter in attention.named_parameters():
        torch.testing.assert_close(dict(fox.named_parameters())[name].grad, parameter.grad,
                                   rtol=1e-4, atol=1e-6, msg=name)
