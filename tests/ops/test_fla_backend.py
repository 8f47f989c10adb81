"""gated_delta_rule(backend="fla") on CUDA against the fp32 reference, and the fla-core policy
against what fla-core does on this GPU and Triton (skipped without CUDA or without fla-core).

Each special case runs where ``fla_unavailable_reason`` allows it, with T not a multiple of 64,
grouped heads (Hk = 2, Hv = 4), K != V (so that a transposed state would show), initial and
final states, both as a batch and as packed sequences (cu_seqlens). The reference runs in fp32
on the same (rounded) input values. Tolerances are relative errors in the Frobenius norm:
- bf16 inputs: fla keeps its intermediates (the WY factors, chunk states) in bf16, so each
  carries bf16 rounding (2^-8 = 3.9e-3 relative) into o, the final state and the gradients:
  2e-2 for o and the final state, 5e-2 for gradients. Measured on an H200 (Triton 3.6.0,
  fla-core 0.6.0), forward: 2.8e-3 to 3.9e-3 for DeltaNet and GDN.
- fp32 inputs (all but DeltaNet, whose fla kernel refuses fp32): fla's tl.dot products run in
  TF32 (10-bit mantissa, 2^-11 = 4.9e-4 relative per product): 5e-3 for o and the final state,
  1e-2 for gradients. Measured there, forward: 7.8e-4 to 1.2e-3 for GDN.
An algebraic slip (a wrong scale, gate, head map or state layout) gives errors of order 1.

Time: the first call of each fla kernel for a new dtype and layout autotunes and compiles, about
a minute for a forward and as much for a backward on that H200, so a fresh process spends most
of its time there. The fp32 cases are marked slow: ``-m "not slow"`` runs the bf16 ones.
"""
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.kernels import decay_linear_attention, gated_delta_rule
from megatron_ext.kernels.decay import decay_linear_attention_reference
from megatron_ext.kernels.delta_rule import fla as fla_adapter
from megatron_ext.kernels.backends import fla_unavailable_reason

pytestmark = pytest.mark.gpu
pytest.importorskip("fla", reason="fla-core is not installed")

KEY_DIM, VALUE_DIM = 64, 128
KEY_HEADS, VALUE_HEADS = 2, 4
DELTA_KINDS = ["deltanet", "gdn", "kda", "gdn2"]
# (o and final state, gradients), see the module docstring.
TOLERANCES = {torch.bfloat16: (2e-2, 5e-2), torch.float32: (5e-3, 1e-2)}
# batch: two sequences of 200 tokens; varlen: three packed sequences of 37, 128 and 100 tokens.
LAYOUTS = {"batch": dict(batch=2, lengths=[200]), "varlen": dict(batch=1, lengths=[37, 128, 100])}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DTYPE_CASES = [pytest.param(kind, dtype, id=f"{kind}-{name}",
                            marks=[pytest.mark.slow] if dtype == torch.float32 else [])
               for kind in DELTA_KINDS for name, dtype in DTYPES.items()
               if not (kind == "deltanet" and name == "fp32")]


def make_inputs(kind, *, batch, lengths, dtype, seed=0):
    """Keyword arguments for gated_delta_rule on CUDA (leaves that require grad, the initial
    state in fp32), with unit-norm q and k and gates in (0, 1) as in the models."""
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    seq_len = sum(lengths) if batch == 1 else lengths[0]
    per_head = (batch, seq_len, VALUE_HEADS)
    tensors = {
        "q": F.normalize(randn(batch, seq_len, KEY_HEADS, KEY_DIM), dim=-1),
        "k": F.normalize(randn(batch, seq_len, KEY_HEADS, KEY_DIM), dim=-1),
        "v": randn(batch, seq_len, VALUE_HEADS, VALUE_DIM),
    }
    if kind == "gdn2":
        tensors["erase"] = torch.sigmoid(randn(*per_head, KEY_DIM))
        tensors["write"] = torch.sigmoid(randn(*per_head, VALUE_DIM))
    else:
        tensors["beta"] = torch.sigmoid(randn(*per_head))
    if kind == "gdn":
        tensors["g"] = F.logsigmoid(randn(*per_head) + 2.0)
    elif kind in ("kda", "gdn2"):
        tensors["g"] = F.logsigmoid(randn(*per_head, KEY_DIM) + 2.0)
    inputs = {name: t.to(dtype).requires_grad_() for name, t in tensors.items()}
    num_states = len(lengths) if batch == 1 else batch
    inputs["initial_state"] = randn(num_states, VALUE_HEADS, KEY_DIM, VALUE_DIM).requires_grad_()
    return inputs


def cu_seqlens_of(layout):
    lengths = LAYOUTS[layout]["lengths"]
    if LAYOUTS[layout]["batch"] != 1:
        return None
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")


