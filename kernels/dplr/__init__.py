"""The DPLR delta rule (RWKV-7's generalised delta rule) behind one op: a state transition that is
diagonal plus rank one, with read and write vectors of its own.

Backends, with one signature and one layout:
    reference   token by token, fp32: the oracle (reference.py)
    chunked     chunkwise WY / UT-transform form in PyTorch, any device (chunked.py)
"auto" is chunked: there are no Triton kernels for this op yet.
"""
from .. import registry
from ..common import recurrence_facts
from .chunked import dplr_delta_rule_chunked
from .reference import OP, dplr_delta_rule_reference
from .summary import dplr_delta_rule_summary

__all__ = ["dplr_delta_rule", "dplr_delta_rule_chunked", "dplr_delta_rule_reference",
           "dplr_delta_rule_summary"]


def _facts(q, k, v, *, a=None, b=None, g=None, initial_state=None, cu_seqlens=None,
           **_options) -> registry.Facts:
    return recurrence_facts(q, k, v, a, b, g, initial_state, form=None, cu_seqlens=cu_seqlens)


registry.declare(registry.Op(
    OP,
    backends={"reference": registry.Backend("reference", dplr_delta_rule_reference),
              "chunked": registry.Backend("chunked", dplr_delta_rule_chunked)},
    auto=("chunked",),
    facts=_facts,
))


def dplr_delta_rule(
    q, k, v, *, a, b, g=None, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, backend: str = "auto",
):
    """The delta rule with a diagonal-plus-low-rank transition and read-after-write, per head with
    a state S of shape [K, V] (key channels on the rows):

        S_t = (Diag(exp g_t) + b_t a_t^T) S_{t-1} + k_t v_t^T
        o_t = scale * S_t^T q_t

    RWKV-7 writes the transposed state ``[V, K]``, ``wkv_t = wkv_{t-1} (Diag(w_t) + a_t b_t^T) +
    v_t k_t^T``, ``y_t = wkv_t r_t``: the same recurrence with q = r, g = log w and scale = 1 (it
    takes a = -kappa_hat, b = kappa_hat * alpha). The gated delta rule is the special case
    a = -(erase * k * exp(g)), b = k (see reference.py).

    Args (everything after v is keyword-only, so that a and b cannot be swapped):
        q, k: ``[B, T, Hk, K]``.
        v: ``[B, T, Hv, V]``, Hv a multiple of Hk; q/k head i serves v heads
            ``i * Hv/Hk ... (i + 1) * Hv/Hk - 1`` (grouped heads).
        a: ``[B, T, Hv, K]``, what reads the state (``a_t^T S_{t-1}``).
        b: ``[B, T, Hv, K]``, the direction the read is written back along.
        g: log-decay (``<= 0``): None (no decay), ``[B, T, Hv]`` (one per head) or
            ``[B, T, Hv, K]`` (per key channel, as in RWKV-7).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]``; N = B, or the number of sequences with cu_seqlens.
        output_final_state: return the state after the last token of each sequence.
        cu_seqlens: integer ``[N + 1]`` boundaries of sequences packed along T (needs B == 1);
            the state restarts at each boundary, from ``initial_state[n]`` for sequence n.
        backend: "auto" (chunked), "reference" or "chunked".

    Returns:
        o ``[B, T, Hv, V]`` in v's dtype, and the final state ``[N, Hv, K, V]`` in fp32 (fp64 for
        fp64 inputs), or None when output_final_state is False.
    """
    return registry.call(OP, backend, q, k, v, a=a, b=b, g=g, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens)
