"""The gated delta rule: the chunked backend against the token-by-token reference.

Tolerances are relative errors in the Frobenius norm, ||actual - expected|| / ||expected||:
- float64: 1e-9. Both paths are exact algebra (the chunked one adds a triangular solve and
  reassociates sums), so they agree to ~1e-14; 1e-9 leaves room and still catches any
  algebraic slip, which shows up as errors of order 1e-3 or more.
- float32: the chunked path in fp32 against the reference in fp64 on the same values: 1e-5
  for outputs, states and gradients. fp32 rounds at 6e-8; sums over K and over the tokens of a
  chunk and of a sequence, and the unit-triangular solve, amplify that (measured: at most 3e-7
  forward and 8e-7 for gradients, including the strong-decay case), so 1e-5 leaves a 10x margin
  and is still far below what an algebraic slip produces. The inputs are as in real models
  (L2-normalised keys, gates in (0, 1)), which keeps the recurrence contractive.
- bfloat16 inputs: the chunked path computes in fp32 and rounds o to bf16 at the end, so it must
  match the fp32 reference on the same (bf16-rounded) values to bf16 output precision:
  2^-8 = 3.9e-3 relative per element (measured 1.7e-3 in norm); we allow 1e-2 in norm. The final
  state stays in fp32 and gets the fp32 tolerance.
"""
import pytest
import torch

from megatron_ext.kernels import gated_delta_rule
from megatron_ext.kernels.delta_rule import gated_delta_rule_chunked, gated_delta_rule_reference
from megatron_ext.kernels.selfcheck import delta_rule_inputs as make_inputs
from megatron_ext.kernels.selfcheck import relative_error, run_with_grads

KEY_DIM, VALUE_DIM = 8, 12
CASES = ["deltanet", "gated_deltanet", "kda", "gdn2"]


def assert_close(actual, expected, tolerance, what):
    error = relative_error(actual, expected)
    assert error <= tolerance, f"{what}: relative error {error:.3g} > {tolerance:g}"


def assert_same_results(actual, expected, *, output_tolerance, grad_tolerance):
    (o, state, grads), (o_expected, state_expected, grads_expected) = actual, expected
    assert_close(o, o_expected, output_tolerance, "o")
    assert_close(state, state_expected, output_tolerance, "final state")
    for name, grad in grads.items():
        assert_close(grad, grads_expected[name], grad_tolerance, f"grad of {name}")


def test_reference_matches_two_steps_by_hand():
    """K = 2, V = 1, one head, GDN-2 form with every gate; the numbers are worked out below."""
    q = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    v = torch.tensor([[3.0], [-1.0]])
    g = torch.log(torch.tensor([[0.5, 1.0], [1.0, 0.25]]))
    erase = torch.tensor([[0.5, 0.3], [1.0, 0.5]])
    write = torch.tensor([[2.0], [1.0]])
    initial_state = torch.tensor([[1.0], [2.0]])
    # t=1: decayed S = [0.5, 2]; erased = (0.5*1)*0.5 + (0.3*0)*2 = 0.25; written = 2*3 = 6
    #      S_1 = [0.5, 2] + k_1 (6 - 0.25) = [6.25, 2];            o_1 = q_1 . S_1 = 8.25
    # t=2: decayed S = [6.25, 0.5]; erased = (1*0.6)*6.25 + (0.5*0.8)*0.5 = 3.95; written = -1
    #      S_2 = [6.25, 0.5] + [0.6, 0.8] (-4.95) = [3.28, -3.46];  o_2 = q_2 . S_2 = -6.92
    o, final_state = gated_delta_rule_reference(
        q[None, :, None], k[None, :, None], v[None, :, None], g=g[None, :, None],
        erase=erase[None, :, None], write=write[None, :, None], scale=1.0,
        initial_state=initial_state[None, None], output_final_state=True,
    )
    torch.testing.assert_close(o.flatten(), torch.tensor([8.25, -6.92]))
    torch.testing.assert_close(final_state.flatten(), torch.tensor([3.28, -3.46]))


