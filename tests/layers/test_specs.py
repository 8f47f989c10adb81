"""The spec entry points: block_spec for user code, `hybrid_block` (megatron-core 0.19's
callable `--spec` form, through its GPTModelBuilder) and `hybrid_layer` (the spec-object form),
plus MoE FFNs and the checkpoint layout they need."""

import pytest
import torch

import harness

pytestmark = pytest.mark.usefixtures("megatron_single_process")

PATTERN = "G*GG"


def _mixers(model):
    """Each layer's mixer: the delta-rule variant, or the module's class name."""
    return [getattr(layer.self_attention, "variant", type(layer.self_attention).__name__)
            for layer in model.decoder.layers]


def _forward_backward(model, vocab=96):
    tokens = torch.randint(0, vocab, (2, 33))
    loss = model(tokens, torch.arange(33).expand(2, -1), None, labels=tokens).mean()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    return loss


@pytest.fixture
def ext_yaml(tmp_path, monkeypatch):
    from megatron_ext.config import ENV_CONFIG

    path = tmp_path / "ext.yaml"
    path.write_text(f"ext:\n  pattern: '{PATTERN}'\n")
    monkeypatch.setenv(ENV_CONFIG, str(path))
    return path


def test_block_spec_for_user_code():
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = harness.tiny_config()
    model = GPTModel(config, block_spec(config, pattern=PATTERN), vocab_size=96,
                     max_sequence_length=64, position_embedding_type="none")
    assert _mixers(model) == ["gated_deltanet", "SelfAttention", "gated_deltanet", "gated_deltanet"]
    assert config.hetereogenous_dist_checkpoint  # mixed layers need per-layer checkpoint keys
    _forward_backward(model)


