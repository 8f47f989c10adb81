"""The DPLR delta rule (RWKV-7's generalised delta rule) behind one op: a state transition that is
diagonal plus rank one, with read and write vectors of its own.

Backends, with one signature and one layout (declared in the backend registry below):
    reference   token by token, fp32: the oracle (reference.py)
    chunked     chunkwise WY / UT-transform form in PyTorch, any device, chunks of 32 tokens
                (chunked.py)
    triton      the same chunkwise form by chunks of 64 tokens, with the four decayed score
                matrices of a decay per key channel (A, B, P^b, P^k), forward and backward, in
                our Triton kernels (no [C, C, K] pairwise decays); the triangular solves, the
                chunk matmuls and the state pass stay in PyTorch, and so do the scores of a
                decay per head or none (triton.py). CUDA (or Triton's CPU interpreter), K a
                power of two from 16 to 256, q, k, v in fp32, bf16 or fp16
"auto" (kernels.registry.choose): triton on CUDA for the calls it takes, once it has passed its
self-check on this GPU for the call's form and dtype; chunked otherwise.
"""
from .. import backends, registry
from ..common import declare_recurrence, lazy_triton_backend, recurrence_facts
from .chunked import dplr_delta_rule_chunked
from .reference import OP, dplr_delta_rule_reference, input_form
from .summary import dplr_delta_rule_summary

__all__ = ["dplr_delta_rule", "dplr_delta_rule_chunked", "dplr_delta_rule_reference",
           "dplr_delta_rule_summary", "dplr_delta_rule_triton"]

dplr_delta_rule_triton = lazy_triton_backend(OP, __name__, "dplr_delta_rule_triton")


def _facts(q, k, v, *, a=None, b=None, g=None, initial_state=None, cu_seqlens=None,
           **_options) -> registry.Facts:
    return recurrence_facts(q, k, v, a, b, g, initial_state, form=input_form(g), cu_seqlens=cu_seqlens)


def _triton_unsupported(facts: registry.Facts) -> str | None:
    """What the triton backend cannot run: a key dim its kernels do not tile (V never enters
    them), then the device and dtype rule of every Triton backend."""
    if facts.key_dim is not None and facts.key_dim not in backends.TRITON_HEAD_DIMS:
        return (f"K = {facts.key_dim}: the Triton kernels take key dims "
                f"{', '.join(map(str, backends.TRITON_HEAD_DIMS))}")
    return backends.triton_unavailable_reason(facts.device, facts.compute_dtype or facts.dtype)


declare_recurrence(OP, _facts, reference=dplr_delta_rule_reference, chunked=dplr_delta_rule_chunked,
                   triton=dplr_delta_rule_triton, triton_unsupported=_triton_unsupported)


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
        backend: "auto" (see above), "reference", "chunked" or "triton" (each raises
            kernels.registry.BackendUnavailable, a RuntimeError and a ValueError, "... backend
            '<name>' cannot run ...", for a call it does not take, e.g. fp64 inputs to triton).

    Returns:
        o ``[B, T, Hv, V]`` in v's dtype, and the final state ``[N, Hv, K, V]`` in fp32 (fp64 for
        fp64 inputs), or None when output_final_state is False.
    """
    return registry.call(OP, backend, q, k, v, a=a, b=b, g=g, scale=scale,
                         initial_state=initial_state, output_final_state=output_final_state,
                         cu_seqlens=cu_seqlens)
