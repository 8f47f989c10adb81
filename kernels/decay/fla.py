"""Decaying linear attention on fla-core's Triton kernels (fla-core >= 0.6; optional, imported
lazily).

Each decay form goes to the fla-core function written for it:

    our g                        kind              fla-core function
    None                         linear            fla.ops.simple_gla.chunk_simple_gla (no g)
    [Hv] (constant per head)     simple_gla_gamma  chunk_simple_gla(g_gamma=...)
    [B, T, Hv] (per token)       simple_gla        chunk_simple_gla(g=...)
    [B, T, Hv, K] (per channel)  gla               fla.ops.gla.chunk_gla

and the adapter maps our conventions onto fla-core's, as the delta-rule adapter does: q and k
repeated onto the Hv heads (``repeat_interleave``: v head i reads q/k head ``i // (Hv / Hk)``),
g a natural-log decay in fp32, the resolved scale always passed, states ``[N, H, K, V]`` in fp32,
cu_seqlens as int64 on the device and on the host, q, k and v in one dtype and o cast back to v's.

Whether fla-core may run at all is ``kernels.backends.fla_unavailable_reason``'s business; the
adapter refuses with its reason (``"decay_linear_attention: backend 'fla' cannot run ..."``)
rather than fall back to another backend. It also refuses a constant decay that requires grad:
fla-core takes g_gamma as a constant and would leave it without a gradient.
"""
import torch

from .. import registry
from ..backends import FLA_KINDS
from .reference import OP, check_inputs, input_form

__all__ = ["KIND_OF_FORM", "decay_fla_kind", "decay_linear_attention_fla"]

# The FLA_KINDS key (and so the fla-core function) that serves each decay form.
KIND_OF_FORM = {"none": "linear", "constant": "simple_gla_gamma", "per_head": "simple_gla",
                "per_channel": "gla"}


def decay_fla_kind(g) -> str:
    """The FLA_KINDS key (and so the fla-core function) that serves a decay of g's form."""
    return KIND_OF_FORM[input_form(g)]


def decay_linear_attention_fla(
    q, k, v, *, g=None, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """``decay_linear_attention`` on fla-core: same arguments, shapes and results as
    ``decay_linear_attention_reference``. Raises RuntimeError, saying why, where fla-core cannot
    serve the call (its rule in the backend registry: ``kernels.backends.fla_unavailable_reason``,
    and a constant decay that requires grad; and fp64 inputs, which no fla kernel takes)."""
    check_inputs(q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    registry.require(OP, "fla", q, k, v, g=g, initial_state=initial_state, cu_seqlens=cu_seqlens)
    kind = decay_fla_kind(g)
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    if dtype == torch.float64:
        raise RuntimeError(f"{OP}: backend 'fla' cannot run {kind} in float64 ({FLA_KINDS[kind]} "
                           "takes float16, bfloat16 and float32); use backend='chunked'")

    heads_per_key = v.shape[2] // q.shape[2]
    q = q.to(dtype).repeat_interleave(heads_per_key, dim=2)
    k = k.to(dtype).repeat_interleave(heads_per_key, dim=2)
    options = dict(
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
    )
    if cu_seqlens is not None:
        options.update(cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.int64),
                       cu_seqlens_cpu=cu_seqlens.to(device="cpu", dtype=torch.int64))
    if kind == "gla":
        from fla.ops.gla import chunk_gla

        o, final_state = chunk_gla(q, k, v.to(dtype), g.float(), **options)
    else:
        from fla.ops.simple_gla import chunk_simple_gla

        decay = {} if g is None else (
            {"g_gamma": g.float()} if kind == "simple_gla_gamma" else {"g": g.float()})
        o, final_state = chunk_simple_gla(q, k, v.to(dtype), **decay, **options)
    return o.to(v.dtype), final_state