def test_hybrid_block_through_megatron_gpt_model_builder(ext_yaml):
    """pretrain_gpt.py >= 0.19 calls the named object as f(model_config, vp_stage=...)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.models.gpt import GPTModelBuilder, GPTModelConfig

    from megatron_ext import specs

    model_config = GPTModelConfig(transformer=harness.tiny_config(), vocab_size=96,
                                  seq_length=64, transformer_layer_spec=specs.hybrid_block,
                                  position_embedding_type="none")
    model = GPTModelBuilder(model_config).build_model(
        ProcessGroupCollection.use_mpu_process_groups())
    assert _mixers(model) == ["gated_deltanet", "SelfAttention", "gated_deltanet", "gated_deltanet"]
    _forward_backward(model)


def test_hybrid_layer_object_picks_mixer_by_global_layer_number(ext_yaml):
    """Builders that use the named object as a layer spec fan it out to every layer."""
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import hybrid_layer

    config = harness.tiny_config()
    model = GPTModel(config, hybrid_layer, vocab_size=96, max_sequence_length=64,
                     position_embedding_type="none")
    assert _mixers(model) == ["gated_deltanet", "SelfAttention", "gated_deltanet", "gated_deltanet"]
    _forward_backward(model)


def test_spec_entry_point_without_settings_explains_how_to_give_them(monkeypatch):
    from megatron_ext.config import ENV_CONFIG, ConfigError
    from megatron_ext.specs import hybrid_block

    monkeypatch.delenv(ENV_CONFIG, raising=False)
    with pytest.raises(ConfigError, match="--ext-pattern.*MEGATRON_EXT_CONFIG"):
        hybrid_block(harness.tiny_config())


def test_moe_ffn_when_configured():
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.specs import block_spec

    config = harness.tiny_config(num_layers=2, num_moe_experts=4, moe_router_topk=2,
                                 moe_token_dispatcher_type="allgather")
    model = GPTModel(config, block_spec(config, pattern="G*"), vocab_size=96,
                     max_sequence_length=64, position_embedding_type="none")
    assert [type(layer.mlp).__name__ for layer in model.decoder.layers] == ["MoELayer"] * 2
    _forward_backward(model)


def test_pure_attention_keeps_megatron_stacked_checkpoint_layout():
    from megatron_ext.specs import block_spec

    config = harness.tiny_config()
    block_spec(config, pattern="*")
    assert not config.hetereogenous_dist_checkpoint


@pytest.mark.parametrize("routing", ["clvr", "cler_h"])
def test_cross_layer_routing_adds_the_projected_signal_and_starts_at_baseline(routing):
    from megatron.core.models.gpt import GPTModel

    from megatron_ext.config import ExtConfig
    from megatron_ext.specs import block_spec

    def build(cross_layer_routing):
        config = harness.tiny_config(num_layers=2)
        torch.manual_seed(0)
        ext = ExtConfig(pattern="G*", cross_layer_routing=cross_layer_routing)
        return GPTModel(config, block_spec(config, ext=ext), vocab_size=96,
                        max_sequence_length=64, position_embedding_type="none")

    routed, plain = build(routing), build("none")
    tokens = torch.randint(0, 96, (2, 17))
    positions = torch.arange(17).expand(2, -1)
    # P_l is zero-initialised: the routed model starts as the plain one.
    torch.testing.assert_close(routed(tokens, positions, None, labels=tokens),
                               plain(tokens, positions, None, labels=tokens))
    assert routed.decoder.layers[1].routing_projection is None  # attention does not route

    layer = routed.decoder.layers[0]
    hidden = torch.randn(17, 2, 64)
    base, _ = layer(hidden)  # P_l = 0: the layer without the routing term
    torch.nn.init.normal_(layer.routing_projection.weight)
    out, _ = layer(hidden)
    _, _, signal = layer.self_attention(layer.input_layernorm(hidden))  # [s, b, Hv * V]
    assert signal.shape == (17, 2, 4 * 16)
    torch.testing.assert_close(out, base + signal @ layer.routing_projection.weight.T)


def test_kernel_overrides_from_each_source_reach_the_registry():
    """ExtConfig.kernel_overrides, from Python, YAML's dict or the flag's text (and back to the
    flag `megatron-ext pretrain` passes), is checked against the registry and set when a model's
    specs are built."""
    import argparse

    from megatron_ext.config import ConfigError, ExtConfig, add_megatron_args
    from megatron_ext.kernels import registry
    from megatron_ext.pretrain import _ext_flags
    from megatron_ext.specs import block_spec

    table = {"short_conv": "reference", "index_scores": "pytorch"}
    args = add_megatron_args(argparse.ArgumentParser()).parse_args(
        ["--ext-kernel-overrides", "short_conv=reference, index_scores=pytorch"])
    assert ExtConfig.from_megatron_args(args).kernel_overrides == table
    assert ExtConfig.from_dict({"kernel_overrides": table}).kernel_overrides == table
    flags = _ext_flags(ExtConfig(kernel_overrides=table))
    assert flags[flags.index("--ext-kernel-overrides") + 1] == "short_conv=reference,index_scores=pytorch"
    assert "--ext-kernel-overrides" not in _ext_flags(ExtConfig())
    with pytest.raises(SystemExit):
        add_megatron_args(argparse.ArgumentParser()).parse_args(["--ext-kernel-overrides", "short_conv"])
    with pytest.raises(ConfigError, match="ext.kernel_overrides=.* expected dict"):
        ExtConfig.from_dict({"kernel_overrides": {"short_conv": 1}})
    for bad, message in (({"conv": "reference"}, "names op 'conv', which the backend registry does "
                                                 "not have; its ops: .*'short_conv'"),
                         ({"short_conv": "flex"}, r"kernel_overrides\['short_conv'\]='flex' is not a "
                                                  r"backend of short_conv; its backends: \['reference', 'triton'\]")):
        with pytest.raises(ConfigError, match=message):
            ExtConfig(kernel_overrides=bad).validate()

    config = harness.tiny_config()
    try:
        block_spec(config, ext=ExtConfig(pattern=PATTERN, kernel_overrides=table))
        assert [registry.named(op) for op in table] == ["reference", "pytorch"]
        block_spec(config, ext=ExtConfig(pattern=PATTERN))
        assert registry.named("short_conv") == "auto"
    finally:
        registry.override({})
