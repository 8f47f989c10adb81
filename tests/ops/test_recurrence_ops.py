"""What the linear-recurrence ops share: ``gated_delta_rule`` (DeltaNet, Gated DeltaNet, KDA,
GDN-2), ``decay_linear_attention`` (no decay, a constant per head, one per head and token,
one per key channel) and ``dplr_delta_rule`` (RWKV-7's transition with a decay per key channel,
per head, or none). For every form of each: the chunked backend equals the token-by-token
reference forward and backward, over single tokens, T inside, at and across chunk boundaries,
grouped heads and initial states; packed sequences are each sequence alone; bf16 inputs keep
an fp32 state; strong decays stay finite; bad arguments are named. Each op's own rules (its
special cases): test_delta_rule.py, test_decay.py and test_dplr.py.

Tolerances are relative errors in the Frobenius norm, ||actual - expected|| / ||expected||:
- float64: 1e-9. Both paths are exact algebra (the chunked one reassociates sums and adds a
  triangular solve, or factors exp(G_t - G_s) through a sub-chunk boundary), so they agree to
  ~1e-14; 1e-9 leaves room and still catches any algebraic slip, which shows up as errors of
  order 1e-3 or more.
- float32: the chunked path in fp32 against the reference in fp64 on the same values: 1e-5 for
  outputs, states and gradients. fp32 rounds at 6e-8; sums over K and over the tokens of a chunk
  and of a sequence, and the unit-triangular solve, amplify that (measured: at most 3e-7
  forward and 8e-7 for gradients, strong decays included), so 1e-5 leaves a 10x margin and is
  still far below what an algebraic slip produces. The inputs are as in real models
  (L2-normalised keys, gates and decays in (0, 1)), which keeps the recurrence contractive.
- bfloat16 inputs: the chunked path computes in fp32 and rounds o to bf16 at the end, so it
  must match the fp32 reference on the same (bf16-rounded) values to bf16 output precision:
  2^-8 = 3.9e-3 relative per element (measured 1.7e-3 in norm); we allow 1e-2 in norm. The
  final state stays in fp32 and gets the fp32 tolerance.
"""
from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from megatron_ext.kernels import decay_linear_attention, dplr_delta_rule, gated_delta_rule
from megatron_ext.kernels.cases import DPLR_CASES
from megatron_ext.kernels.decay import decay_linear_attention_chunked, decay_linear_attention_reference
from megatron_ext.kernels.delta_rule import gated_delta_rule_chunked, gated_delta_rule_reference
from megatron_ext.kernels.dplr import dplr_delta_rule_chunked, dplr_delta_rule_reference
from megatron_ext.kernels.first_use import relative_error
from megatron_ext.kernels.selfcheck import decay_inputs, delta_rule_inputs, dplr_inputs, run_with_grads

VALUE_DIM = 12  # the selfcheck inputs' (K = 8)
DPLR_FORMS = DPLR_CASES


@dataclass(frozen=True)
class Op:
    public: Callable
    reference: Callable
    chunked: Callable
    inputs: Callable  # make_inputs(form, ...)
    forms: tuple[str, ...]
    grouped_form: str  # a form with every kind of input, for the single-form tests
    extra_shapes: tuple = ()
    backends: str = "'auto', 'reference', 'chunked', 'triton', 'fla'"  # as the error lists them


OPS = {
    "gated_delta_rule": Op(gated_delta_rule, gated_delta_rule_reference, gated_delta_rule_chunked,
                           delta_rule_inputs, ("deltanet", "gated_deltanet", "kda", "gdn2"),
                           "kda"),
    # none: plain linear attention; constant: [Hv] (RetNet, Lightning); per_head: [B, T, Hv]
    # (Mamba-2 SSD); per_channel: [B, T, Hv, K] (GLA). A chunk of 24: its per-channel sub-chunks
    # (4) are not its square root.
    "decay_linear_attention": Op(decay_linear_attention, decay_linear_attention_reference,
                                 decay_linear_attention_chunked, decay_inputs,
                                 ("none", "constant", "per_head", "per_channel"), "per_channel",
                                 extra_shapes=((50, 24, 1, 1, True),)),
    "dplr_delta_rule": Op(dplr_delta_rule, dplr_delta_rule_reference, dplr_delta_rule_chunked,
                          dplr_inputs, DPLR_FORMS, "rwkv7",
                          backends="'auto', 'reference', 'chunked', 'triton'"),
}
FORMS = [pytest.param(name, form, id=f"{name}-{form}") for name, op in OPS.items()
         for form in op.forms]

