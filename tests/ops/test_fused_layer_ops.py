"""The fused layer kernels (kernels/fused/triton.py: short conv + SiLU + L2 norm, gated RMSNorm,
RoPE, cross-entropy) against their fp32 reference, forward and backward, on a GPU; ``check_*`` take a device so
that tests/ops/test_triton_interpret_fused.py runs the same checks on Triton's CPU
interpreter."""
import pytest
import torch

from megatron_ext.kernels.fused import ops, reference

pytestmark = pytest.mark.gpu

# The first-use check's cases (T = 45 across the 32-token blocks, packed sequences of 5, 33 and
# 7 tokens, a transposed [s, b, C] input, per-head and shared norm weights) and, at the 350M
# preset's sizes, a long sequence: 4 key heads of 64 with the L2 norm, 16 value heads of 64.
LARGE_CASES = [  # (batch, length, channels, l2 head dim or None, filter taps)
    (2, 4099, 256, 64, 4),
    (1, 4096, 1024, None, 4),
    (2, 1000, 512, 128, 3),
]


def check_first_use_cases(device, dtype) -> dict[str, float]:
    errors = ops.check_errors(device, dtype)
    over = {k: v for k, v in errors.items() if not v <= ops.CHECK_TOLERANCE[dtype]}
    assert not over, over
    return errors


def compare_with_reference(fast, slow, inputs, probe, names, dtype, what=None):
    """Outputs and input gradients of ``fast(*inputs)`` (the Triton kernels, inputs as given)
    and ``slow(*inputs)`` (the fp32 reference, inputs in fp32), through ``(y * probe).sum()``:
    their relative errors by ``names`` (asserted within the dtype's tolerance) and the fast
    run's input gradients."""
    from megatron_ext.kernels.first_use import relative_error

    results = []
    for run, cast in ((fast, lambda t: t), (slow, lambda t: t.float())):
        leaves = [cast(t).detach().clone().requires_grad_() for t in inputs]
        y = run(*leaves)
        (y.float() * probe).sum().backward()
        results.append((y, *(leaf.grad for leaf in leaves)))
    errors = {name: relative_error(a.float(), b.float()) for name, a, b in zip(names, *results)}
    over = {k: v for k, v in errors.items() if not v <= ops.CHECK_TOLERANCE[dtype]}
    assert not over, (what, over)
    return errors, results[0][1:]


def check_large(case, device, dtype=torch.bfloat16) -> dict[str, float]:
    """Output and gradients of the Triton short conv on a transposed [s, b, C] input against
    the fp32 reference (on the same device), and the input gradient's strides."""
    batch, length, channels, l2, taps = case
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(length, batch, channels, generator=gen).to(device, dtype).transpose(0, 1)
    w = (torch.randn(channels, taps, generator=gen) * 0.5).to(device, dtype)
    probe = torch.randn(batch, length, channels, generator=gen).to(device)
    errors, (dx, _) = compare_with_reference(
        lambda x, w: ops.short_conv(x, w, None, l2, backend="triton"),
        lambda x, w: reference.short_conv(x, w, None, l2), [x, w], probe, ("y", "dx", "dw"),
        dtype, case)
    assert dx.transpose(0, 1).is_contiguous()  # the gradient stays in [s, b, C]
    return errors


def check_rope_large(device, dtype=torch.bfloat16) -> dict[str, float]:
    """RoPE at the 350M preset's query shape (T = 4096, micro-batch 4, 16 heads of 64, angles
    up to 4095 rad, as a strided slice of a wider projection) against the fp32 reference."""
    length, batch, heads, dim = 4096, 4, 16, 64
    gen = torch.Generator().manual_seed(2)
    wider = torch.randn(length, batch, heads + 8, dim, generator=gen).to(device, dtype)
    t = wider[:, :, 4:4 + heads]
    theta = 500000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(length, dtype=torch.float32)[:, None] * theta
    freqs = torch.cat((angles, angles), dim=-1).view(length, 1, 1, dim).to(device)
    probe = torch.randn(length, batch, heads, dim, generator=gen).to(device)
    return compare_with_reference(lambda t: ops.rope(t, freqs, "triton"),
                                  lambda t: reference.rope(t, freqs), [t], probe, ("y", "dt"),
                                  dtype)[0]


