"""Pattern parsing, its errors, and per-stage layer selection (no process group needed)."""

import pytest

from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.pattern import check_pipeline_split, expand_pattern, stage_layer_indices
from megatron_ext.registry import MIXERS, lookup

import harness


def names(mixers):
    return [m.name for m in mixers]


def test_symbols_and_names_give_the_same_layers():
    by_symbols = expand_pattern("GG*G", 4)
    by_names = expand_pattern(["gated_deltanet", "G", "attention", "gated_deltanet"], 4)
    assert names(by_symbols) == names(by_names) == [
        "gated_deltanet", "gated_deltanet", "attention", "gated_deltanet"]


def test_single_entry_repeats_and_spaces_are_ignored():
    assert names(expand_pattern("*", 3)) == ["attention"] * 3
    assert names(expand_pattern("G G *", 3)) == ["gated_deltanet", "gated_deltanet", "attention"]


def test_megatron_symbols_keep_their_meaning():
    assert lookup("*").name == "attention"
    assert lookup("G").name == "gated_deltanet"
    assert len({m.symbol for m in MIXERS}) == len(MIXERS)


def test_unknown_symbol_lists_the_known_ones():
    with pytest.raises(ConfigError) as e:
        expand_pattern("GX*", 3)
    assert "'X'" in str(e.value) and "'G' gated_deltanet" in str(e.value)


def test_wrong_length_names_value_and_fix():
    with pytest.raises(ConfigError, match=r"describes 3 layers but num_layers=4.*exactly 4"):
        expand_pattern("GG*", 4)


def test_empty_pattern_rejected():
    with pytest.raises(ConfigError, match="empty"):
        expand_pattern("", 4)


def test_config_validation_names_field():
    with pytest.raises(ConfigError, match="attention_backend='flash'"):
        ExtConfig(attention_backend="flash").validate()
    with pytest.raises(ConfigError, match="linear_num_key_heads=0"):
        ExtConfig(linear_num_key_heads=0).validate()
    with pytest.raises(ConfigError, match="unknown megatron-ext setting"):
        ExtConfig.from_dict({"patern": "G"})


def test_megatron_argparse_roundtrip():
    import argparse

    from megatron_ext.config import add_megatron_args

    parser = add_megatron_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ext-pattern", "gated_deltanet,attention",
                              "--ext-linear-conv-kernel", "3"])
    ext = ExtConfig.from_megatron_args(args)
    assert ext.pattern == ["gated_deltanet", "attention"] and ext.linear_conv_kernel == 3
    assert ext.attention_backend == "auto"


def test_env_yaml_config(tmp_path, monkeypatch):
    from megatron_ext.config import ENV_CONFIG, resolve

    path = tmp_path / "ext.yaml"
    path.write_text("ext:\n  pattern: 'G*'\n")
    monkeypatch.setenv(ENV_CONFIG, str(path))
    assert resolve().pattern == "G*"
    monkeypatch.setenv(ENV_CONFIG, str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="does not exist"):
        resolve()


@pytest.mark.parametrize("pp,vpp,expected", [
    (2, None, [[0, 1, 2, 3], [4, 5, 6, 7]]),
    # With VPP, rank r's chunk v holds global layers (v * pp + r) * per_chunk ...
    (2, 2, [[0, 1], [4, 5], [2, 3], [6, 7]]),
])
def test_stage_layer_indices(pp, vpp, expected):
    config = harness.tiny_config(num_layers=8, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    got = [stage_layer_indices(config, vp_stage=v, pp_rank=r)
           for r in range(pp) for v in ([None] if vpp is None else range(vpp))]
    assert got == expected


def test_impossible_pipeline_split_fails_early():
    config = harness.tiny_config(num_layers=6, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=None)
    check_pipeline_split(config)
    config.virtual_pipeline_model_parallel_size = 2
    with pytest.raises(ConfigError, match="each stage has 3 layers, not divisible"):
        check_pipeline_split(config)
    config.virtual_pipeline_model_parallel_size = None
    config.pipeline_model_parallel_size = 4
    with pytest.raises(ConfigError, match="num_layers=6 cannot be split evenly"):
        check_pipeline_split(config)
