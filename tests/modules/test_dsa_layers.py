"""DSA layers ('D') inside Megatron models: which parameters each loss trains in the two
training stages, dense equivalences (dense warm-up, top-k covering the sequence), packed
sequences with RoPE, the indexer loss's gradient scale, what the spec wires into Megatron, and
the errors for settings that cannot work."""

import pytest
import torch

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers.dsa import IndexerLoss, freeze_all_but_indexers

pytestmark = pytest.mark.usefixtures("megatron_single_process")

SEQ = harness.SPARSE_SEQ
_model, _loss, _grads = harness.sparse_model, harness.sparse_loss, harness.named_grads


def _ext(pattern="D*", **options):
    return harness.sparse_ext(pattern, **options)


def test_sparse_stage_each_loss_trains_its_own_parameters(unit_scale):
    """Paper, sec. 2.1: the indexer learns from its KL loss only, the rest from the LM loss
    only. With and without the indexer loss, every other gradient is the same; without it,
    the indexer gets none."""
    model = _model(_ext())
    _loss(model).backward()
    with_loss = _grads(model)
    model.zero_grad(set_to_none=True)
    model.decoder.layers[0].self_attention.core_attention.ext.dsa_indexer_loss_coeff = 0.0
    _loss(model).backward()
    without = _grads(model)
    indexer = [name for name in with_loss if harness.is_indexer(name)]
    assert len(indexer) == 5  # linear_q, linear_k, key_norm (weight, bias), linear_weights
    assert any(name.endswith("indexer.key_norm.bias") for name in indexer)
    for name, grad in with_loss.items():
        if harness.is_indexer(name):
            assert grad is not None and grad.abs().sum() > 0, name
            assert without[name] is None, name
        else:
            torch.testing.assert_close(grad, without[name], rtol=0, atol=0, msg=name)


def test_dense_warmup_trains_only_the_indexer(unit_scale, indexer_losses):
    """Dense warm-up: after freeze_all_but_indexers only the indexer has gradients and moves
    under the optimizer, and its KL loss to the attention falls."""
    losses = indexer_losses
    model = freeze_all_but_indexers(_model(_ext("D", dsa_stage="dense_warmup")))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(8):
        _loss(model).backward()
        for name, p in model.named_parameters():
            assert (p.grad is not None) == harness.is_indexer(name), name
        optimizer.step()
        optimizer.zero_grad()
    for name, p in model.named_parameters():
        changed = not torch.equal(p, before[name])
        assert changed == harness.is_indexer(name), name
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("stage,top_k", [("dense_warmup", 4), ("sparse", SEQ)])
def test_dense_attention_cases_equal_the_attention_layer(stage, top_k, unit_scale):
    """The dense warm-up, and a top-k that covers the sequence, compute '*' attention: with
    the '*' model's weights the LM loss is the same."""
    options = dict(softmax_type="learnable", qk_layernorm=True)
    attention = _model(_ext("*"), **options)
    dsa = _model(_ext("D", dsa_stage=stage, dsa_top_k=top_k), **options)
    missing, unexpected = dsa.load_state_dict(attention.state_dict(), strict=False)
    assert not unexpected and missing and all(harness.is_indexer(name) for name in missing)
    with torch.no_grad():
        for m in (attention, dsa):
            m.decoder.layers[0].self_attention.core_attention.softmax_offset.copy_(
                torch.tensor([1.0, -2.0, 0.5, 3.0]))
    torch.testing.assert_close(_loss(dsa), _loss(attention), rtol=1e-5, atol=1e-6)


def test_top_k_changes_the_output():
    full, sparse_model = _model(_ext("D", dsa_top_k=SEQ)), _model(_ext("D", dsa_top_k=3))
    sparse_model.load_state_dict(full.state_dict())
    assert not torch.allclose(_loss(sparse_model), _loss(full))


