"""The decay family (causal linear attention, Mamba-2 SSD, RetNet, Lightning Attention, GLA)
behind one op: linear attention whose state decays by a scalar or a per-channel gate.

Backends, with one signature and one layout:
    reference   token by token, fp32: the oracle (reference.py)
    chunked     chunkwise masked attention plus a state pass, in PyTorch, any device (chunked.py)
    triton      our Triton kernels, forward and backward, by chunks of 64 tokens; CUDA (or
                Triton's CPU interpreter), K and V powers of two from 16 to 256 (triton.py)
    fla         fla-core's chunk_simple_gla / chunk_gla, CUDA only, where
                kernels.backends.fla_unavailable_reason allows (fla.py)
"auto" is kernels.backends.auto_backend: triton on CUDA once it has passed its self-check on
this GPU, for the head dims and inputs it takes (kernels.backends.triton_dims_reason and
decay_triton_declined_reason), chunked otherwise.
"""
from .. import backends
from ..common import lazy_triton_backend
from .chunked import decay_linear_attention_chunked
from .fla import decay_linear_attention_fla
from .reference import OP, decay_linear_attention_reference
from .summary import decay_linear_attention_summary

__all__ = [
    "decay_linear_attention", "decay_linear_attention_chunked", "decay_linear_attention_fla",
    "decay_linear_attention_reference", "decay_linear_attention_summary",
    "decay_linear_attention_triton",
]

decay_linear_attention_triton = lazy_triton_backend(OP, __name__, "decay_linear_attention_triton")

_BACKENDS = {
    "reference": decay_linear_attention_reference,
    "chunked": decay_linear_attention_chunked,
    "triton": decay_linear_attention_triton,
    "fla": decay_linear_attention_fla,
}


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
            take, e.g. fp64 inputs, or fla-core's refused gated backward on Hopper).

    The special cases: causal linear attention (g None); Mamba-2 SSD (g = A * dt ``[B, T, Hv]``,
    q = C, k = B, v = x * dt, scale = 1; D * x and the z gate stay outside); RetNet and Lightning
    Attention (g ``[Hv]``, e.g. RetNet's ``log(1 - 2 ** (-5 - arange(H)))``); GLA (g
    ``[B, T, Hv, K]``).

    Returns:
        o ``[B, T, Hv, V]`` in v's dtype, and the final state ``[N, Hv, K, V]`` in fp32 (fp64 for
        fp64 inputs), or None when output_final_state is False.
    """
    if backend == "auto":
        declined = backends.triton_dims_reason(q, v) or backends.decay_triton_declined_reason(q, g)
        form = "none" if g is None else {1: "constant", 3: "per_head", 4: "per_channel"}.get(g.dim())
        jobs = backends.selfcheck_jobs(OP, form, q.dtype, packed=cu_seqlens is not None)
        name = backends.auto_backend(OP, q.device, declined, jobs)
    else:
        name = backend
    if name not in _BACKENDS:
        known = ", ".join(repr(known_name) for known_name in ["auto", *_BACKENDS])
        raise ValueError(f"{OP}: unknown backend {backend!r}; known backends: {known}")
    return _BACKENDS[name](
        q, k, v, g=g, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
    )
