"""The gated delta rule family (DeltaNet, Gated DeltaNet, KDA, Gated DeltaNet-2) behind one op.

Backends, with one signature and one layout (declared in the backend registry below):
    reference   token by token, fp32: the oracle (reference.py)
    chunked     chunkwise WY / UT-transform form in PyTorch, any device (chunked.py)
    triton      our own Triton kernels, forward and backward, CUDA only (triton.py; imported on
                first use, so that this package imports where Triton does not); K and V in
                kernels.backends.TRITON_HEAD_DIMS, fp32/bf16/fp16 (kernels.backends.triton_unsupported)
    fla         fla-core's Triton kernels, CUDA only, where
                kernels.backends.fla_unavailable_reason allows (fla.py)
"auto" (kernels.registry.choose): triton on CUDA for the calls it takes, once it has passed its
self-check on this GPU for the call's form and dtype; chunked otherwise.
"""
from .. import backends, registry
from ..common import declare_recurrence, lazy_triton_backend, recurrence_facts
from .chunked import gated_delta_rule_chunked
from .fla import KIND_OF_FORM, gated_delta_rule_fla
from .reference import OP, gated_delta_rule_reference, input_form
from .summary import gated_delta_rule_summary

__all__ = [
    "gated_delta_rule", "gated_delta_rule_chunked", "gated_delta_rule_fla",
    "gated_delta_rule_reference", "gated_delta_rule_summary", "gated_delta_rule_triton",
]

gated_delta_rule_triton = lazy_triton_backend(OP, __name__, "gated_delta_rule_triton")


def _facts(q, k, v, *, beta=None, g=None, erase=None, write=None, initial_state=None,
           cu_seqlens=None, **_options) -> registry.Facts:
    return recurrence_facts(q, k, v, beta, g, erase, write, initial_state,
                            form=input_form(g=g, erase=erase, write=write), cu_seqlens=cu_seqlens)


declare_recurrence(OP, _facts, reference=gated_delta_rule_reference, chunked=gated_delta_rule_chunked,
                   triton=gated_delta_rule_triton, fla=gated_delta_rule_fla,
                   triton_unsupported=backends.triton_unsupported,
                   fla_unsupported=backends.fla_unsupported(KIND_OF_FORM), kind_of_form=KIND_OF_FORM)


def gated_delta_rule(
    q, k, v, *, beta=None, g=None, erase=None, write=None, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None, return_write_residual=False,
    backend: str = "auto",
):
    """The gated delta rule with read-after-write, per head with a state S of shape [K, V]:

        S_t = (I - k_t (b_t * k_t)^T) Diag(exp g_t) S_{t-1} + k_t (w_t * v_t)^T
        o_t = scale * S_t^T q_t

    Args (everything after v is keyword-only, so that beta and g cannot be swapped):
        q, k: ``[B, T, Hk, K]``.
        v: ``[B, T, Hv, V]``, Hv a multiple of Hk; q/k head i serves v heads
            ``i * Hv/Hk ... (i + 1) * Hv/Hk - 1`` (grouped heads, as in GDN).
        beta: ``[B, T, Hv]``, the erase and write strength where erase / write are not given.
        g: log-decay (``<= 0``): None (no decay), ``[B, T, Hv]`` (one per head) or
            ``[B, T, Hv, K]`` (per key channel).
        erase: ``[B, T, Hv, K]``, the erase gate b_t (replaces beta in the erase term).
        write: ``[B, T, Hv, V]``, the write gate w_t (replaces beta in the write term).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]``; N = B, or the number of sequences with cu_seqlens.
        output_final_state: return the state after the last token of each sequence.
        cu_seqlens: integer ``[N + 1]`` boundaries of sequences packed along T (needs B == 1);
            the state restarts at each boundary, from ``initial_state[n]`` for sequence n.
        return_write_residual: also return the write residual
            ``r_t = w_t * v_t - (Diag(exp g_t) S_{t-1})^T (b_t * k_t)`` ``[B, T, Hv, V]`` (fp32),
            so that S_t = Diag(exp g_t) S_{t-1} + k_t r_t^T (reference, chunked and triton backends).
        backend: "auto" (see above), "reference", "chunked", "triton" (ours, on CUDA; K and V
            in 16, 32, 64, 128, 256) or "fla" (fla-core on CUDA). A backend named here that
            cannot take the call raises kernels.registry.BackendUnavailable (a RuntimeError and
            a ValueError) with the reason.

    The special cases: DeltaNet (g None, beta), Gated DeltaNet (g ``[B, T, Hv]``, beta), KDA
    (g ``[B, T, Hv, K]``, beta) and GDN-2 (g ``[B, T, Hv, K]``, erase, write).

    Returns:
        o ``[B, T, Hv, V]`` in v's dtype, and the final state ``[N, Hv, K, V]`` in fp32 (fp64 for
        fp64 inputs), or None when output_final_state is False; then the write residual if asked.
    """
    options = {"return_write_residual": True} if return_write_residual else {}
    if options and backend == "fla":
        raise ValueError("gated_delta_rule: the fla backend cannot return the write residual; "
                         "use backend='chunked'")
    return registry.call(
        OP, backend, q, k, v, beta=beta, g=g, erase=erase, write=write, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens,
        **options,
    )
