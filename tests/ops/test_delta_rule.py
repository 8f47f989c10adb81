"""The gated delta rule's own rules: a reference step worked out by hand, DeltaNet, Gated DeltaNet
and KDA as special cases of GDN-2, beta refused beside both gates, the write residual, reading
packed bounds once. What it shares with decay_linear_attention (the chunked form against the
reference over shapes, dtypes, grouped heads and packed sequences, strong decays, argument
errors), and the tolerances: test_recurrence_ops.py."""
import pytest
import torch
from test_recurrence_ops import assert_close

from megatron_ext.kernels import gated_delta_rule
from megatron_ext.kernels.delta_rule import gated_delta_rule_chunked, gated_delta_rule_reference
from megatron_ext.kernels.selfcheck import delta_rule_inputs as make_inputs

VALUE_DIM = 12  # the selfcheck inputs' (K = 8)
CASES = ["deltanet", "gated_deltanet", "kda", "gdn2"]


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


def test_beta_with_both_gates_is_refused():
    inputs = {name: t.detach() for name, t in make_inputs("gdn2", seq_len=10).items()}
    with pytest.raises(ValueError, match="beta would be ignored because both erase and write are given"):
        gated_delta_rule(**dict(inputs, beta=torch.zeros(2, 10, 4)))


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