# (T, chunk_size, q/k heads, v heads, with initial state): a single token, T shorter than one
# chunk, T an exact multiple of the chunk, T one past a multiple, odd T over several chunks.
SHAPES_FLOAT64 = [
    (1, 16, 2, 4, True),
    (37, 64, 2, 2, False),
    (48, 16, 2, 4, True),
    (64, 64, 1, 2, False),
    (65, 64, 2, 4, True),
    (129, 16, 2, 4, False),
]


def assert_close(actual, expected, tolerance, what):
    error = relative_error(actual, expected)
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:g}"


def assert_same_results(actual, expected, *, output_tolerance, grad_tolerance):
    (o, state, grads), (o_expected, state_expected, grads_expected) = actual, expected
    assert_close(o, o_expected, output_tolerance, "o")
    assert_close(state, state_expected, output_tolerance, "final state")
    for name, grad in grads.items():
        assert_close(grad, grads_expected[name], grad_tolerance, f"grad of {name}")


FLOAT64_CASES = [pytest.param(name, form, shape, id=f"{name}-{form}-{'-'.join(map(str, shape))}")
                 for name, op in OPS.items() for form in op.forms
                 for shape in SHAPES_FLOAT64 + list(op.extra_shapes)]


@pytest.mark.parametrize(("name", "form", "shape"), FLOAT64_CASES)
def test_chunked_matches_reference_float64(name, form, shape):
    op = OPS[name]
    seq_len, chunk_size, key_heads, value_heads, with_initial_state = shape
    inputs = op.inputs(form, seq_len=seq_len, key_heads=key_heads, value_heads=value_heads,
                       with_initial_state=with_initial_state)
    expected = run_with_grads(op.reference, inputs)
    actual = run_with_grads(op.chunked, inputs, chunk_size=chunk_size)
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)


@pytest.mark.parametrize(("name", "form"), FORMS)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_float32_matches_float64_reference(name, form, chunk_size):
    op = OPS[name]
    inputs64 = op.inputs(form, seq_len=129)
    inputs32 = {key: t.detach().float().requires_grad_() for key, t in inputs64.items()}
    expected = run_with_grads(op.reference, inputs64)
    actual = run_with_grads(op.chunked, inputs32, chunk_size=chunk_size)
    assert actual[0].dtype == torch.float32 and actual[1].dtype == torch.float32
    assert_same_results(actual, expected, output_tolerance=1e-5, grad_tolerance=1e-5)


@pytest.mark.parametrize("name", OPS)
def test_grouped_heads_are_shared_by_consecutive_value_heads(name):
    """With Hk = 2 and Hv = 4, v heads 0 and 1 read q/k head 0, v heads 2 and 3 q/k head 1."""
    op = OPS[name]
    inputs = {key: t.detach() for key, t in
              op.inputs(op.grouped_form, key_heads=2, value_heads=4).items()}
    expanded = dict(inputs, q=inputs["q"][:, :, [0, 0, 1, 1]], k=inputs["k"][:, :, [0, 0, 1, 1]])
    for backend in ("reference", "chunked"):
        grouped = op.public(**inputs, output_final_state=True, backend=backend)
        one_per_head = op.public(**expanded, output_final_state=True, backend=backend)
        torch.testing.assert_close(grouped, one_per_head, rtol=0, atol=0)


@pytest.mark.parametrize("name", OPS)
def test_scale_and_auto_backend(name):
    op = OPS[name]
    inputs = op.inputs(op.grouped_form, seq_len=20)
    expected = run_with_grads(op.reference, inputs, scale=0.3)
    actual = run_with_grads(op.public, inputs, scale=0.3)  # backend="auto"
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)


def one_sequence(key, tensor, index, start, end):
    """The part of a packed input that belongs to sequence index (tokens start to end)."""
    if key == "initial_state":
        return tensor[index : index + 1]
    if key == "g" and tensor.dim() == 1:  # a constant per head belongs to every sequence
        return tensor
    return tensor[:, start:end]


