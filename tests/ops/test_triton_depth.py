"""The fused Triton kernels of depth attention (kernels/residual/triton_depth.py) against the
PyTorch path they replace (efficient._depth_forward / _depth_backward), forward and backward,
and efficient.depth_attention with them in place, on CUDA (skipped without a GPU).

``check_launchers`` and ``check_ops`` are the checks; tests/ops/test_triton_interpret_depth.py
also runs them on the CPU under Triton's interpreter (small fp32 and fp16 cases).

``check_launchers`` runs triton_depth.forward / backward and the PyTorch path (eager) on the same
device and inputs: the sources as groups of given sizes, strided views into packed tensors
(``packed[..., 1:, :]``) or, with ``separate``, the last one a tensor of its own; with ``plus``
the first group's last source read as that slot plus a tensor (``last_plus``), and with
``first_grad`` an incoming gradient for the first group (strided, as a slice of a concatenation's
gradient) added to its dv (and, with ``plus``, to the plus's gradient); with ``plus`` the forward
also writes the first group as read (``first_out``, compared bitwise); sources and gradients in
the case's dtype, the query fp32. Cases on
CUDA: h = 1024, T = 8192 + 37 (a partial block of tokens), 2 + 1 and 40 + 1 sources, fp32 and
bf16, and 5 sources in one group without either option; tokens as [3, 13] with four groups.

Tolerances, rtol and atol relative to each output's largest magnitude: fp32 1e-5 (sums in
another order, the GPU's exp and rsqrt; a slip is 1e-2 or more); bf16 / fp16 2^-6 (out and dv
rounded to the dtype from fp32 values that differ in their last bits).

``check_ops`` runs efficient.depth_attention with the kernels in place (their launches counted)
and with them off (the PyTorch path), called as the model calls it (block: the packed input,
its last slot plus the mixer's output, passed on to a later use; full: the packed input plus an
output), and compares values and autograd gradients at the tolerances of
tests/ops/test_residual_ops.py in fp32 (2^-6 in bf16).
"""
import dataclasses
import zlib

import pytest
import torch

from megatron_ext.kernels.residual import efficient
from test_triton_mhc import compare, kernels_backend  # tests/ops is on sys.path

pytestmark = pytest.mark.gpu

EPS = 1e-6
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -6}


@dataclasses.dataclass(frozen=True)
class Case:
    sizes: tuple[int, ...] = (2, 1)  # sources per group
    shape: tuple[int, ...] = (8192 + 37,)  # the token dimensions before [k, h]
    h: int = 1024
    dtype: torch.dtype = torch.float32
    separate: bool = True  # the last group a tensor of its own (else a view as the others)
    plus: bool = True  # the first group's last source plus a tensor (last_plus)
    first_grad: bool = True  # an incoming gradient for the first group

    def __str__(self) -> str:
        parts = ["k" + "+".join(map(str, self.sizes)), "x".join(map(str, self.shape)),
                 f"h{self.h}", str(self.dtype)[6:]]
        return "-".join(parts + ["views"] * (not self.separate) + ["plain"] * (not self.plus)
                        + ["nograd"] * (not self.first_grad))


CASES = [
    Case(),
    Case(dtype=torch.bfloat16),
    Case(sizes=(40, 1)),
    Case(sizes=(40, 1), dtype=torch.bfloat16),
    Case(sizes=(3, 2, 4, 1), shape=(3, 13), h=272, separate=False),
    Case(sizes=(5,), dtype=torch.bfloat16, plus=False, first_grad=False),
]


