"""Decaying linear attention: the chunked backend against the token-by-token reference.

Tolerances are relative errors in the Frobenius norm, ||actual - expected|| / ||expected||:
- float64: 1e-9. Both paths are exact algebra (the chunked one reassociates sums and, for a
  per-channel decay, factors exp(G_t - G_s) through a sub-chunk boundary), so they agree to
  ~1e-15; 1e-9 leaves room and still catches any algebraic slip, which shows up as errors of
  order 1e-3 or more.
- float32: the chunked path in fp32 against the reference in fp64 on the same values: 1e-5 for
  outputs, states and gradients. fp32 rounds at 6e-8; sums over K and over the tokens of a chunk
  and of a sequence amplify that (measured: at most 4.5e-7, gradients included, and 7e-7 with
  the strong decays below), so 1e-5 leaves a 10x margin and is still far below what an
  algebraic slip produces. Keys are L2-normalised and
  decays lie in (0, 1), as in the models.
- bfloat16 inputs: the chunked path computes in fp32 and rounds o to bf16 at the end, so it must
  match the fp32 reference on the same (bf16-rounded) values to bf16 output precision:
  2^-8 = 3.9e-3 relative per element (measured 1.7e-3 in norm); we allow 1e-2 in norm. The final
  state stays in fp32 and gets the fp32 tolerance.
"""
import pytest
import torch
from test_delta_rule import assert_close, assert_same_results, run_with_grads

from megatron_ext.kernels import decay_linear_attention
from megatron_ext.kernels.decay import decay_linear_attention_chunked, decay_linear_attention_reference
from megatron_ext.kernels.selfcheck import decay_inputs as make_inputs

KEY_DIM, VALUE_DIM = 8, 12
# None: plain linear attention; constant: [Hv] (RetNet, Lightning); per_head: [B, T, Hv]
# (Mamba-2 SSD); per_channel: [B, T, Hv, K] (GLA).
DECAYS = ["none", "constant", "per_head", "per_channel"]


def test_reference_matches_two_steps_by_hand():
    """K = 2, V = 1, one head, a per-channel decay; the numbers are worked out below."""
    q = torch.tensor([[1.0, 1.0], [0.0, 2.0]])
    k = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    v = torch.tensor([[3.0], [-1.0]])
    g = torch.log(torch.tensor([[0.5, 1.0], [1.0, 0.25]]))
    initial_state = torch.tensor([[1.0], [2.0]])
    # t=1: decayed S = [0.5, 2];   S_1 = [0.5, 2] + k_1 * 3 = [3.5, 2];           o_1 = q_1 . S_1 = 5.5
    # t=2: decayed S = [3.5, 0.5]; S_2 = [3.5, 0.5] + [0.6, 0.8] (-1) = [2.9, -0.3]; o_2 = q_2 . S_2 = -0.6
    o, final_state = decay_linear_attention_reference(
        q[None, :, None], k[None, :, None], v[None, :, None], g=g[None, :, None], scale=1.0,
        initial_state=initial_state[None, None], output_final_state=True,
    )
    torch.testing.assert_close(o.flatten(), torch.tensor([5.5, -0.6]))
    torch.testing.assert_close(final_state.flatten(), torch.tensor([2.9, -0.3]))


def test_decay_forms_are_one_rule():
    """A per-channel g equal across channels is the per-head g; a per-head g equal over B and T is
    the constant [Hv]; a zero g is no decay. For both backends."""
    inputs = {name: t.detach() for name, t in make_inputs("per_channel").items()}
    g = inputs.pop("g")
    for backend in ("reference", "chunked"):
        per_head = decay_linear_attention(**inputs, g=g[..., 0], backend=backend)[0]
        same_per_channel = decay_linear_attention(**inputs, g=g[..., :1].expand_as(g), backend=backend)[0]
        torch.testing.assert_close(same_per_channel, per_head, rtol=1e-12, atol=1e-12)

        constant = g[0, 0, :, 0]
        expanded = decay_linear_attention(**inputs, g=constant.expand(g.shape[:3]), backend=backend)[0]
        torch.testing.assert_close(decay_linear_attention(**inputs, g=constant, backend=backend)[0],
                                   expanded, rtol=1e-12, atol=1e-12)

        no_decay = decay_linear_attention(**inputs, backend=backend)[0]
        zero_decay = decay_linear_attention(**inputs, g=torch.zeros_like(g[..., 0]), backend=backend)[0]
        torch.testing.assert_close(zero_decay, no_decay, rtol=1e-12, atol=1e-12)