def test_special_cases_are_one_rule():
    """GDN-2 with erase = write = beta is KDA; KDA with g equal across channels is Gated DeltaNet;
    Gated DeltaNet with g = 0 is DeltaNet."""
    inputs = {name: t.detach() for name, t in make_inputs("kda").items()}
    beta, g = inputs.pop("beta"), inputs.pop("g")
    kda = gated_delta_rule(**inputs, beta=beta, g=g, backend="reference")[0]
    gdn2 = gated_delta_rule(**inputs, g=g, erase=beta[..., None].expand_as(g),
                            write=beta[..., None].expand(*beta.shape, VALUE_DIM), backend="reference")[0]
    torch.testing.assert_close(gdn2, kda, rtol=1e-12, atol=1e-12)

    scalar_g = g[..., 0]
    gated = gated_delta_rule(**inputs, beta=beta, g=scalar_g, backend="reference")[0]
    same_per_channel = scalar_g[..., None].expand_as(g)
    per_channel = gated_delta_rule(**inputs, beta=beta, g=same_per_channel, backend="reference")[0]
    torch.testing.assert_close(per_channel, gated, rtol=1e-12, atol=1e-12)

    deltanet = gated_delta_rule(**inputs, beta=beta, backend="reference")[0]
    zero_decay = gated_delta_rule(**inputs, beta=beta, g=torch.zeros_like(scalar_g), backend="reference")[0]
    torch.testing.assert_close(zero_decay, deltanet, rtol=1e-12, atol=1e-12)


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


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    ("seq_len", "chunk_size", "key_heads", "value_heads", "with_initial_state"), SHAPES_FLOAT64
)
def test_chunked_matches_reference_float64(
    case, seq_len, chunk_size, key_heads, value_heads, with_initial_state
):
    inputs = make_inputs(case, seq_len=seq_len, key_heads=key_heads, value_heads=value_heads,
                         with_initial_state=with_initial_state)
    expected = run_with_grads(gated_delta_rule_reference, inputs)
    actual = run_with_grads(gated_delta_rule_chunked, inputs, chunk_size=chunk_size)
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_float32_matches_float64_reference(case, chunk_size):
    inputs64 = make_inputs(case, seq_len=129)
    inputs32 = {name: t.detach().float().requires_grad_() for name, t in inputs64.items()}
    expected = run_with_grads(gated_delta_rule_reference, inputs64)
    actual = run_with_grads(gated_delta_rule_chunked, inputs32, chunk_size=chunk_size)
    assert actual[0].dtype == torch.float32 and actual[1].dtype == torch.float32
    assert_same_results(actual, expected, output_tolerance=1e-5, grad_tolerance=1e-5)


def test_grouped_heads_are_shared_by_consecutive_value_heads():
    """With Hk = 2 and Hv = 4, v heads 0 and 1 read q/k head 0, v heads 2 and 3 q/k head 1."""
    inputs = {name: t.detach() for name, t in make_inputs("kda", key_heads=2, value_heads=4).items()}
    expanded = dict(inputs, q=inputs["q"][:, :, [0, 0, 1, 1]], k=inputs["k"][:, :, [0, 0, 1, 1]])
    for backend in ("reference", "chunked"):
        grouped = gated_delta_rule(**inputs, output_final_state=True, backend=backend)
        one_per_head = gated_delta_rule(**expanded, output_final_state=True, backend=backend)
        torch.testing.assert_close(grouped, one_per_head, rtol=0, atol=0)


def test_scale_and_auto_backend():
    inputs = make_inputs("gated_deltanet", seq_len=20)
    expected = run_with_grads(gated_delta_rule_reference, inputs, scale=0.3)
    actual = run_with_grads(gated_delta_rule, inputs, scale=0.3)  # backend="auto"
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)


