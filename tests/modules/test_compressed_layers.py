"""CSA ('C') and HCA ('H') layers inside Megatron models: closed forms against the '*' layer,
packed sequences with RoPE, the V4 sink, which parameters each loss trains (CSA's indexer as
DSA's, in both stages), what the spec wires into Megatron, and the errors for settings that
cannot work. The ops themselves: test_compressed_attention.py."""

import pytest
import torch

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers.dsa import IndexerLoss, freeze_all_but_indexers

pytestmark = pytest.mark.usefixtures("megatron_single_process")

SEQ = harness.SPARSE_SEQ
_model, _loss, _grads = harness.sparse_model, harness.sparse_loss, harness.named_grads


def _ext(pattern="C*", **options):
    return harness.sparse_ext(pattern, **options)


@pytest.mark.parametrize("pattern,stage", [("C", "sparse"), ("C", "dense_warmup"),
                                           ("H", "sparse")])
def test_no_complete_block_and_a_covering_window_is_the_attention_layer(pattern, stage,
                                                                         unit_scale):
    """Blocks longer than the sequence leave no entry, and a window of the whole sequence is
    causal attention: with the '*' model's weights (and sink) the LM loss and every shared
    gradient are the same."""
    sizes = dict(csa_compress_rate=32, csa_window=32, hca_compress_rate=32, hca_window=32)
    options = dict(softmax_type="learnable", qk_layernorm=True)
    attention = _model(_ext("*"), **options)
    compressed = _model(_ext(pattern, dsa_stage=stage, **sizes), **options)
    missing, unexpected = compressed.load_state_dict(attention.state_dict(), strict=False)
    assert not unexpected and missing
    assert all(".compressor." in name or harness.is_indexer(name) for name in missing)
    with torch.no_grad():
        for m in (attention, compressed):
            m.decoder.layers[0].self_attention.core_attention.softmax_offset.copy_(
                torch.tensor([1.0, -2.0, 0.5, 3.0]))
    losses = [_loss(m) for m in (attention, compressed)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for loss in losses:
        loss.backward()
    shared = dict(attention.named_parameters())
    for name, p in compressed.named_parameters():
        if name in shared:
            torch.testing.assert_close(p.grad, shared[name].grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("pattern", ["C", "H"])
def test_compression_changes_the_output(pattern):
    """With entries in reach, the layer is no longer the window alone (same weights: only the
    zero position biases differ in shape)."""
    window = dict(csa_window=32, hca_window=32)
    window_only = _model(_ext(pattern, csa_compress_rate=32, hca_compress_rate=32, **window))
    compressed = _model(_ext(pattern, **window))
    for (name, p), other in zip(window_only.named_parameters(), compressed.parameters()):
        assert torch.equal(p, other) or name.endswith("position_bias"), name
    assert not torch.allclose(_loss(compressed), _loss(window_only))


@pytest.mark.parametrize("pattern", ["C", "H"])
def test_vanilla_softmax_gets_the_v4_sink(pattern):
    """V4's sink is part of the layer: softmax_type="vanilla" gives a learnable, zero-initialised
    logit per head, which trains."""
    model = _model(_ext(pattern))
    sink = model.decoder.layers[0].self_attention.core_attention.softmax_offset
    assert torch.equal(sink, torch.zeros(4))
    _loss(model).backward()
    assert sink.grad.abs().sum() > 0


@pytest.mark.parametrize("pattern,rate", [("C", 4), ("H", 8)])
def test_packed_sequences_with_rope_equal_separate_sequences(pattern, rate, unit_scale):
    """thd packing: blocks, entries, their RoPE positions, the window and CSA's choice restart
    with each sequence."""
    model = _model(_ext(pattern, csa_indexer_dim=16), position_embedding_type="rope")
    harness.assert_packed_equals_separate(model)


def test_csa_each_loss_trains_its_own_parameters(unit_scale):
    """As DSA's: the indexer learns from its KL loss only, the rest from the LM loss only. With
    and without the indexer loss every other gradient is the same; without it, the indexer
    gets none."""
    model = _model(_ext("CH"))
    _loss(model).backward()
    with_loss = _grads(model)
    model.zero_grad(set_to_none=True)
    model.decoder.layers[0].self_attention.core_attention.ext.dsa_indexer_loss_coeff = 0.0
    _loss(model).backward()
    without = _grads(model)
    indexer = sorted(name.split(".indexer.")[1] for name in with_loss if harness.is_indexer(name))
    assert indexer == ["key_norm.weight", "linear_compress.weight", "linear_q.weight",
                       "linear_weights.weight", "position_bias"]
    for name, grad in with_loss.items():
        if harness.is_indexer(name):
            assert grad is not None and grad.abs().sum() > 0, name
            assert without[name] is None, name
        else:
            assert grad is not None, name
            torch.testing.assert_close(grad, without[name], rtol=0, atol=0, msg=name)


def test_csa_dense_warmup_trains_only_the_indexer(unit_scale):
    """dsa_stage="dense_warmup" covers CSA: the freeze keeps only its indexer (and a D layer's)
    trainable, and that indexer gets gradients from its loss over every entry."""
    model = freeze_all_but_indexers(_model(_ext("CHD", dsa_stage="dense_warmup")))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    for _ in range(2):
        _loss(model).backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None) == harness.is_indexer(name), name
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        assert (not torch.equal(p, before[name])) == harness.is_indexer(name), name
    assert any(".layers.0.self_attention.indexer." in name for name in before)


def test_spec_wires_csa_into_megatron():
    """A pattern with C layers gets the indexer loss's scale hook and, in the dense warm-up,
    the freeze; one with only H layers has no indexer, so the warm-up is refused."""
    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2)
    config.pre_wrap_hooks = []  # what GPTModelConfig adds to a TransformerConfig
    block_spec(config, ext=_ext("CH", dsa_stage="dense_warmup"))
    assert config.experimental_attention_variant_loss_scale_func == IndexerLoss.set_loss_scale
    assert config.pre_wrap_hooks == [freeze_all_but_indexers]
    with pytest.raises(ConfigError, match="has no 'D' or 'C' layer"):
        block_spec(harness.tiny_config(num_layers=2), ext=_ext("H*", dsa_stage="dense_warmup"))


