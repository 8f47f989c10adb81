"""Decaying linear attention's own rules: a reference step worked out by hand, its decay forms
(none, a constant per head, per head and token, per key channel) as one rule. What it shares
with gated_delta_rule (the chunked form against the reference over shapes, dtypes, grouped
heads and packed sequences, strong decays, argument errors), and the tolerances:
test_recurrence_ops.py."""
import torch

from megatron_ext.kernels import decay_linear_attention
from megatron_ext.kernels.decay import decay_linear_attention_reference
from megatron_ext.kernels.selfcheck import decay_inputs as make_inputs



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