@pytest.mark.parametrize("case", CASES)
def test_varlen_is_each_sequence_on_its_own(case):
    lengths = [5, 64, 17]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(case, batch=1, seq_len=sum(lengths), num_states=len(lengths))

    expected = run_with_grads(gated_delta_rule_reference, inputs, cu_seqlens=cu_seqlens)
    actual = run_with_grads(gated_delta_rule_chunked, inputs, cu_seqlens=cu_seqlens, chunk_size=16)
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)

    # The reference on packed sequences is the reference on each sequence alone.
    o_packed, state_packed = expected[0], expected[1]
    for index, (start, end) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:])):
        one = {name: t[index : index + 1] if name == "initial_state" else t[:, start:end]
               for name, t in inputs.items()}
        o_alone, state_alone = gated_delta_rule_reference(**one, output_final_state=True)
        torch.testing.assert_close(o_packed[:, start:end], o_alone, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(state_packed[index], state_alone[0], rtol=1e-12, atol=1e-12)


def test_varlen_empty_sequence_keeps_its_initial_state():
    cu_seqlens = torch.tensor([0, 5, 5, 22])
    inputs = {name: t.detach() for name, t in make_inputs("kda", batch=1, seq_len=22, num_states=3).items()}
    for function in (gated_delta_rule_reference, gated_delta_rule_chunked):
        o, final_state = function(**inputs, cu_seqlens=cu_seqlens, output_final_state=True)
        assert o.shape == (1, 22, 4, VALUE_DIM)
        torch.testing.assert_close(final_state[1], inputs["initial_state"][1], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_per_channel_decay_stays_finite(dtype):
    """Per-step decays down to exp(-40): the cumulative log-decay falls to about -1200 within a
    chunk, so exp(G_t - G_s) above the diagonal (s > t) would overflow even in fp64. The chunked
    form must only ever exponentiate the causal, non-positive differences."""
    inputs = make_inputs("gdn2", seq_len=70)
    with torch.no_grad():
        inputs["g"].mul_(torch.linspace(0, 100, KEY_DIM, dtype=torch.float64)).clamp_(min=-40.0)
    expected = run_with_grads(gated_delta_rule_reference, inputs)
    inputs = {name: t.detach().to(dtype).requires_grad_() for name, t in inputs.items()}
    actual = run_with_grads(gated_delta_rule_chunked, inputs, chunk_size=64)
    for tensor in (actual[0], actual[1], *actual[2].values()):
        assert torch.isfinite(tensor).all()
    tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    assert_same_results(actual, expected, output_tolerance=tolerance, grad_tolerance=tolerance)


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_inputs(case):
    inputs = make_inputs(case, seq_len=65)
    inputs_bf16 = {name: t.detach().bfloat16().requires_grad_() for name, t in inputs.items()}
    inputs_fp32 = {name: t.detach().float() for name, t in inputs_bf16.items()}  # the same values
    o, final_state = gated_delta_rule_chunked(**inputs_bf16, output_final_state=True, chunk_size=16)
    o_expected, state_expected = gated_delta_rule_reference(**inputs_fp32, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final_state.dtype == torch.float32
    assert_close(o, o_expected, 1e-2, "o")
    assert_close(final_state, state_expected, 1e-5, "final state")  # kept in fp32, never rounded
    o.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in inputs_bf16.values())


# (test id, how to break make_inputs("kda"), the message that must come out)
BAD_ARGUMENTS = [
    ("q-not-4d", lambda x: x.update(q=x["q"][0]),
     r"q has shape \(37, 2, 8\), expected a 4-D tensor"),
    ("k-shape", lambda x: x.update(k=x["k"][..., :4]),
     r"k has shape \(2, 37, 2, 4\), expected the shape of q"),
    ("v-length", lambda x: x.update(v=x["v"][:, :10]),
     r"v has shape \(2, 10, 4, 12\), expected \[B, T, Hv, V\]"),
    ("v-heads", lambda x: x.update(v=x["v"][:, :, :3]),
     r"v has shape .*Hv a multiple of the 2 q/k heads"),
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
    ("state-shape", lambda x: x.update(initial_state=x["initial_state"][:1]),
     r"initial_state has shape \(1, 4, 8, 12\), expected \[N, Hv, K, V\] = \[2, 4, 8, 12\] \(N = batch size\)"),
    ("varlen-batch", lambda x: x.update(cu_seqlens=torch.tensor([0, 37])),
     r"q has shape .*B == 1 when cu_seqlens is given"),
]


@pytest.mark.parametrize(("break_inputs", "message"), [case[1:] for case in BAD_ARGUMENTS],
                         ids=[case[0] for case in BAD_ARGUMENTS])
def test_bad_arguments_are_named(break_inputs, message):
    inputs = {name: t.detach() for name, t in make_inputs("kda").items()}
    break_inputs(inputs)
    for backend in ("reference", "chunked"):
        with pytest.raises(ValueError, match=message):
            gated_delta_rule(**inputs, backend=backend)


def test_bad_varlen_backend_and_chunk_messages():
    inputs = make_inputs("gdn2", batch=1, seq_len=10, num_states=2)
    inputs = {name: t.detach() for name, t in inputs.items()}
    expected_messages = [
        (dict(beta=torch.zeros(1, 10, 4), initial_state=None),
         r"beta would be ignored because both erase and write are given"),
        (dict(cu_seqlens=torch.tensor([0, 4, 9])),
         r"cu_seqlens = \[0, 4, 9\] must start at 0, never decrease and end at T = 10"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])),
         r"cu_seqlens has shape \(3,\), expected a 1-D integer tensor"),
        (dict(cu_seqlens=torch.tensor([0, 4, 6, 10])),
         r"initial_state has shape \(2, 4, 8, 12\), expected .* = \[3, 4, 8, 12\] \(N = number of sequences\)"),
        (dict(backend="nope"),
         r"unknown backend 'nope'; known backends: 'auto', 'reference', 'chunked', 'triton', 'fla'"),
    ]
    for change, message in expected_messages:
        with pytest.raises(ValueError, match=message):
            gated_delta_rule(**{**inputs, **change})
    with pytest.raises(ValueError, match=r"chunk_size = 0, expected a positive integer"):
        gated_delta_rule_chunked(**dict(inputs, initial_state=None), chunk_size=0)


