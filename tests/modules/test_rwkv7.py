"""RWKV-7's time mixing as a Megatron module: the layer equals RWKV-7 written out token by token in
its own row convention, from the same weights, forward and backward; packed sequences equal
separate ones (token shift and state restart at borders); RWKV-7's low-rank sizes; all-to-all
context parallelism that cannot split the heads is refused by name (CP against one process:
tests/parallel/test_context_parallel.py). Training in a tiny hybrid: test_every_mixer_trains.py; decoding:
test_decoding.py; TP=2 (+SP) against TP=1: tests/parallel/test_parallel_equivalence.py."""

import math
import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers.common import LinearMixerSubmodules
from megatron_ext.mixers.rwkv7 import Rwkv7Mixer, lora_ranks

pytestmark = pytest.mark.usefixtures("megatron_single_process")
HEADS, HEAD_DIM = 4, 16  # harness.tiny_config: 4 heads, hidden 64


def _mixer(backend="chunked", dtype=torch.float32, **ext):
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(5)
    mixer = Rwkv7Mixer(harness.tiny_config(), LinearMixerSubmodules(), layer_number=2,
                       ext_config=ExtConfig(kernel_backend=backend, rwkv7_lora_rank=8, **ext),
                       pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    with torch.no_grad():  # the parameters that start at zero, so that they take part
        for name in ("rate_bias", "bonus", "out_norm_bias"):
            getattr(mixer, name).normal_(std=0.5)
    return mixer.to(dtype)


def _written_out(m, x):
    """RWKV-7's time mixing as its reference code writes it, x ``[s, b, h]`` -> ``[s, b, h]``:
    per head a ``[V, K]`` state, ``wkv_t = wkv_{t-1} (Diag(w_t) - kk_t^T (kk_t * a_t)) + v_t^T k_t``
    (row vectors), ``y_t = wkv_t r_t``."""
    x = x.transpose(0, 1)  # [b, s, h]
    batch, length = x.shape[:2]
    xx = F.pad(x, (0, 0, 1, -1)) - x  # time_shift(x) - x
    xr, xw, xk, xv, xa, xg = (x + xx * mix for mix in m.token_shift)

    def lin(layer, t):
        return t @ layer.weight.T

    def split(t):
        return t.view(batch, length, HEADS, -1)

    r, k, v = split(lin(m.linear_r, xr)), lin(m.linear_k, xk), split(lin(m.linear_v, xv))
    w = -math.exp(-0.5) * torch.sigmoid(m.decay_bias + lin(m.linear_w_up, torch.tanh(lin(m.linear_w_down, xw))))
    a = torch.sigmoid(m.rate_bias + lin(m.linear_a_up, lin(m.linear_a_down, xa)))
    g = lin(m.linear_g_up, torch.sigmoid(lin(m.linear_g_down, xg)))
    kk = F.normalize(split(k * m.removal_key_scale), dim=-1)
    k = split(k * (1 + (a - 1) * m.key_rate_mix))
    w, a = split(w).exp(), split(a)

    state = x.new_zeros(batch, HEADS, HEAD_DIM, HEAD_DIM)  # [b, H, V, K]
    outputs = []
    for t in range(length):
        removed = state @ (-kk[:, t]).unsqueeze(-1)  # wkv (-kk)^T: [b, H, V, 1]
        state = (state * w[:, t].unsqueeze(-2) + removed * (kk[:, t] * a[:, t]).unsqueeze(-2)
                 + v[:, t].unsqueeze(-1) * k[:, t].unsqueeze(-2))
        outputs.append((state @ r[:, t].unsqueeze(-1)).squeeze(-1))
    y = torch.stack(outputs, dim=1)  # [b, s, H, V]
    y = F.group_norm(y.reshape(batch * length, -1), HEADS, m.out_norm_weight.flatten(),
                     m.out_norm_bias.flatten(), eps=64e-5).view_as(y)
    y = y + (r * k * m.bonus).sum(-1, keepdim=True) * v
    return lin(m.linear_out, y.flatten(2) * g).transpose(0, 1)


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_layer_equals_rwkv7_written_out(backend):
    """fp64, 37 tokens (over one 32-token chunk): the output and the gradients of the input and of
    every parameter."""
    mixer = _mixer(backend, dtype=torch.float64)
    x = torch.randn(37, 2, 64, dtype=torch.float64, requires_grad=True)
    out, _ = mixer(x)
    expected = _written_out(mixer, x)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    weight = torch.randn_like(out)
    leaves = [x, *mixer.parameters()]
    grads = torch.autograd.grad((out * weight).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * weight).sum(), leaves)
    names = ["input", *(name for name, _ in mixer.named_parameters())]
    for name, grad, expected_grad in zip(names, grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-9, msg=name)


def test_packed_sequences_equal_separate_sequences():
    mixer = _mixer()
    x = torch.randn(24, 1, 64, requires_grad=True)
    cu = torch.tensor([0, 7, 7, 20, 24], dtype=torch.int32)  # an empty sequence among them
    packed, _ = mixer(x, packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13))
    separate = torch.cat([mixer(x[a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a])
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)


def test_lora_ranks_are_rwkv7s():
    """RWKV-7's sizes at hidden 768 (its 0.1B model: 64, 64, 128) and the floor of 32."""
    assert lora_ranks(768) == {"w": 64, "a": 64, "g": 128}
    assert lora_ranks(64) == {"w": 32, "a": 32, "g": 32}
    assert _mixer().linear_g_down.weight.shape == (8, 64)  # rwkv7_lora_rank


def test_all_to_all_it_cannot_split_is_refused_by_name():
    from megatron.core import parallel_state

    class StandInGroup:
        def size(self):
            return 8

        def rank(self):
            return 0

    pg = types.SimpleNamespace(tp=parallel_state.get_tensor_model_parallel_group(), cp=StandInGroup())
    config = harness.tiny_config(context_parallel_size=8)  # 4 heads
    Rwkv7Mixer(config, LinearMixerSubmodules(), layer_number=1, ext_config=ExtConfig(), pg_collection=pg)
    with pytest.raises(ConfigError, match=r"rwkv7: 4 heads .* context_parallel_size=8"):
        Rwkv7Mixer(config, LinearMixerSubmodules(), layer_number=1,
                   ext_config=ExtConfig(context_parallel_method="all_to_all"), pg_collection=pg)