def _inputs(case: Case, device):
    generator = torch.Generator().manual_seed(zlib.crc32(str(case).encode()))

    def randn(*shape, dtype=case.dtype):
        return torch.randn(*shape, generator=generator).to(dtype).to(device)

    lead, h = case.shape, case.h
    groups = []
    for i, size in enumerate(case.sizes):
        if case.separate and i == len(case.sizes) - 1:
            groups.append(randn(*lead, size, h))
        else:
            groups.append(randn(*lead, size + 1, h)[..., 1:, :])
    plus = randn(*lead, h) if case.plus else None
    # As the slice of a concatenation's gradient: [..., k, h] inside [..., (k + 1) h].
    first_grad = (randn(*lead, (case.sizes[0] + 1) * h)[..., :case.sizes[0] * h]
                  .unflatten(-1, (case.sizes[0], h)) if case.first_grad else None)
    return randn(h, dtype=torch.float32), groups, randn(*lead, h), plus, first_grad


def check_launchers(case: Case, device) -> dict[str, float]:
    """forward and backward against the PyTorch path on ``device``; returns the largest
    differences (relative to each output's largest magnitude) of each."""
    from megatron_ext.kernels.residual import triton_depth

    query, groups, grad, plus, first_grad = _inputs(case, device)
    passed = (torch.empty_like(groups[0], memory_format=torch.contiguous_format) if case.plus
              else None)
    got = triton_depth.forward(query, groups, EPS, plus, passed)
    read = efficient._with_last_plus(groups, plus)
    expected = efficient._depth_forward(query, read, EPS)
    if passed is not None:  # the group as read: the same sums, each rounded to the dtype
        torch.testing.assert_close(passed, read[0], rtol=0, atol=0, msg=f"{case} first_out")
    dquery, dgroups, dplus = triton_depth.backward(query, groups, grad, *expected[1:], EPS, plus,
                                                   first_grad)
    want_dquery, want_dgroups, want_dplus = efficient._depth_backward_pytorch(
        query, groups, grad, *expected[1:], plus, first_grad)
    tolerance = TOLERANCES[case.dtype]
    errors = {"forward": max(compare(a, b, tolerance, f"{case} forward {name}")
                             for a, b, name in zip(got, expected, ("out", "z", "r", "alpha"),
                                                   strict=True))}
    errors["backward"] = compare(dquery, want_dquery, tolerance, f"{case} dquery")
    for i, (a, b) in enumerate(zip(dgroups, want_dgroups, strict=True)):
        errors["backward"] = max(errors["backward"],
                                 compare(a, b, tolerance, f"{case} dgroup {i}"))
    assert (dplus is None) == (plus is None)
    if plus is not None:
        errors["backward"] = max(errors["backward"],
                                 compare(dplus, want_dplus, tolerance, f"{case} dplus"))
    return errors