@pytest.mark.parametrize("case", CASES)
def test_write_residual_chunked_matches_reference(case):
    """The write residual r_t (what CLER-H routes) agrees between backends, with gradients."""
    inputs = make_inputs(case, seq_len=45)
    results = []
    for function, options in ((gated_delta_rule_reference, {}),
                              (gated_delta_rule_chunked, {"chunk_size": 16})):
        o, _, residual = function(**inputs, return_write_residual=True, **options)
        weights = torch.randn(residual.shape, generator=torch.Generator().manual_seed(2),
                              dtype=residual.dtype)
        grads = torch.autograd.grad((residual * weights).sum() + o.sum(), list(inputs.values()))
        results.append((o, residual, grads))
    (o_ref, r_ref, g_ref), (o_chunk, r_chunk, g_chunk) = results
    assert_close(r_chunk, r_ref, 1e-9, "write residual")
    for name, a, b in zip(inputs, g_chunk, g_ref):
        assert_close(a, b, 1e-9, f"grad {name}")


def test_write_residual_is_the_unpredicted_part_of_the_value():
    """From an empty state nothing is predicted: r_1 = w_1 * v_1 (= beta * v for DeltaNet);
    and the state is the sum of k_t r_t^T (no decay)."""
    inputs = make_inputs("deltanet", seq_len=6, with_initial_state=False)
    _, final_state, residual = gated_delta_rule_reference(
        **inputs, output_final_state=True, return_write_residual=True)
    beta, v, k = inputs["beta"], inputs["v"], inputs["k"]
    torch.testing.assert_close(residual[:, 0], beta[:, 0, :, None] * v[:, 0])
    k_per_value_head = k.repeat_interleave(2, dim=2)  # 2 key heads serve 4 value heads
    state = torch.einsum("bthk,bthv->bhkv", k_per_value_head, residual)
    torch.testing.assert_close(final_state, state)


def test_sequence_bounds_are_read_once_per_tensor(monkeypatch):
    """A cu_seqlens tensor is read on the host once (for a GPU's, a copy that waits for the GPU),
    however many layers pass it; an in-place change is read again; B rows of T need no read."""
    from megatron_ext.kernels import common

    reads = []
    original = torch.Tensor.tolist

    def counting_tolist(self):
        reads.append(self)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
    cu_seqlens = torch.tensor([0, 5, 5, 22])
    assert common.sequence_bounds(cu_seqlens, 1, 22) == (0, 5, 5, 22)
    assert common.sequence_bounds(cu_seqlens, 1, 22) == (0, 5, 5, 22)
    assert len(reads) == 1
    cu_seqlens[1] = 4
    assert common.sequence_bounds(cu_seqlens, 1, 22) == (0, 4, 5, 22)
    assert len(reads) == 2
    assert common.sequence_bounds(None, 3, 7) == (0, 7, 14, 21)
    assert common.sequence_bounds(None, 2, 0) == (0, 0, 0)
    assert len(reads) == 2
