"""megatron_ext.norm: the norm modules the layer specs use without Transformer Engine."""
import harness
import torch

from megatron_ext.norm import FusedRMSNorm, TorchNorm


def test_rms_norm_is_torchs_module_with_sequence_parallel_weights():
    """A torch.nn.RMSNorm (checkpoint key ``weight``), its weight marked for the SP gradient
    all-reduce; on a CPU it computes what torch's RMSNorm does."""
    config = harness.tiny_config(sequence_parallel=False)
    norm = TorchNorm(config, 64, eps=1e-5)
    assert isinstance(norm, FusedRMSNorm) and isinstance(norm, torch.nn.RMSNorm)
    assert list(norm.state_dict()) == ["weight"]
    assert norm.weight.sequence_parallel is False
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    plain = torch.nn.RMSNorm(64, eps=1e-5)
    plain.load_state_dict(norm.state_dict())
    x = torch.randn(7, 2, 64)
    torch.testing.assert_close(norm(x), plain(x), rtol=0, atol=0)