# (T, chunk_size, q/k heads, v heads, with initial state): a single token, T shorter than one
# chunk, T an exact multiple of the chunk, T one past a multiple, odd T over several chunks, and
# a chunk of 24, whose per-channel sub-chunks (4) are not its square root.
SHAPES_FLOAT64 = [
    (1, 16, 2, 4, True),
    (37, 64, 2, 2, False),
    (48, 16, 2, 4, True),
    (64, 64, 1, 2, False),
    (65, 64, 2, 4, True),
    (129, 16, 2, 4, False),
    (50, 24, 1, 1, True),
]


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize(
    ("seq_len", "chunk_size", "key_heads", "value_heads", "with_initial_state"), SHAPES_FLOAT64
)
def test_chunked_matches_reference_float64(
    decay, seq_len, chunk_size, key_heads, value_heads, with_initial_state
):
    inputs = make_inputs(decay, seq_len=seq_len, key_heads=key_heads, value_heads=value_heads,
                         with_initial_state=with_initial_state)
    expected = run_with_grads(decay_linear_attention_reference, inputs)
    actual = run_with_grads(decay_linear_attention_chunked, inputs, chunk_size=chunk_size)
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_float32_matches_float64_reference(decay, chunk_size):
    inputs64 = make_inputs(decay, seq_len=129)
    inputs32 = {name: t.detach().float().requires_grad_() for name, t in inputs64.items()}
    expected = run_with_grads(decay_linear_attention_reference, inputs64)
    actual = run_with_grads(decay_linear_attention_chunked, inputs32, chunk_size=chunk_size)
    assert actual[0].dtype == torch.float32 and actual[1].dtype == torch.float32
    assert_same_results(actual, expected, output_tolerance=1e-5, grad_tolerance=1e-5)


def test_grouped_heads_are_shared_by_consecutive_value_heads():
    """With Hk = 2 and Hv = 4, v heads 0 and 1 read q/k head 0, v heads 2 and 3 q/k head 1."""
    inputs = make_inputs("per_channel", key_heads=2, value_heads=4)
    inputs = {name: t.detach() for name, t in inputs.items()}
    expanded = dict(inputs, q=inputs["q"][:, :, [0, 0, 1, 1]], k=inputs["k"][:, :, [0, 0, 1, 1]])
    for backend in ("reference", "chunked"):
        grouped = decay_linear_attention(**inputs, output_final_state=True, backend=backend)
        one_per_head = decay_linear_attention(**expanded, output_final_state=True, backend=backend)
        torch.testing.assert_close(grouped, one_per_head, rtol=0, atol=0)


def test_scale_and_auto_backend():
    inputs = make_inputs("per_head", seq_len=20)
    expected = run_with_grads(decay_linear_attention_reference, inputs, scale=0.3)
    actual = run_with_grads(decay_linear_attention, inputs, scale=0.3)  # backend="auto"
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)


def one_sequence(name, tensor, index, start, end):
    """The part of a packed input that belongs to sequence index (tokens start to end)."""
    if name == "initial_state":
        return tensor[index : index + 1]
    if name == "g" and tensor.dim() == 1:  # a constant per head belongs to every sequence
        return tensor
    return tensor[:, start:end]


