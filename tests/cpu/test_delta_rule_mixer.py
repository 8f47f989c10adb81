"""The delta-rule mixers (DeltaNet, GDN, KDA, GDN-2) as Megatron modules: packed sequences equal
separate ones (convolution and state reset at borders), the op backends agree inside the
module, and shapes/configuration errors are clear."""

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams

import harness
from megatron_ext.config import ConfigError, ExtConfig
from megatron_ext.mixers.common import LinearMixerSubmodules
from megatron_ext.mixers.delta_rule import VARIANTS, DeltaRuleMixer

pytestmark = pytest.mark.usefixtures("megatron_single_process")


def _mixer(variant, backend="auto", **ext):
    from megatron.core.process_groups_config import ProcessGroupCollection

    torch.manual_seed(3)
    return DeltaRuleMixer(harness.tiny_config(), LinearMixerSubmodules(), layer_number=1,
                          ext_config=ExtConfig(kernel_backend=backend, **ext), variant=variant,
                          pg_collection=ProcessGroupCollection.use_mpu_process_groups())


@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_sequences_equal_separate_sequences(variant):
    mixer = _mixer(variant)
    lengths = [7, 13, 4]
    x = torch.randn(sum(lengths), 1, 64, requires_grad=True)
    cu = torch.tensor([0, 7, 20, 24], dtype=torch.int32)
    packed, _ = mixer(x, packed_seq_params=PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=13, max_seqlen_kv=13))
    separate = torch.cat([mixer(x[a:b])[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(packed, separate, rtol=1e-5, atol=1e-6)
    g_packed, = torch.autograd.grad(packed.square().sum(), x)
    g_separate, = torch.autograd.grad(separate.square().sum(), x)
    torch.testing.assert_close(g_packed, g_separate, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_backend_equals_reference_inside_the_module(variant):
    x = torch.randn(70, 2, 64)  # longer than one 64-token chunk, odd length
    outs = []
    for backend in ("reference", "chunked"):
        mixer = _mixer(variant, backend)
        out, _ = mixer(x)
        grads = torch.autograd.grad(out.square().sum(), list(mixer.parameters()))
        outs.append((out, grads))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-4, atol=1e-5)
    for a, b in zip(outs[1][1], outs[0][1]):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_gates_have_the_shapes_of_their_variant():
    params = {v: dict(_mixer(v).named_parameters()) for v in VARIANTS}
    assert "A_log" not in params["deltanet"]
    assert params["gated_deltanet"]["dt_bias"].shape == (4,)          # one decay per value head
    assert params["kda"]["dt_bias"].shape == (4 * 16,)                # one per key channel
    assert "linear_erase.weight" in params["gated_deltanet2"]
    assert "linear_beta.weight" not in params["gated_deltanet2"]


def test_bad_head_counts_fail_with_the_fix():
    with pytest.raises(ConfigError, match="multiple of linear_num_key_heads=3"):
        _mixer("gated_deltanet", linear_num_key_heads=3, linear_num_value_heads=4)