def as_fp32_leaves(inputs):
    return {name: t.detach().float().requires_grad_() for name, t in inputs.items()}


def run_with_grads(inputs, **options):
    """o, final state and the gradients of a fixed random projection of both, w.r.t. every input."""
    o, final_state = gated_delta_rule(**inputs, output_final_state=True, **options)
    generator = torch.Generator(device="cuda").manual_seed(1)
    o_weights = torch.randn(o.shape, generator=generator, device="cuda")
    state_weights = torch.randn(final_state.shape, generator=generator, device="cuda")
    loss = (o.float() * o_weights).sum() + (final_state * state_weights).sum()
    grads = torch.autograd.grad(loss, list(inputs.values()))
    return o, final_state, dict(zip(inputs, grads))


def relative_error(actual, expected):
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm()).item()


def assert_close(actual, expected, tolerance, what):
    error = relative_error(actual, expected)
    print(f"{what}: relative error {error:.2e} (tolerance {tolerance:g})")
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:g}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("kind", "dtype"), DTYPE_CASES)
def test_fla_forward_matches_reference(kind, dtype, layout):
    inputs = make_inputs(kind, **LAYOUTS[layout], dtype=dtype)
    options = dict(cu_seqlens=cu_seqlens_of(layout), output_final_state=True)
    with torch.no_grad():
        o, final_state = gated_delta_rule(**inputs, **options, backend="fla")
        o_expected, state_expected = gated_delta_rule(**as_fp32_leaves(inputs), **options,
                                                      backend="reference")
    assert o.dtype == dtype and final_state.dtype == torch.float32
    tolerance = TOLERANCES[dtype][0]
    assert_close(o, o_expected, tolerance, f"{kind} {dtype} {layout}: o")
    assert_close(final_state, state_expected, tolerance, f"{kind} {dtype} {layout}: final state")


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("kind", "dtype"), DTYPE_CASES)
def test_fla_backward_matches_reference(kind, dtype, layout):
    reason = fla_unavailable_reason(kind, "cuda", requires_grad=True)
    if reason is not None:
        pytest.skip(f"refused here (checked by test_refused_calls_are_reported): {reason}")
    inputs = make_inputs(kind, **LAYOUTS[layout], dtype=dtype)
    cu_seqlens = cu_seqlens_of(layout)
    o, final_state, grads = run_with_grads(inputs, cu_seqlens=cu_seqlens, backend="fla")
    o_expected, state_expected, grads_expected = run_with_grads(
        as_fp32_leaves(inputs), cu_seqlens=cu_seqlens, backend="reference")
    output_tolerance, grad_tolerance = TOLERANCES[dtype]
    assert_close(o, o_expected, output_tolerance, f"{kind} {dtype} {layout}: o")
    assert_close(final_state, state_expected, output_tolerance, f"{kind} {dtype} {layout}: final state")
    for name, grad in grads.items():
        assert grad.dtype == inputs[name].dtype
        assert_close(grad, grads_expected[name], grad_tolerance, f"{kind} {dtype} {layout}: grad of {name}")


@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_fla_varlen_empty_sequence_keeps_its_initial_state(kind):
    inputs = make_inputs(kind, batch=1, lengths=[5, 0, 70], dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 5, 5, 75], device="cuda")
    with torch.no_grad():
        o, final_state = gated_delta_rule(**inputs, cu_seqlens=cu_seqlens, output_final_state=True,
                                          backend="fla")
        o_expected, _ = gated_delta_rule(**as_fp32_leaves(inputs), cu_seqlens=cu_seqlens,
                                         backend="reference")
    torch.testing.assert_close(final_state[1], inputs["initial_state"][1], rtol=0, atol=0)
    assert_close(o, o_expected, TOLERANCES[torch.bfloat16][0], f"{kind}: o")


def test_fla_deltanet_refuses_fp32():
    inputs = make_inputs("deltanet", **LAYOUTS["batch"], dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"backend 'fla' cannot run deltanet in torch.float32"):
        gated_delta_rule(**inputs, backend="fla")


