"""The decay family (causal linear attention, Mamba-2 SSD, RetNet, Lightning Attention, GLA)
behind one op: linear attention whose state decays by a scalar or a per-channel gate.

Backends, with one signature and one layout (declared in the backend registry below):
    reference   token by token, fp32: the oracle (reference.py)
    chunked     chunkwise masked attention plus a state pass, in PyTorch, any device (chunked.py)
    triton      our Triton kernels, forward and backward, by chunks of 64 tokens; CUDA (or
                Triton's CPU interpreter), K and V powers of two from 16 to 256, fp32/bf16/fp16,
                and on a GPU's tensor cores K >= 64 unless the decay is per channel
                (kernels.backends.decay_triton_unsupported; triton.py)
    fla         fla-core's chunk_simple_gla / chunk_gla, CUDA only, where
                kernels.backends.fla_unavailable_reason allows, and a constant decay only without
                a gradient (fla.py)
"auto" (kernels.registry.choose): triton on CUDA for the calls it takes, once it has passed its
self-check on this GPU for the call's form and dtype; chunked otherwise.
"""
import dataclasses

from .. import backends, registry
from ..backends import FLA_KINDS
from ..common import declare_recurrence, lazy_triton_backend, recurrence_facts
from .chunked import decay_linear_attention_chunked
from .fla import KIND_OF_FORM, decay_linear_attention_fla
from .reference import OP, decay_linear_attention_reference, input_form
from .summary import decay_linear_attention_summary

__all__ = [
    "decay_linear_attention", "decay_linear_attention_chunked", "decay_linear_attention_fla",
    "decay_linear_attention_reference", "decay_linear_attention_summary",
    "decay_linear_attention_triton",
]

decay_linear_attention_triton = lazy_triton_backend(OP, __name__, "decay_linear_attention_triton")


def _facts(q, k, v, *, g=None, initial_state=None, cu_seqlens=None, **_options) -> registry.Facts:
    facts = recurrence_facts(q, k, v, g, initial_state, form=input_form(g), cu_seqlens=cu_seqlens)
    return dataclasses.replace(facts, extra={"decay_requires_grad": g is not None and g.requires_grad})


_fla_rule = backends.fla_unsupported(KIND_OF_FORM)


def _fla_unsupported(facts: registry.Facts) -> str | None:
    """fla-core's rule, after its own: it takes a constant decay (g_gamma) as a constant, with no
    gradient, so a backward through such a decay that requires grad is refused."""
    if facts.form == "constant" and facts.requires_grad and facts.extra.get("decay_requires_grad"):
        kind = KIND_OF_FORM["constant"]
        return (f"a decay that requires grad: {FLA_KINDS[kind]} takes it as a constant and gives it "
                "no gradient (RetNet's and Lightning's decays are fixed: pass g without "
                "requires_grad, or use backend 'triton' or 'chunked')")
    return _fla_rule(facts)


declare_recurrence(OP, _facts, reference=decay_linear_attention_reference,
                   chunked=decay_linear_attention_chunked, triton=decay_linear_attention_triton,
                   fla=decay_linear_attention_fla, triton_unsupported=backends.decay_triton_unsupported,
                   fla_unsupported=_fla_unsupported, kind_of_form=KIND_OF_FORM)


def decay_linear_attention(
    q, k, v, *, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    backend: str = "auto",
):
    """Linear attention with a decaying state and read-after-write, per head with a state S of
    shape [K, V]:

        S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T
        o_t = scale * S_t^T q_t

    Args (everything after v is keyword-only):
        q, k: ``[B, T, Hk, K]``.
        v: ``[B, T, Hv, V]``, Hv a multiple of Hk; q/k head i serves v heads
            ``i * Hv/Hk ... (i + 1) * Hv/Hk - 1`` (grouped heads).
        g: log-decay (``<= 0``): None (no decay), ``[Hv]`` (a constant per head),
            ``[B, T, Hv]`` (one per head and token) or ``[B, T, Hv, K]`` (per key channel).
        scale: defaults to ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]``; N = B, or the number of sequences with cu_seqlens.
        output_final_state: return the state after the last token of each sequence.
        cu_seqlens: integer ``[N + 1]`` boundaries of sequences packed along T (needs B == 1);
            the state restarts at each boundary, from ``initial_state[n]`` for sequence n.
        backend: "auto" (see above), "reference", "chunked", "triton" or "fla" (CUDA; each
            raises RuntimeError "... backend '<name>' cannot run ..." for a call it does not
            take, e.g. fp64 inputs, or fla-core's refused gated backward on Hopper: from the
            registry, kernels.registry.BackendUnavailable, also a ValueError).

    The special cases: causal linear attention (g None); Mamba-2 SSD (g = A * dt ``[B, T, Hv]``,
    q = C, k = B, v = x * dt, scale = 1; D * x and the z gate stay outside); RetNet and Lightning
    Attention (g ``[Hv]``, e.g. RetNet's ``log(1 - 2 ** (-5 - arange(H)))``); GLA (g
    ``[B, T, Hv, K]``).

    Returns:
        o ``[B, T, Hv, V]`` in v's dtype, and the final state ``[N, Hv, K, V]`` in fp32 (fp64 for
        fp64 inputs), or None when output_final_state is False.
    """
    return registry.call(OP, backend, q, k, v, g=g, scale=scale, initial_state=initial_state,
                         output_final_state=output_final_state, cu_seqlens=cu_seqlens)
