"""RoPE scaling (megatron_ext.rope) against the closed forms of each method, installed in a
GPTModel by megatron-ext's model builder, and the settings' refusals."""

import math

import pytest
import torch

from megatron_ext import train
from megatron_ext.config import ConfigError
from megatron_ext.rope import ScaledRotaryEmbedding, scaled_inv_freq, yarn_logit_scale

pytestmark = pytest.mark.usefixtures("megatron_single_process")

DIM, BASE, FACTOR, ORIGINAL = 16, 10000.0, 4.0, 2048


def angles(method, length=256):
    """Rotation angles ``[length, DIM / 2]`` of the scaled table."""
    rope = ScaledRotaryEmbedding(DIM, BASE, method, FACTOR, ORIGINAL)
    emb = rope.get_emb(length)  # [length, 1, 1, DIM]: the angles twice
    return emb[:, 0, 0, :DIM // 2].double()


def closed_form(base=BASE, position_scale=1.0, length=256):
    theta = base ** (-torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    return torch.arange(length, dtype=torch.float64)[:, None] / position_scale * theta


def test_linear_interpolates_positions():
    torch.testing.assert_close(angles("linear"), closed_form(position_scale=FACTOR), rtol=1e-6, atol=1e-5)


def test_ntk_raises_the_base():
    torch.testing.assert_close(angles("ntk"), closed_form(BASE * FACTOR ** (DIM / (DIM - 2))),
                               rtol=1e-6, atol=1e-5)
    theta = scaled_inv_freq(DIM, BASE, "ntk", FACTOR, ORIGINAL).double()
    plain = closed_form(length=2)[1]
    assert theta[0] == pytest.approx(plain[0])  # the highest frequency is kept ...
    assert theta[-1] == pytest.approx(plain[-1] / FACTOR)  # ... the lowest interpolated by s


def test_dynamic_ntk_follows_the_length():
    torch.testing.assert_close(angles("dynamic_ntk", ORIGINAL), closed_form(length=ORIGINAL),
                               rtol=1e-6, atol=1e-5)
    length = 3 * ORIGINAL
    stretch = FACTOR * length / ORIGINAL - (FACTOR - 1)
    torch.testing.assert_close(angles("dynamic_ntk", length),
                               closed_form(BASE * stretch ** (DIM / (DIM - 2)), length=length),
                               rtol=1e-6, atol=1e-5)


def test_yarn_keeps_fast_and_interpolates_slow_frequencies():
    theta = closed_form(length=2)[1]
    rotations = ORIGINAL * theta / (2 * math.pi)
    got = scaled_inv_freq(DIM, BASE, "yarn", FACTOR, ORIGINAL).double()
    for plain, r, scaled in zip(theta, rotations, got):
        if r > 32:
            assert scaled == pytest.approx(plain)
        elif r < 1:
            assert scaled == pytest.approx(plain / FACTOR)
        else:
            ramp = (r - 1) / 31
            assert scaled == pytest.approx(ramp * plain + (1 - ramp) * plain / FACTOR)
    assert (rotations > 32).any() and (rotations < 1).any() and ((rotations > 1) & (rotations < 32)).any()
    assert yarn_logit_scale(FACTOR) == pytest.approx((0.1 * math.log(FACTOR) + 1) ** 2)


def _settings(method):
    return train.RunSettings.from_dict({
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                  "seq_length": 32, "position_embedding_type": "rope",
                  "rope_scaling": method, "rope_scaling_factor": FACTOR},
        "ext": {"pattern": "G*"}, "data": {"vocab_size": 96},
    }).validate()


@pytest.mark.parametrize("method", ["linear", "yarn"])
def test_the_model_builder_installs_it(method):
    from megatron_ext.hf import build_gpt_model
    from megatron_ext.mixers.attention import SoftmaxCoreAttention

    model = build_gpt_model(_settings(method), 128)
    with torch.no_grad():  # the builder leaves the weights to a checkpoint
        for p in model.parameters():
            p.normal_(0, 0.02)
    rope = model.rotary_pos_emb
    assert isinstance(rope, ScaledRotaryEmbedding) and rope.method == method
    assert rope.original == 32  # the preset's seq_length by default
    cores = [m for m in model.modules() if isinstance(m, SoftmaxCoreAttention)]
    assert len(cores) == 1
    want = 16 ** -0.5 * (yarn_logit_scale(FACTOR) if method == "yarn" else 1)
    assert (cores[0].softmax_scale or 16 ** -0.5) == pytest.approx(want)
    tokens = torch.randint(0, 96, (1, 40))
    assert torch.isfinite(model(tokens, torch.arange(40)[None], None)).all()


@pytest.mark.parametrize("model, message", [
    ({"rope_scaling": "ntk-by-parts"}, "is not one of"),
    ({"rope_scaling": "yarn", "rope_scaling_factor": 0.5}, "must be a number >= 1"),
    ({"rope_scaling": "linear", "position_embedding_type": "none"}, "use 'rope'"),
])
def test_bad_settings_are_refused(model, message):
    with pytest.raises(ConfigError, match=message):
        train.RunSettings.from_dict({"model": model}).validate()