@pytest.mark.parametrize("kind", DELTA_KINDS)
def test_refused_calls_are_reported(kind):
    """Where the policy refuses a backward, backend="fla" raises with the reason instead of
    running (or falling back); the same call without gradients runs on fla."""
    reason = fla_unavailable_reason(kind, "cuda", requires_grad=True)
    if reason is None:
        pytest.skip(f"fla-core runs {kind} with gradients on this GPU and Triton")
    inputs = make_inputs(kind, **LAYOUTS["batch"], dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend 'fla' cannot run") as raised:
        gated_delta_rule(**inputs, backend="fla")
    assert reason in str(raised.value)
    with torch.no_grad():
        gated_delta_rule(**inputs, backend="fla")


DECAY_KINDS = [kind for kind in fla_adapter.FLA_KINDS if kind not in DELTA_KINDS and kind != "attn"]


# B, T, H, D of the decay checks: benchmarks/kernels.py's heads and head dim at B = 1 (its
# T = 32768 row), so that fla-core's autotuning results of a benchmark run on the machine serve
# here too (they are keyed by B, H and the dims, not T); T = 300 ends inside a 64-token chunk.
DECAY_SHAPE = (1, 300, 16, 128)


def decay_inputs(kind):
    """q, k, v ``DECAY_SHAPE`` in bf16 and the decay that fla's function takes for ``kind``:
    a per-token g ``[B, T, H]`` (simple_gla) or ``[B, T, H, D]`` (gla) in bf16, leaves that
    require grad; RetNet's constant per-head decays ``[H]`` in fp32 (simple_gla_gamma), a
    constant that takes no gradient, as in the models; None for linear attention (linear)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    heads = DECAY_SHAPE[2]
    q, k, v = (torch.randn(DECAY_SHAPE, generator=generator, device="cuda") for _ in range(3))
    q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    if kind == "linear":
        decay = None
    elif kind == "simple_gla_gamma":
        decay = torch.log(1 - 2.0 ** (-5 - torch.arange(heads, device="cuda", dtype=torch.float32)))
    else:
        decay_shape = DECAY_SHAPE[:3] if kind == "simple_gla" else DECAY_SHAPE
        decay = F.logsigmoid(torch.randn(decay_shape, generator=generator, device="cuda") + 2.0)
        decay = decay.bfloat16().requires_grad_()
    return [t.bfloat16().requires_grad_() for t in (q, k, v)] + [decay]


def decay_on_fla(kind, q, k, v, decay):
    """o of fla-core's function for a decay kind, through our adapter."""
    return decay_linear_attention(q, k, v, g=decay, backend="fla")[0]


def decay_with_grads(function, inputs):
    """o and the gradients of sum(o^2) w.r.t. the inputs that require grad."""
    o = function(*inputs)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    return o, torch.autograd.grad(o.float().square().sum(), leaves)


@pytest.mark.parametrize("kind", DELTA_KINDS + DECAY_KINDS)
def test_policy_matches_what_fla_does(kind, monkeypatch):
    """fla-core refuses a backward (its "#640" RuntimeError) exactly where
    fla_unavailable_reason says so: every kind runs through our adapters with the policy
    switched off, so that what raises is fla-core itself."""
    from megatron_ext.kernels.decay import fla as decay_adapter

    refused = fla_unavailable_reason(kind, "cuda", requires_grad=True) is not None
    monkeypatch.setattr(decay_adapter, "fla_unavailable_reason", lambda *args: None)
    if kind in DELTA_KINDS:
        monkeypatch.setattr(fla_adapter, "fla_unavailable_reason", lambda *args: None)
        inputs = make_inputs(kind, **LAYOUTS["batch"], dtype=torch.bfloat16)

        def run():
            run_with_grads(inputs, backend="fla")
    else:
        inputs = decay_inputs(kind)

        def run():
            decay_with_grads(lambda *args: decay_on_fla(kind, *args), inputs)
    if refused:
        with pytest.raises(RuntimeError, match="#640"):
            run()
    else:
        run()  # the values: test_fla_backward_matches_reference, test_fla_decay_kinds_match_reference


@pytest.mark.parametrize("kind", DECAY_KINDS)
def test_fla_decay_kinds_match_reference(kind):
    """fla's decay functions through our adapter against the decay family's fp32 reference
    (bf16 tolerances): the forward of every kind, and the backward where the policy lets it run
    (a refused backward is test_policy_matches_what_fla_does's business)."""
    backward = fla_unavailable_reason(kind, "cuda", requires_grad=True) is None
    inputs = decay_inputs(kind)
    fp32 = [None if t is None else t.detach().float().requires_grad_(t.requires_grad) for t in inputs]
    output_tolerance, grad_tolerance = TOLERANCES[torch.bfloat16]
    if not backward:
        with torch.no_grad():
            o = decay_on_fla(kind, *inputs)
            o_expected = decay_linear_attention_reference(*fp32[:3], g=fp32[3])[0]
        assert_close(o, o_expected, output_tolerance, f"{kind}: o (forward only)")
        return
    o, grads = decay_with_grads(lambda *args: decay_on_fla(kind, *args), inputs)
    o_expected, grads_expected = decay_with_grads(
        lambda q, k, v, g: decay_linear_attention_reference(q, k, v, g=g)[0], fp32)
    assert_close(o, o_expected, output_tolerance, f"{kind}: o")
    for name, grad, expected in zip("qkvg", grads, grads_expected):
        assert_close(grad, expected, grad_tolerance, f"{kind}: grad of {name}")