@pytest.mark.parametrize(("name", "form"), FORMS)
def test_varlen_is_each_sequence_on_its_own(name, form):
    op = OPS[name]
    lengths = [5, 64, 17]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = op.inputs(form, batch=1, seq_len=sum(lengths), num_states=len(lengths))

    expected = run_with_grads(op.reference, inputs, cu_seqlens=cu_seqlens)
    actual = run_with_grads(op.chunked, inputs, cu_seqlens=cu_seqlens, chunk_size=16)
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)

    # The packed sequences are each sequence alone, for both backends.
    for o_packed, state_packed in (expected[:2], actual[:2]):
        for index, (start, end) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:])):
            one = {key: one_sequence(key, t, index, start, end) for key, t in inputs.items()}
            o_alone, state_alone = op.reference(**one, output_final_state=True)
            torch.testing.assert_close(o_packed[:, start:end], o_alone, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(state_packed[index], state_alone[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", OPS)
def test_varlen_empty_sequence_keeps_its_initial_state(name):
    op = OPS[name]
    cu_seqlens = torch.tensor([0, 5, 5, 22])
    inputs = {key: t.detach() for key, t in
              op.inputs(op.grouped_form, batch=1, seq_len=22, num_states=3).items()}
    for function in (op.reference, op.chunked):
        o, final_state = function(**inputs, cu_seqlens=cu_seqlens, output_final_state=True)
        assert o.shape == (1, 22, 4, VALUE_DIM)
        torch.testing.assert_close(final_state[1], inputs["initial_state"][1], rtol=0, atol=0)


@pytest.mark.parametrize(("name", "form"), FORMS)
def test_bfloat16_inputs(name, form):
    op = OPS[name]
    inputs = op.inputs(form, seq_len=65)
    inputs_bf16 = {key: t.detach().bfloat16().requires_grad_() for key, t in inputs.items()}
    inputs_fp32 = {key: t.detach().float() for key, t in inputs_bf16.items()}  # the same values
    o, final_state = op.chunked(**inputs_bf16, output_final_state=True, chunk_size=16)
    o_expected, state_expected = op.reference(**inputs_fp32, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final_state.dtype == torch.float32
    assert_close(o, o_expected, 1e-2, "o")
    assert_close(final_state, state_expected, 1e-5, "final state")  # kept in fp32, never rounded
    o.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in inputs_bf16.values())


# Per-step decays down to exp(-40), in the forms with a decay per token.
STRONG_DECAY = [pytest.param("gated_delta_rule", "gdn2", id="gated_delta_rule-gdn2"),
                pytest.param("decay_linear_attention", "per_head", id="decay-per_head"),
                pytest.param("decay_linear_attention", "per_channel", id="decay-per_channel"),
                pytest.param("dplr_delta_rule", "rwkv7", id="dplr-rwkv7")]


@pytest.mark.parametrize(("name", "form"), STRONG_DECAY)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_decay_stays_finite(name, form, dtype):
    """Per-step decays down to exp(-40): the cumulative log-decay falls to about -1200 within a
    chunk, so exp(G_t - G_s) above the diagonal (s > t), or a sub-chunk factor taken from the
    wrong side of its reference token, would overflow even in fp64. The chunked form must only
    ever exponentiate causal, non-positive sums of log-decays."""
    op = OPS[name]
    inputs = op.inputs(form, seq_len=70)
    with torch.no_grad():
        strength = torch.linspace(0, 100, inputs["g"].shape[-1], dtype=torch.float64)
        inputs["g"].mul_(strength).clamp_(min=-40.0)
    expected = run_with_grads(op.reference, inputs)
    inputs = {key: t.detach().to(dtype).requires_grad_() for key, t in inputs.items()}
    actual = run_with_grads(op.chunked, inputs, chunk_size=64)
    for tensor in (actual[0], actual[1], *actual[2].values()):
        assert torch.isfinite(tensor).all()
    tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    assert_same_results(actual, expected, output_tolerance=tolerance, grad_tolerance=tolerance)


# (test id, how to break the inputs (q/k [2, 37, 2, 8], v [2, 37, 4, 12], the op's grouped form),
# the message that must come out): what both ops take, then each op's own gates and decays.
SHARED_BAD_ARGUMENTS = [
    ("q-not-4d", lambda x: x.update(q=x["q"][0]),
     r"q has shape \(37, 2, 8\), expected a 4-D tensor"),
    ("k-shape", lambda x: x.update(k=x["k"][..., :4]),
     r"k has shape \(2, 37, 2, 4\), expected the shape of q"),
    ("v-length", lambda x: x.update(v=x["v"][:, :10]),
     r"v has shape \(2, 10, 4, 12\), expected \[B, T, Hv, V\]"),
    ("v-heads", lambda x: x.update(v=x["v"][:, :, :3]),
     r"v has shape .*Hv a multiple of the 2 q/k heads"),
    ("state-shape", lambda x: x.update(initial_state=x["initial_state"][:1]),
     r"initial_state has shape \(1, 4, 8, 12\), expected \[N, Hv, K, V\] = \[2, 4, 8, 12\] "
     r"\(N = batch size\)"),
    ("varlen-batch", lambda x: x.update(cu_seqlens=torch.tensor([0, 37])),
     r"q has shape .*B == 1 when cu_seqlens is given"),
]


OWN_BAD_ARGUMENTS = {
    "gated_delta_rule": [
        ("beta-shape", lambda x: x.update(beta=x["beta"][..., :1]),
         r"beta has shape \(2, 37, 1\), expected \[B, T, Hv\] = \[2, 37, 4\]"),
        ("beta-missing", lambda x: x.pop("beta"),
         r"beta is required unless both erase and write are given"),
        ("g-shape", lambda x: x.update(g=x["g"][..., :3]),
         r"g has shape \(2, 37, 4, 3\), expected \[B, T, Hv\]"),
        ("erase-shape", lambda x: x.update(erase=x["g"][..., :5]),
         r"erase has shape \(2, 37, 4, 5\), expected \[B, T, Hv, K\] = \[2, 37, 4, 8\]"),
        ("write-shape", lambda x: x.update(write=x["g"]),
         r"write has shape \(2, 37, 4, 8\), expected \[B, T, Hv, V\] = \[2, 37, 4, 12\]"),
    ],
    "decay_linear_attention": [
        ("g-channels", lambda x: x.update(g=x["g"][..., :3]),
         r"g has shape \(2, 37, 4, 3\), expected \[Hv\] = \[4\] \(a constant per head\), "
         r"\[B, T, Hv\] = \[2, 37, 4\] .* or \[B, T, Hv, K\] = \[2, 37, 4, 8\]"),
        ("g-constant", lambda x: x.update(g=x["g"][0, 0, :2, 0]),
         r"g has shape \(2,\), expected \[Hv\] = \[4\]"),
    ],
    "dplr_delta_rule": [
        ("a-missing", lambda x: x.update(a=None), r"a is required \(expected \[B, T, Hv, K\]"),
        ("b-heads", lambda x: x.update(b=x["b"][:, :, :2]),
         r"b has shape \(2, 37, 2, 8\), expected \[B, T, Hv, K\] = \[2, 37, 4, 8\]"),
        ("g-channels", lambda x: x.update(g=x["g"][..., :3]),
         r"g has shape \(2, 37, 4, 3\), expected \[B, T, Hv\] = \[2, 37, 4\] .* or "
         r"\[B, T, Hv, K\] = \[2, 37, 4, 8\]"),
    ],
}
BAD_ARGUMENTS = [pytest.param(name, break_inputs, message, id=f"{name}-{case}")
                 for name in OPS
                 for case, break_inputs, message in SHARED_BAD_ARGUMENTS + OWN_BAD_ARGUMENTS[name]]


@pytest.mark.parametrize(("name", "break_inputs", "message"), BAD_ARGUMENTS)
def test_bad_arguments_are_named(name, break_inputs, message):
    op = OPS[name]
    inputs = {key: t.detach() for key, t in op.inputs(op.grouped_form).items()}
    break_inputs(inputs)
    for backend in ("reference", "chunked"):
        with pytest.raises(ValueError, match=f"{name}: {message}"):
            op.public(**inputs, backend=backend)


@pytest.mark.parametrize("name", OPS)
def test_bad_varlen_backend_and_chunk_messages(name):
    op = OPS[name]
    inputs = {key: t.detach() for key, t in
              op.inputs(op.grouped_form, batch=1, seq_len=10, num_states=2).items()}
    expected_messages = [
        (dict(cu_seqlens=torch.tensor([0, 4, 9])),
         r"cu_seqlens = \[0, 4, 9\] must start at 0, never decrease and end at T = 10"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])),
         r"cu_seqlens has shape \(3,\), expected a 1-D integer tensor"),
        (dict(cu_seqlens=torch.tensor([0, 4, 6, 10])),
         r"initial_state has shape \(2, 4, 8, 12\), expected .* = \[3, 4, 8, 12\] "
         r"\(N = number of sequences\)"),
        (dict(backend="nope"), f"unknown backend 'nope'; known backends: {op.backends}$"),
    ]
    for change, message in expected_messages:
        with pytest.raises(ValueError, match=f"{name}: {message}"):
            op.public(**{**inputs, **change})
    with pytest.raises(ValueError, match=f"{name}: chunk_size = 0, expected a positive integer"):
        op.chunked(**dict(inputs, initial_state=None), chunk_size=0)