def check_cross_entropy(device, dtype=torch.bfloat16, length=4096, batch=1,
                        vocab=32000) -> dict[str, float]:
    """Cross-entropy of ``[s, b, V]`` logits (as an output layer gives them; by default the
    presets' T = 4096 and 32,000-token vocabulary) against the fp32 definition over the whole
    vocabulary."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(length, batch, vocab, generator=gen) * 4).to(device, dtype)
    target = torch.randint(0, vocab, (length, batch), generator=gen).to(device)
    probe = torch.randn(length, batch, generator=gen).to(device)
    return compare_with_reference(lambda x: ops.cross_entropy(x, target, backend="triton"),
                                  lambda x: reference.cross_entropy(x, target), [logits], probe,
                                  ("loss", "dlogits"), dtype)[0]


def check_rms_norm_strided_programs(device, dtype=torch.float32) -> dict[str, float]:
    """RMSNorm's backward with fewer programs than row tiles (each program sums the weight
    gradient of several tiles), 50 rows of 40 channels, against the fp32 reference."""
    from megatron_ext.kernels.fused import triton as kernels

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 10, 40, generator=gen).to(device, dtype)
    w = (torch.randn(40, generator=gen) * 0.3 + 1).to(device, dtype)
    probe = torch.randn(5, 10, 40, generator=gen).to(device)
    programs, kernels.RMS_BWD_PROGRAMS = kernels.RMS_BWD_PROGRAMS, 3
    try:
        return compare_with_reference(lambda x, w: ops.rms_norm(x, w, 1e-5, "triton"),
                                      lambda x, w: reference.rms_norm(x, w, 1e-5), [x, w], probe,
                                      ("y", "dx", "dw"), dtype)[0]
    finally:
        kernels.RMS_BWD_PROGRAMS = programs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_first_use_cases(dtype):
    check_first_use_cases("cuda", dtype)


@pytest.mark.parametrize("case", LARGE_CASES)
def test_large(case):
    check_large(case, "cuda")


def test_rms_norm_strided_programs():
    check_rms_norm_strided_programs("cuda")


def test_rope_large():
    check_rope_large("cuda")


def test_cross_entropy_large():
    check_cross_entropy("cuda")


def test_fused_rms_norm_module_matches_torchs():
    """The layers' RMSNorm module on the GPU (Triton) against torch.nn.RMSNorm, bf16, at the
    350M preset's hidden size over 4 x 4096 tokens, forward and backward."""
    from megatron_ext.kernels.first_use import relative_error
    from megatron_ext.norm import FusedRMSNorm

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4096, 4, 1024, generator=gen).to("cuda", torch.bfloat16)
    probe = torch.randn(4096, 4, 1024, generator=gen).to("cuda")
    weight = (torch.randn(1024, generator=gen) * 0.3 + 1).to("cuda")
    results = []
    for cls, dtype in ((FusedRMSNorm, torch.bfloat16), (torch.nn.RMSNorm, torch.float32)):
        norm = cls(1024, eps=1e-5, device="cuda", dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
        xi = x.to(dtype).detach().clone().requires_grad_()
        y = norm(xi)
        (y.float() * probe).sum().backward()
        results.append((y, xi.grad, norm.weight.grad))
    errors = {name: relative_error(a.float(), b.float())
              for name, a, b in zip(("y", "dx", "dw"), *results)}
    assert all(e <= ops.CHECK_TOLERANCE[torch.bfloat16] for e in errors.values()), errors


def test_auto_runs_triton_after_its_check():
    assert ops.first_use_check(torch.device("cuda", 0), torch.bfloat16)


def test_first_use_under_no_grad_checks_the_backward_too():
    """A first use inside torch.no_grad() (generation) passes the check, backward included."""
    ops.first_use_check.cache_clear()
    with torch.no_grad():
        assert ops.first_use_check(torch.device("cuda", 0), torch.float32)


@pytest.mark.usefixtures("megatron_on_cuda")
def test_megatron_loss_slot_runs_our_cross_entropy():
    """After provide_fused_cross_entropy, a GPT model's loss (Megatron's fused cross-entropy
    slot) is megatron_ext.cross_entropy's, and equals Megatron's own function in loss and
    gradient (bf16 logits)."""
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megatron.core.models.common.language_module import language_module

    from megatron_ext.cross_entropy import provide_fused_cross_entropy, vocab_parallel_cross_entropy

    provide_fused_cross_entropy()
    assert language_module.fused_vocab_parallel_cross_entropy is vocab_parallel_cross_entropy
    gen = torch.Generator().manual_seed(6)
    logits = (torch.randn(300, 2, 5000, generator=gen) * 4).cuda().bfloat16()
    target = torch.randint(0, 5000, (300, 2), generator=gen).cuda()
    probe = torch.randn(300, 2, generator=gen).cuda()
    group = parallel_state.get_tensor_model_parallel_group()
    results = []
    for function in (vocab_parallel_cross_entropy, fused_vocab_parallel_cross_entropy):
        leaf = logits.clone().requires_grad_()
        loss = function(leaf, target, group)
        (loss * probe).sum().backward()
        results.append((loss, leaf.grad))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(results[0][1].float(), results[1][1].float(), atol=1e-3, rtol=1e-2)
