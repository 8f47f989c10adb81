"""The affine summaries behind state-passing context parallelism (kernels/*/summary.py): the
transition and zero-start state of a stretch of tokens, checked against composing the token
steps by hand, and against running the op from a random entering state."""

import pytest
import torch

from megatron_ext.kernels import decay_linear_attention, gated_delta_rule
from megatron_ext.kernels.decay import decay_linear_attention_summary
from megatron_ext.kernels.delta_rule import gated_delta_rule_summary
from megatron_ext.kernels.cases import DECAY_CASES, DELTA_RULE_CASES
from megatron_ext.kernels.selfcheck import decay_inputs, delta_rule_inputs


def _delta_rule_transition_by_steps(k, beta, g, erase):
    """Product over tokens of (I - k_t a_t^T) Diag(exp g_t), per batch row and value head."""
    batch, seq_len, key_heads, key_dim = k.shape
    value_heads = (beta if erase is None else erase).shape[2]
    k = k.repeat_interleave(value_heads // key_heads, dim=2)
    erase_gate = beta.unsqueeze(-1) if erase is None else erase
    decay = torch.zeros(batch, seq_len, value_heads, key_dim, dtype=k.dtype)
    if g is not None:
        decay = decay + (g.unsqueeze(-1) if g.dim() == 3 else g)
    product = torch.eye(key_dim, dtype=k.dtype).expand(batch, value_heads, key_dim, key_dim)
    for t in range(seq_len):
        step = torch.eye(key_dim, dtype=k.dtype) - k[:, t, :, :, None] * (erase_gate[:, t] * k[:, t])[:, :, None, :]
        product = step @ (decay[:, t].exp().unsqueeze(-1) * product)
    return product


@pytest.mark.parametrize("dims", [(8, 12), (16, 32)], ids=["one_call", "two_calls"])
@pytest.mark.parametrize("case", DELTA_RULE_CASES)
@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_delta_rule_summary_composes_the_token_steps(case, backend, dims):
    """Also where V + K = 48 is no Triton head dim but K = 16 and V = 32 are: two op calls."""
    inputs = delta_rule_inputs(case, seq_len=11, with_initial_state=False, key_dim=dims[0],
                               value_dim=dims[1])
    gates = {n: inputs.get(n) for n in ("beta", "g", "erase", "write")}
    transition, state = gated_delta_rule_summary(inputs["k"], inputs["v"], **gates, backend=backend)
    expected = _delta_rule_transition_by_steps(inputs["k"], gates["beta"], gates["g"], gates["erase"])
    torch.testing.assert_close(transition, expected.detach())
    entering = torch.randn_like(state)
    _, final = gated_delta_rule(**inputs, initial_state=entering, output_final_state=True,
                                backend="reference")
    torch.testing.assert_close(transition @ entering + state, final)


@pytest.mark.parametrize("decay", DECAY_CASES)
def test_decay_summary_is_the_decayed_entering_state_plus_the_zero_start_one(decay):
    inputs = decay_inputs(decay, seq_len=11, with_initial_state=False)
    transition, state = decay_linear_attention_summary(inputs["k"], inputs["v"], g=inputs.get("g"),
                                                       backend="chunked")
    entering = torch.randn_like(state)
    _, final = decay_linear_attention(**inputs, initial_state=entering, output_final_state=True,
                                      backend="reference")
    torch.testing.assert_close(transition * entering + state, final)
