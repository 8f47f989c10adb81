"""The bundled presets: each loads into RunSettings and validates, the sized ones follow the
seed's 2:1 hybrid stack, and each sized preset builds a model of the size its name states.
Parameter counts are measured on the meta device (exact, no memory) and held to the one size
rule of megatron_ext.launch.presets, not to hard-coded numbers."""

import subprocess
import sys

import pytest

from megatron_ext.config import ConfigError
from megatron_ext.launch import presets
from megatron_ext.pattern import expand_pattern

ALL = presets.list_presets()
SIZED = [name for name in ALL if presets.nominal_size(name) is not None]


def test_the_seed_sizes_are_bundled():
    assert {"hybrid-350m", "hybrid-1.3b", "hybrid-3b"} <= set(SIZED)
    assert presets.nominal_size("hybrid-1.3b") == 1.3e9
    assert presets.nominal_size("some/dir/hybrid-350m.yaml") == 350e6
    assert presets.nominal_size("tiny-hybrid") is None


@pytest.mark.parametrize("name", ALL)
def test_preset_loads_and_validates(name):
    settings = presets.load_settings(name)  # RunSettings.from_dict(...).validate()
    m, t = settings.model, settings.train
    assert len(expand_pattern(settings.ext.pattern, m.num_layers)) == m.num_layers
    assert t.global_batch_size % t.micro_batch_size == 0
    assert 0 <= t.warmup_steps < t.steps
    assert m.num_attention_heads % (m.num_query_groups or m.num_attention_heads) == 0
    assert m.hidden_size % m.num_attention_heads == 0


@pytest.mark.parametrize("name", SIZED)
def test_sized_preset_is_the_seed_hybrid_stack(name):
    """One mixer per layer written out (no repeated single symbol), and softmax attention
    exactly where Megatron's ``--linear-attention-freq 3`` puts it (layer i % 3 == 0)."""
    settings = presets.load_settings(name)
    symbols = settings.ext.pattern.replace(" ", "")
    assert len(symbols) == settings.model.num_layers
    assert [i for i, s in enumerate(symbols, 1) if s == "*"] == list(
        range(3, settings.model.num_layers + 1, 3))
    assert set(symbols) == {"G", "*"}


@pytest.mark.parametrize("name", SIZED)
def test_sized_preset_matches_its_name(name):
    count = presets.check_parameter_count(name)  # raises outside the size rule
    nominal = presets.nominal_size(name)
    assert abs(count / nominal - 1) <= presets.SIZE_TOLERANCE
    # A RunSettings in, or a name in: the same model.
    assert presets.parameter_count(presets.load_settings(name)) == count


def test_size_rule_rejects_a_count_outside_the_band():
    nominal = presets.nominal_size("hybrid-350m")
    inside = round(nominal * (1 - presets.SIZE_TOLERANCE)) + 1000
    outside = round(nominal * (1 + presets.SIZE_TOLERANCE)) + 1000
    assert presets.check_parameter_count("hybrid-350m", count=inside) == inside
    with pytest.raises(ConfigError, match=r"off the 350M its name states"):
        presets.check_parameter_count("hybrid-350m", count=outside)
    with pytest.raises(ConfigError, match="states no size"):
        presets.check_parameter_count("tiny-hybrid", count=1)


def test_vocab_size_enters_through_the_two_untied_embeddings():
    settings = presets.load_settings("hybrid-350m")
    base = presets.parameter_count(settings)
    # 32,000 is already a multiple of 128; 32,001 pads up to 32,128.
    assert presets.parameter_count(settings, vocab_size=32001) - base == (
        2 * 128 * settings.model.hidden_size)


@pytest.mark.usefixtures("megatron_single_process")
def test_meta_count_equals_a_model_built_in_memory():
    """The meta-device build counts exactly what training builds (tiny-hybrid, on the CPU)."""
    import torch

    from megatron_ext import train

    settings = presets.load_settings("tiny-hybrid")
    runtime = train.Runtime(torch.device("cpu"), 0, 1)
    model = train.build_model(settings, train.transformer_config(settings, runtime),
                              train._padded_vocab(settings.data.vocab_size, 1))
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert presets.parameter_count("tiny-hybrid") == sum(p.numel() for p in model.parameters())


def test_wsd_schedule_settings_are_checked():
    from megatron_ext.train import RunSettings

    settings = RunSettings.from_dict(presets.load_preset("hybrid-350m"))
    assert settings.train.decay_style == "WSD" and settings.train.wsd_decay_steps > 0
    settings.train.wsd_decay_steps = settings.train.steps  # longer than after warmup
    with pytest.raises(ConfigError, match="wsd_decay_steps"):
        settings.validate()
    settings.train.wsd_decay_steps = 10
    settings.train.wsd_decay_style = "sqrt"
    with pytest.raises(ConfigError, match="wsd_decay_style='sqrt'"):
        settings.validate()


def test_fewer_steps_keep_the_schedule_shape():
    """`--steps N` scales warmup and the WSD decay phase with the run (a 350M preset run for 300
    steps keeps a valid WSD schedule instead of failing on a decay longer than the run)."""
    settings = presets.load_settings("hybrid-350m")
    t = settings.train
    warmup_share, decay_share = t.warmup_steps / t.steps, t.wsd_decay_steps / t.steps
    t.set_steps(300)
    settings.validate()
    assert t.steps == 300
    assert abs(t.warmup_steps / 300 - warmup_share) <= 0.5 / 300
    assert abs(t.wsd_decay_steps / 300 - decay_share) <= 0.5 / 300
    with pytest.raises(ConfigError, match="at least 2 steps"):
        t.set_steps(1)


def test_presets_command_lists_parameter_counts_in_a_fresh_process():
    """``megatron-ext presets`` as a user first runs it: a new interpreter, where the model's
    modules are first imported while the model is built on the meta device (a module-level
    ``.item()`` once failed there)."""
    result = subprocess.run([sys.executable, "-m", "megatron_ext.cli", "presets"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ALL:
        line = next(row for row in result.stdout.splitlines() if row.split()[:1] == [name])
        assert line.endswith("M parameters"), line