@pytest.mark.parametrize("decay", DECAYS)
def test_varlen_is_each_sequence_on_its_own(decay):
    lengths = [5, 64, 17]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    inputs = make_inputs(decay, batch=1, seq_len=sum(lengths), num_states=len(lengths))

    expected = run_with_grads(decay_linear_attention_reference, inputs, cu_seqlens=cu_seqlens)
    actual = run_with_grads(decay_linear_attention_chunked, inputs, cu_seqlens=cu_seqlens, chunk_size=16)
    assert_same_results(actual, expected, output_tolerance=1e-9, grad_tolerance=1e-9)

    # The packed sequences are each sequence alone, for both backends.
    for o_packed, state_packed in (expected[:2], actual[:2]):
        for index, (start, end) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens.tolist()[1:])):
            one = {name: one_sequence(name, t, index, start, end) for name, t in inputs.items()}
            o_alone, state_alone = decay_linear_attention_reference(**one, output_final_state=True)
            torch.testing.assert_close(o_packed[:, start:end], o_alone, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(state_packed[index], state_alone[0], rtol=1e-12, atol=1e-12)


def test_varlen_empty_sequence_keeps_its_initial_state():
    cu_seqlens = torch.tensor([0, 5, 5, 22])
    inputs = make_inputs("constant", batch=1, seq_len=22, num_states=3)
    inputs = {name: t.detach() for name, t in inputs.items()}
    for function in (decay_linear_attention_reference, decay_linear_attention_chunked):
        o, final_state = function(**inputs, cu_seqlens=cu_seqlens, output_final_state=True)
        assert o.shape == (1, 22, 4, VALUE_DIM)
        torch.testing.assert_close(final_state[1], inputs["initial_state"][1], rtol=0, atol=0)


@pytest.mark.parametrize("decay", ["per_head", "per_channel"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_strong_decay_stays_finite(decay, dtype):
    """Per-step decays down to exp(-40): the cumulative log-decay falls to about -1200 within a
    chunk, so exp(G_t - G_s) above the diagonal (s > t), or a sub-chunk factor taken from the
    wrong side of its reference token, would overflow even in fp64. The chunked form must only
    ever exponentiate causal, non-positive sums of log-decays."""
    inputs = make_inputs(decay, seq_len=70)
    with torch.no_grad():
        strength = torch.linspace(0, 100, inputs["g"].shape[-1], dtype=torch.float64)
        inputs["g"].mul_(strength).clamp_(min=-40.0)
    expected = run_with_grads(decay_linear_attention_reference, inputs)
    inputs = {name: t.detach().to(dtype).requires_grad_() for name, t in inputs.items()}
    actual = run_with_grads(decay_linear_attention_chunked, inputs, chunk_size=64)
    for tensor in (actual[0], actual[1], *actual[2].values()):
        assert torch.isfinite(tensor).all()
    tolerance = 1e-9 if dtype == torch.float64 else 1e-5
    assert_same_results(actual, expected, output_tolerance=tolerance, grad_tolerance=tolerance)


@pytest.mark.parametrize("decay", DECAYS)
def test_bfloat16_inputs(decay):
    inputs = make_inputs(decay, seq_len=65)
    inputs_bf16 = {name: t.detach().bfloat16().requires_grad_() for name, t in inputs.items()}
    inputs_fp32 = {name: t.detach().float() for name, t in inputs_bf16.items()}  # the same values
    o, final_state = decay_linear_attention_chunked(**inputs_bf16, output_final_state=True, chunk_size=16)
    o_expected, state_expected = decay_linear_attention_reference(**inputs_fp32, output_final_state=True)
    assert o.dtype == torch.bfloat16 and final_state.dtype == torch.float32
    assert_close(o, o_expected, 1e-2, "o")
    assert_close(final_state, state_expected, 1e-5, "final state")  # kept in fp32, never rounded
    o.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 for t in inputs_bf16.values())


# (test id, how to break make_inputs("per_channel"), the message that must come out)
BAD_ARGUMENTS = [
    ("q-not-4d", lambda x: x.update(q=x["q"][0]),
     r"decay_linear_attention: q has shape \(37, 2, 8\), expected a 4-D tensor"),
    ("k-shape", lambda x: x.update(k=x["k"][..., :4]),
     r"k has shape \(2, 37, 2, 4\), expected the shape of q"),
    ("v-length", lambda x: x.update(v=x["v"][:, :10]),
     r"v has shape \(2, 10, 4, 12\), expected \[B, T, Hv, V\]"),
    ("v-heads", lambda x: x.update(v=x["v"][:, :, :3]),
     r"v has shape .*Hv a multiple of the 2 q/k heads"),
    ("g-channels", lambda x: x.update(g=x["g"][..., :3]),
     r"g has shape \(2, 37, 4, 3\), expected \[Hv\] = \[4\] \(a constant per head\), "
     r"\[B, T, Hv\] = \[2, 37, 4\] .* or \[B, T, Hv, K\] = \[2, 37, 4, 8\]"),
    ("g-constant", lambda x: x.update(g=x["g"][0, 0, :2, 0]),
     r"g has shape \(2,\), expected \[Hv\] = \[4\]"),
    ("state-shape", lambda x: x.update(initial_state=x["initial_state"][:1]),
     r"initial_state has shape \(1, 4, 8, 12\), expected \[N, Hv, K, V\] = \[2, 4, 8, 12\] \(N = batch size\)"),
    ("varlen-batch", lambda x: x.update(cu_seqlens=torch.tensor([0, 37])),
     r"q has shape .*B == 1 when cu_seqlens is given"),
]


@pytest.mark.parametrize(("break_inputs", "message"), [case[1:] for case in BAD_ARGUMENTS],
                         ids=[case[0] for case in BAD_ARGUMENTS])
def test_bad_arguments_are_named(break_inputs, message):
    inputs = {name: t.detach() for name, t in make_inputs("per_channel").items()}
    break_inputs(inputs)
    for backend in ("reference", "chunked"):
        with pytest.raises(ValueError, match=message):
            decay_linear_attention(**inputs, backend=backend)


def test_bad_varlen_backend_and_chunk_messages():
    inputs = make_inputs("per_head", batch=1, seq_len=10, num_states=2)
    inputs = {name: t.detach() for name, t in inputs.items()}
    expected_messages = [
        (dict(cu_seqlens=torch.tensor([0, 4, 9])),
         r"cu_seqlens = \[0, 4, 9\] must start at 0, never decrease and end at T = 10"),
        (dict(cu_seqlens=torch.tensor([0.0, 4.0, 10.0])),
         r"cu_seqlens has shape \(3,\), expected a 1-D integer tensor"),
        (dict(cu_seqlens=torch.tensor([0, 4, 6, 10])),
         r"initial_state has shape \(2, 4, 8, 12\), expected .* = \[3, 4, 8, 12\] \(N = number of sequences\)"),
        (dict(backend="nope"),
         r"decay_linear_attention: unknown backend 'nope'; known backends: 'auto', 'reference', "
         r"'chunked', 'triton', 'fla'"),
    ]
    for change, message in expected_messages:
        with pytest.raises(ValueError, match=message):
            decay_linear_attention(**inputs, **change)
    with pytest.raises(ValueError, match=r"decay_linear_attention: chunk_size = 0, expected a positive integer"):
        decay_linear_attention_chunked(**dict(inputs, initial_state=None), chunk_size=0)