def check_ops(device, dtype=torch.float32, h: int = 48, sizes=(1, 2, 6, 41)) -> int:
    """efficient.depth_attention on ``device`` with the kernels in place (asserted by counting
    their launches) against it with them off, for K = each of ``sizes``; returns the launches."""
    from megatron_ext.kernels.residual import triton_depth

    originals = {name: getattr(triton_depth, name) for name in ("forward", "backward")}
    launches = []

    def counted(name):
        return lambda *args: launches.append(name) or originals[name](*args)

    generator = torch.Generator().manual_seed(0)

    def leaf(*shape, dtype=dtype):
        return torch.randn(*shape, generator=generator).to(dtype).to(device).requires_grad_()

    if dtype == torch.float32:
        rtol, grad_rtol, atol = 1e-5, 1e-4, 1e-5
    else:
        rtol = grad_rtol = atol = TOLERANCES[dtype]
    lead = (3, 5)
    calls = []
    for k in sizes:
        query = leaf(h, dtype=torch.float32)
        if k == 1:  # the first sublayer: the embedding only
            calls.append((f"K={k}", (query, leaf(*lead, h)),
                          lambda q, p: ([p.unflatten(-1, (1, h))], {})))
        elif k % 2:  # full: the packed input and the layer's first output
            calls.append((f"K={k} full", (query, leaf(*lead, (k - 1) * h), leaf(*lead, h)),
                          lambda q, p, e, k=k: ([p.unflatten(-1, (k - 1, h)), e.unsqueeze(-2)],
                                                {})))
        else:  # block's FFN: the packed input, its last slot plus the mixer's output, passed on
            calls.append((f"K={k} block", (query, leaf(*lead, k * h), leaf(*lead, h)),
                          lambda q, p, e, k=k: ([p.unflatten(-1, (k, h))],
                                                dict(last_plus=e, pass_through=True))))
    # The kernels' first-use checks at these keys (not counted below), which they must pass.
    with torch.no_grad():
        for _, inputs, groups_of in calls:
            sources, options = groups_of(*inputs)
            efficient.depth_attention(inputs[0], sources, EPS, backend=kernels_backend(True),
                                      **options)
    for name in originals:
        setattr(triton_depth, name, counted(name))
    try:
        for label, inputs, groups_of in calls:
            results = []
            for enabled in (True, False):
                sources, options = groups_of(*inputs)
                outs = efficient.depth_attention(inputs[0], sources, EPS,
                                                 backend=kernels_backend(enabled), **options)
                outs = outs if isinstance(outs, tuple) else (outs,)
                generator = torch.Generator().manual_seed(2)
                grads = torch.autograd.grad(
                    outs, inputs, [torch.randn(o.shape, generator=generator).to(o.dtype)
                                   .to(device) for o in outs])
                results.append((outs[0], grads))
            (out_fast, grads_fast), (out_slow, grads_slow) = results
            for what, fast, slow, tolerance in (("value", (out_fast,), (out_slow,), rtol),
                                                ("gradient", grads_fast, grads_slow, grad_rtol)):
                for i, (a, b) in enumerate(zip(fast, slow, strict=True)):
                    scale = max(1.0, b.abs().max().item())
                    torch.testing.assert_close(a, b, rtol=tolerance, atol=atol * scale,
                                               msg=lambda m: f"{label} {what} {i}: {m}")
    finally:
        for name, original in originals.items():
            setattr(triton_depth, name, original)
    assert launches == ["forward", "backward"] * len(calls), launches
    return len(launches)


