"""The fused layer kernels (kernels/fused/triton.py) on Triton's CPU interpreter, forward and
backward against the fp32 reference, every load and store checked to stay inside its tensors:
this file run as a script runs tests/ops/test_fused_layer_ops.py's first-use cases in fp32 and
bf16, three long cases, RMSNorm's backward with programs over several row tiles and the
cross-entropy over a whole vocabulary of three column blocks. Skipped where
Triton is not installed. ~20 s on two cores."""
import time

import torch

import triton_interpreter
from triton_interpreter import needs_triton


def main() -> None:
    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_fused_layer_ops")
    for dtype in (torch.float32, torch.bfloat16):
        start = time.perf_counter()
        errors = checks.check_first_use_cases("cpu", dtype)
        print(f"first-use cases {dtype}: worst {max(errors.values()):.1e} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    # The second and third: backward programs over several token tiles each, a partial channel
    # block, filters of 3 and 1 taps.
    for case in ((1, 70, 64, 32, 4), (2, 300, 96, None, 3), (1, 150, 32, None, 1)):
        errors = checks.check_large(case, "cpu", torch.float32)
        print(f"long case {case}: worst {max(errors.values()):.1e}")
    errors = checks.check_rms_norm_strided_programs("cpu")
    print(f"rms_norm, programs over several row tiles: worst {max(errors.values()):.1e}")
    errors = checks.check_cross_entropy("cpu", length=9, batch=2, vocab=4500)
    print(f"cross_entropy over the whole vocabulary: worst {max(errors.values()):.1e}")
    print("all interpreter cases passed")


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__)


@needs_triton
def test_wide_filters_take_the_reference(caplog):
    """Filters wider than the kernels' CONV_MAX_TAPS: backend="triton" refuses them by name,
    "auto" runs the reference (here on the CPU, as anywhere) and, where it would have run the
    kernels (the choice for a CUDA tensor, nothing run there), says so once."""
    import pytest

    from megatron_ext.kernels import registry
    from megatron_ext.kernels.fused import ops, reference, triton

    x, w = torch.randn(2, 9, 8), torch.randn(8, triton.CONV_MAX_TAPS + 1)
    with pytest.raises(ValueError, match="at most 4 taps"):
        ops.short_conv(x, w, backend="triton")
    torch.testing.assert_close(ops.short_conv(x, w), reference.short_conv(x, w))
    cuda = torch.device("cuda", 7)  # a device no other test's choice is logged for
    with caplog.at_level("WARNING", logger="megatron_ext.kernels"):
        for taps in (triton.CONV_MAX_TAPS + 1,) * 2:
            facts = registry.Facts(device=cuda, dtype=torch.float32, extra=dict(l2_norm_dim=None, taps=taps))
            assert registry.choose("short_conv", "auto", facts) == "reference"
    assert [r.getMessage() for r in caplog.records] == [
        "megatron-ext: backend='auto' runs short_conv as 'reference' on cuda:7 in float32 (not "
        "'triton': filters of 5 taps (linear_conv_kernel; the Triton kernels take at most 4 taps))"]


def test_reference_conv_is_torch_conv1d_per_sequence():
    """The reference short conv equals torch's Conv1d (causal padding, depthwise) + SiLU run on
    each packed sequence separately; the L2 variant has unit-norm heads."""
    import torch.nn.functional as F

    from megatron_ext.kernels.fused import reference

    gen = torch.Generator().manual_seed(0)
    lengths, channels, width = (3, 9, 1, 6), 8, 4
    x = torch.randn(1, sum(lengths), channels, generator=gen)
    w = torch.randn(channels, width, generator=gen)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    positions = reference.sequence_positions(cu_seqlens, sum(lengths), "cpu")
    expected = torch.cat([
        F.silu(F.conv1d(F.pad(piece.transpose(1, 2), (width - 1, 0)), w.unsqueeze(1),
                        groups=channels)).transpose(1, 2)
        for piece in x.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(reference.short_conv(x, w, positions), expected)
    normed = reference.short_conv(x, w, positions, l2_norm_dim=4).unflatten(-1, (2, 4))
    torch.testing.assert_close(normed.norm(dim=-1), torch.ones(1, sum(lengths), 2))


if __name__ == "__main__":
    main()