def test_megatron_flags_carry_the_settings():
    import argparse

    from megatron_ext.config import add_megatron_args

    args = add_megatron_args(argparse.ArgumentParser()).parse_args(
        ["--ext-pattern", "CH", "--ext-csa-top-k", "1024", "--ext-hca-compress-rate", "64",
         "--ext-csa-window", "64"])
    ext = ExtConfig.from_megatron_args(args).validate(2)
    assert (ext.csa_top_k, ext.hca_compress_rate, ext.csa_window) == (1024, 64, 64)


def test_defaults_are_v4_flash():
    ext = ExtConfig()
    assert (ext.csa_compress_rate, ext.csa_top_k, ext.csa_indexer_heads, ext.csa_indexer_dim,
            ext.csa_window, ext.hca_compress_rate, ext.hca_window) == (4, 512, 64, 128, 128, 128,
                                                                       128)


@pytest.mark.parametrize("options,message", [
    (dict(csa_compress_rate=0), "csa_compress_rate=0 must be a positive integer"),
    (dict(csa_top_k=-1), "csa_top_k=-1 must be a positive integer"),
    (dict(csa_indexer_heads=0), "csa_indexer_heads=0 must be a positive integer"),
    (dict(csa_indexer_dim=2.5), "csa_indexer_dim=2.5 must be a positive integer"),
    (dict(hca_window=True), "hca_window=True must be a positive integer"),
    (dict(hca_window=64), r"hca_window=64 is smaller than hca_compress_rate - 1 = 127"),
    (dict(csa_compress_rate=8, csa_window=4),
     r"csa_window=4 is smaller than csa_compress_rate - 1 = 7"),
])
def test_invalid_settings_fail_clearly(options, message):
    with pytest.raises(ConfigError, match=message):
        ExtConfig(**options).validate()


def test_settings_that_cannot_work_fail_clearly():
    with pytest.raises(ConfigError, match=r"CSA and HCA layers have their own window "
                                          r"\(hca_window\)"):
        _model(_ext("H"), window_size=(6, 0))
    with pytest.raises(ConfigError, match=r"do not take recompute_modules=\['core_attn'\]"):
        _model(_ext("C"), recompute_granularity="selective")
    model = _model(_ext("C"), position_embedding_type="rope")
    with pytest.raises(ConfigError, match="csa_indexer_dim=8 is smaller than the 16 rotary dims"):
        _loss(model)