def check_add_into_last_slot(device, dtype, shape=(8229,), h=1024, slots=4) -> None:
    """triton_depth.add_into_last_slot (block AttnRes's exit) equals the PyTorch path bitwise
    (the same sum, rounded to the dtype) on a packed state of ``slots`` slots, in place; through
    efficient.add_into_last_slot, the state's gradient is the incoming one and the addend's that
    of the last slot."""
    from megatron_ext.kernels.residual import triton_depth

    generator = torch.Generator(device=device).manual_seed(slots)
    packed, addend, grad = (torch.randn(*shape, *size, device=device, generator=generator)
                            .to(dtype) for size in ((slots, h), (h,), (slots, h)))
    want = efficient._add_into_last_slot_pytorch(packed.clone(), addend)
    target = packed.clone()
    assert triton_depth.add_into_last_slot(target, addend) is target
    torch.testing.assert_close(target, want, rtol=0, atol=0)
    leaves = [t.clone().requires_grad_() for t in (packed, addend)]
    out = efficient.add_into_last_slot(leaves[0] * 1, leaves[1])  # in place on a non-leaf
    torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
    out.backward(grad)
    for leaf, expected in zip(leaves, (grad, grad[..., -1, :])):
        torch.testing.assert_close(leaf.grad, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_depth.add_into_last_slot(packed[..., :24].contiguous(), addend[..., :24])
    with pytest.raises(ValueError, match="strided"):
        triton_depth.add_into_last_slot(packed[..., :1, :], addend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_add_into_last_slot_equals_the_pytorch_path(dtype):
    efficient._triton_checked.cache_clear()
    device = torch.empty(0, device="cuda").device
    check_add_into_last_slot(device, dtype)
    assert efficient._triton_checked("packed-state", efficient._check_triton_add_into_last_slot,
                                     device, dtype)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_launchers_equal_the_pytorch_path(case):
    check_launchers(case, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups, padded", [(1, 1), (2, 4), (2, 64), (4, 8)])
def test_first_use_check_passes(dtype, groups, padded):
    efficient._triton_checked.cache_clear()
    device = torch.empty(0, device="cuda").device  # cuda:0, as the ops see it
    assert efficient._triton_depth_checked(device, dtype, groups, padded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ops_run_the_kernels_and_equal_the_pytorch_path(dtype):
    check_ops("cuda", dtype, h=1024)


@pytest.mark.parametrize("block_layers", [None, 2], ids=["full", "block2"])
def test_attnres_model_runs_the_kernels_and_equals_the_pytorch_path(megatron_on_cuda,
                                                                    block_layers):
    """A 5-layer GPTModel with Attention Residuals (full, or blocks of 2 layers: layers that
    start a block and layers that add into its partial sum) on CUDA in fp32: loss and every
    gradient with the Triton kernels equal those of the PyTorch path, and the kernels ran (block:
    the FFN's depth attention passing the state on with the mixer's output added, and the
    exit's in-place addition)."""
    from megatron.core.models.gpt import GPTModel

    import harness
    from megatron_ext.config import ExtConfig
    from megatron_ext.kernels.residual import triton_depth
    from megatron_ext.specs import block_spec

    seq, vocab = 37, 64
    config = harness.tiny_config(num_layers=5, hidden_size=128, ffn_hidden_size=256)
    ext = ExtConfig(pattern="*", residual="attnres_full" if block_layers is None
                    else "attnres_block", **({} if block_layers is None
                                             else dict(attnres_block_layers=block_layers)))
    torch.manual_seed(3)
    model = GPTModel(config, block_spec(config, ext=ext), vocab_size=vocab,
                     max_sequence_length=seq, position_embedding_type="none").cuda()
    with torch.no_grad():  # non-zero queries: softmax weights that differ between sources
        for name, p in model.named_parameters():
            if ".residual." in name:
                p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(4))
    tokens = tokens.cuda()
    originals = {name: getattr(triton_depth, name) for name in ("forward", "add_into_last_slot")}
    launches = []

    def counted(name):
        def call(*args):
            launches.append((name, name == "forward" and args[-1] is not None))
            return originals[name](*args)
        return call

    def loss_of_model():
        return model(tokens[:, :-1], torch.arange(seq, device="cuda").expand(2, -1), None,
                     labels=tokens[:, 1:]).mean()

    compiled = model.decoder.layers[0].residual.backend.compiled  # as ExtConfig's "auto" maps

    def use_kernels(enabled: bool) -> None:
        """Every layer's scheme runs its ops with the Triton kernels on or off."""
        for layer in model.decoder.layers:
            layer.residual.backend = kernels_backend(enabled, compiled)

    use_kernels(True)
    with torch.no_grad():
        loss_of_model()  # the kernels' first-use checks (they call the launchers), not counted
    results = []
    for enabled in (True, False):
        model.zero_grad(set_to_none=True)
        use_kernels(enabled)
        for name in originals:
            setattr(triton_depth, name, counted(name))
        try:
            loss = loss_of_model()
            loss.backward()
        finally:
            for name, original in originals.items():
                setattr(triton_depth, name, original)
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                        if p.grad is not None}))
    (loss_fast, grads_fast), (loss_slow, grads_slow) = results
    torch.testing.assert_close(loss_fast, loss_slow, rtol=1e-5, atol=1e-6)
    assert grads_fast.keys() == grads_slow.keys()
    for name, grad in grads_slow.items():
        torch.testing.assert_close(grads_fast[name], grad, rtol=1e-4,
                                   atol=1e-5 * max(1.0, grad.abs().max().item()), msg=name)
    forwards = [passed for name, passed in launches if name == "forward"]
    # every sublayer's and the final aggregation's depth attention ran its kernel; with blocks
    # of 2, the FFN of layers 2 and 4 (1-based) passed the state on with the mixer's output
    # added and their exits added the FFN's output in place
    assert len(forwards) == 2 * 5 + 1
    expected_passes = 0 if block_layers is None else 2
    assert sum(forwards) == expected_passes
    assert launches.count(("add_into_last_slot", False)) == expected_passes