def test_packed_sequences_with_rope_equal_separate_sequences(unit_scale):
    """thd packing: the indexer's RoPE restarts and its choice stays inside each sequence."""
    model = _model(_ext("D", dsa_top_k=4, dsa_indexer_dim=16), position_embedding_type="rope")
    harness.assert_packed_equals_separate(model)


def test_indexer_loss_gradient_follows_the_scale(unit_scale):
    """Megatron's schedule sets the scale to loss scale / micro-batches; the indexer's
    gradient scales with it, the rest of the model's does not move."""
    model = _model(_ext())
    _loss(model).backward()
    unit = _grads(model)
    model.zero_grad(set_to_none=True)
    IndexerLoss.set_loss_scale(torch.tensor(0.25))
    _loss(model).backward()
    for name, grad in _grads(model).items():
        expected = 0.25 * unit[name] if harness.is_indexer(name) else unit[name]
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=0, msg=name)


def test_spec_wires_dsa_into_megatron():
    """block_spec hands Megatron's schedule the loss-scale hook and, given a GPTModelConfig
    (which has pre_wrap_hooks), the dense warm-up's freeze, once."""
    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2)
    config.pre_wrap_hooks = []  # what GPTModelConfig adds to a TransformerConfig
    ext = _ext(dsa_stage="dense_warmup")
    block_spec(config, ext=ext)
    block_spec(config, ext=ext)
    assert config.experimental_attention_variant_loss_scale_func == IndexerLoss.set_loss_scale
    assert config.pre_wrap_hooks == [freeze_all_but_indexers]
    sparse_config = harness.tiny_config(num_layers=2)
    sparse_config.pre_wrap_hooks = []
    block_spec(sparse_config, ext=_ext())
    assert sparse_config.pre_wrap_hooks == []


def test_megatron_flags_carry_the_dsa_settings():
    import argparse

    from megatron_ext.config import add_megatron_args

    args = add_megatron_args(argparse.ArgumentParser()).parse_args(
        ["--ext-pattern", "D*", "--ext-dsa-top-k", "512", "--ext-dsa-stage", "dense_warmup",
         "--ext-dsa-indexer-loss-coeff", "0.5"])
    ext = ExtConfig.from_megatron_args(args).validate(2)
    assert (ext.dsa_top_k, ext.dsa_stage, ext.dsa_indexer_loss_coeff) == (
        512, "dense_warmup", 0.5)


@pytest.mark.parametrize("options,message", [
    (dict(dsa_top_k=0), "dsa_top_k=0 must be a positive integer"),
    (dict(dsa_indexer_heads=0), "dsa_indexer_heads=0 must be a positive integer"),
    (dict(dsa_indexer_dim=-8), "dsa_indexer_dim=-8 must be a positive integer"),
    (dict(dsa_stage="warmup"), r"dsa_stage='warmup' is not one of \['dense_warmup', 'sparse'\]"),
    (dict(dsa_indexer_loss_coeff=-1.0), "dsa_indexer_loss_coeff=-1.0 must be a finite number"),
])
def test_invalid_settings_fail_clearly(options, message):
    with pytest.raises(ConfigError, match=message):
        ExtConfig(**options).validate()


def test_settings_that_cannot_work_fail_clearly():
    with pytest.raises(ConfigError, match="dsa_stage='dense_warmup' trains only the indexers"):
        _model(_ext("*", dsa_stage="dense_warmup"))
    with pytest.raises(ConfigError, match="DSA picks its own keys"):
        _model(_ext("D"), window_size=(6, 0))
    with pytest.raises(ConfigError, match=r"do not take recompute_modules=\['core_attn'\]"):
        _model(_ext("D"), recompute_granularity="selective")
    model = _model(_ext("D", dsa_indexer_dim=4), position_embedding_type="rope")
    with pytest.raises(ConfigError, match="dsa_indexer_dim=4 is smaller than the 16 rotary dims"):
        _loss(model)
