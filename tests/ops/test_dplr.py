"""The DPLR delta rule's own rules: RWKV-7's recurrence in its own row convention is ours
transposed, the gated delta rule is a special case of it, and its affine summary (for state
passing context parallelism) composes the token steps. What it shares with the other recurrence
ops (chunked against the reference forward and backward over shapes, chunk boundaries, grouped
heads, packed sequences with an empty one, initial and final states, strong decays, bf16, argument
errors): test_recurrence_ops.py."""
import pytest
import torch
from test_recurrence_ops import dplr_inputs

from megatron_ext.kernels import dplr_delta_rule, gated_delta_rule
from megatron_ext.kernels.dplr import dplr_delta_rule_summary
from megatron_ext.kernels.selfcheck import delta_rule_inputs


def _rwkv7_rows(r, w, k, v, a, b, state):
    """RWKV-7's wkv recurrence as its papers and kernels write it, one head, state [V, K] with
    values on the rows: ``wkv_t = wkv_{t-1} (Diag(w_t) + a_t b_t^T) + v_t k_t^T``,
    ``y_t = wkv_t r_t``. r, w, k, a, b ``[T, K]``; v ``[T, V]``; state ``[V, K]``."""
    outputs = []
    for t in range(r.shape[0]):
        state = state @ (torch.diag(w[t]) + torch.outer(a[t], b[t])) + torch.outer(v[t], k[t])
        outputs.append(state @ r[t])
    return torch.stack(outputs), state


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_rwkv7_row_convention_is_the_transposed_state(backend):
    inputs = {name: t.detach() for name, t in
              dplr_inputs("rwkv7", batch=1, seq_len=23, key_heads=1, value_heads=1).items()}
    o, final = dplr_delta_rule(**inputs, scale=1.0, output_final_state=True, backend=backend)
    one = {name: t[0, :, 0] for name, t in inputs.items() if name != "initial_state"}
    y, wkv = _rwkv7_rows(one["q"], one["g"].exp(), one["k"], one["v"], one["a"], one["b"],
                         inputs["initial_state"][0, 0].T)
    torch.testing.assert_close(o[0, :, 0], y, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final[0, 0], wkv.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["gated_deltanet", "gdn2"])
def test_gated_delta_rule_is_a_special_case(case):
    """(I - k (e * k)^T) Diag(exp g) S + k (w * v)^T = (Diag(exp g) + k a^T) S + k (w * v)^T with
    a = -(e * k * exp(g)): the chunked DPLR op, forward and backward, equals the gated delta
    rule's reference, a scalar decay per head included."""
    inputs = delta_rule_inputs(case, seq_len=41, key_heads=2, value_heads=2)
    expected = gated_delta_rule(**inputs, output_final_state=True, backend="reference")
    erase = inputs["erase"] if case == "gdn2" else inputs["beta"][..., None]
    write = inputs["write"] if case == "gdn2" else inputs["beta"][..., None]
    decay = inputs["g"] if inputs["g"].dim() == 4 else inputs["g"][..., None]
    actual = dplr_delta_rule(inputs["q"], inputs["k"], write * inputs["v"],
                             a=-(erase * inputs["k"] * decay.exp()), b=inputs["k"], g=inputs["g"],
                             initial_state=inputs["initial_state"], output_final_state=True,
                             backend="chunked")
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = [torch.randn_like(t) for t in expected]
    leaves = list(inputs.values())
    grads_expected = torch.autograd.grad(sum((t * w).sum() for t, w in zip(expected, weights)), leaves)
    grads_actual = torch.autograd.grad(sum((t * w).sum() for t, w in zip(actual, weights)), leaves)
    for name, got, want in zip(inputs, grads_actual, grads_expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9, msg=f"grad of {name}")


@pytest.mark.parametrize("form", ["rwkv7", "per_head"])
@pytest.mark.parametrize("packed", [False, True], ids=["batch", "packed"])
def test_summary_composes_the_token_steps(form, packed):
    """transition @ S_0 + state is the op's final state from any S_0; the transition is the
    product of the steps Diag(exp g_t) + b_t a_t^T."""
    cu_seqlens = torch.tensor([0, 7, 7, 20]) if packed else None
    batch, num_states = (1, 3) if packed else (2, None)
    inputs = {name: t.detach() for name, t in dplr_inputs(
        form, batch=batch, seq_len=20, with_initial_state=False, num_states=num_states).items()}
    options = {name: inputs[name] for name in ("a", "b", "g")}
    transition, state = dplr_delta_rule_summary(inputs["k"], inputs["v"], **options,
                                                cu_seqlens=cu_seqlens)
    entering = torch.randn_like(state)
    _, final = dplr_delta_rule(**inputs, initial_state=entering, output_final_state=True,
                               cu_seqlens=cu_seqlens, backend="reference")
    torch.testing.assert_close(transition @ entering + state, final)

    bounds = [0, 7, 7, 20] if packed else [0, 20]
    rows = [(0, start, end) for start, end in zip(bounds, bounds[1:])] if packed else [
        (row, 0, 20) for row in range(batch)]
    decay = inputs["g"] if inputs["g"].dim() == 4 else inputs["g"][..., None]
    for index, (row, start, end) in enumerate(rows):
        expected = torch.eye(8, dtype=torch.float64).expand(4, 8, 8)
        for t in range(start, end):
            step = (torch.diag_embed(decay[row, t].exp().expand(4, 8))
                    + inputs["b"][row, t, :, :, None] * inputs["a"][row, t, :, None, :])
            expected = step @ expected
        torch.testing.assert_close(transition[index], expected)
