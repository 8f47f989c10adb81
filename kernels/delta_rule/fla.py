"""The gated delta rule on fla-core's Triton kernels (fla-core >= 0.6; optional, imported lazily).

Each special case goes to the fla-core function written for it:

    case    our arguments                 fla-core function                                  heads
    deltanet  g None, beta                fla.ops.delta_rule.chunk_delta_rule                Hk == Hv only
    gdn       g [B, T, Hv], beta          fla.ops.gated_delta_rule.chunk_gated_delta_rule    grouped (GVA)
    kda       g [B, T, Hv, K], beta       fla.ops.kda.chunk_kda                              grouped (GVA)
    gdn2      erase and/or write given    fla.ops.gdn2.chunk_gdn2                            Hk == Hv only

and the adapter maps our conventions onto fla-core's:

- q/k heads: where fla has no grouped heads, q and k are repeated onto the Hv heads; fla and we
  both give v head i the q/k head ``i // (Hv / Hk)``, so the repeat is ``repeat_interleave``.
- gdn2: fla takes an erase gate ``b [B, T, H, K]``, a write gate ``w [B, T, H, V]`` and a
  per-channel ``g [B, T, H, K]``; a gate we resolve from beta is beta broadcast over the
  channels, and a missing or per-head g is broadcast (zeros for none).
- g is a natural-log decay and beta is the gate itself in both, so fla's in-kernel activations
  (``use_gate_in_kernel``, ``use_beta_sigmoid_in_kernel``, ``allow_neg_eigval``,
  ``use_qk_l2norm_in_kernel``, ``safe_gate``) stay off: our caller has applied them.
- scale: fla's default is ours (``K ** -0.5``); we always pass the resolved value.
- states: fla's default layout ``[N, H, K, V]`` is ours (``state_v_first=False``); the initial
  state goes in as fp32 (chunk_kda and chunk_gdn2 assert it) and the final state comes back fp32.
- cu_seqlens: fla wants int64 on the device, plus the same on the host (``cu_seqlens_cpu``) so
  that it can lay out chunks without a device-to-host copy.
- dtypes: q, k, v share one dtype in fla (chunk_delta_rule asserts it); fla returns o in that
  dtype and we cast it to v's. chunk_delta_rule refuses fp32 and no fla kernel takes fp64.

Whether fla-core may run at all is ``kernels.backends.fla_unavailable_reason``'s business (one
policy for both families); the adapter refuses with its reason rather than fall back, so that a
caller never gets another backend silently.
"""
import torch

from .. import registry
from ..backends import FLA_KINDS
from .reference import OP, check_inputs, input_form

__all__ = ["KIND_OF_FORM", "fla_kind", "gated_delta_rule_fla"]

# The FLA_KINDS key (and so the fla-core function) that serves each input form.
KIND_OF_FORM = {"deltanet": "deltanet", "gated_deltanet": "gdn", "kda": "kda", "gdn2": "gdn2"}


def fla_kind(*, beta, g, erase, write) -> str:
    """The FLA_KINDS key (and so the fla-core function) that serves these gated_delta_rule gates."""
    del beta  # every form has it (or erase and write instead)
    return KIND_OF_FORM[input_form(g=g, erase=erase, write=write)]


def gated_delta_rule_fla(
    q, k, v, *, beta=None, g=None, erase=None, write=None, scale=None,
    initial_state=None, output_final_state=False, cu_seqlens=None,
):
    """``gated_delta_rule`` on fla-core: same arguments, shapes and results as
    ``gated_delta_rule_reference`` (q, k ``[B, T, Hk, K]``; v ``[B, T, Hv, V]``; beta
    ``[B, T, Hv]``; g ``[B, T, Hv]`` or ``[B, T, Hv, K]``; erase ``[B, T, Hv, K]``; write
    ``[B, T, Hv, V]``; initial_state ``[N, Hv, K, V]``), returning o ``[B, T, Hv, V]`` in v's
    dtype and the fp32 final state ``[N, Hv, K, V]`` (or None).

    Raises RuntimeError, saying why, where fla-core cannot serve the call: see its rule in the
    backend registry (``kernels.backends.fla_unavailable_reason``), plus fp32 DeltaNet and fp64
    inputs.
    """
    check_inputs(q, k, v, beta=beta, g=g, erase=erase, write=write, initial_state=initial_state,
                 cu_seqlens=cu_seqlens)
    registry.require(OP, "fla", q, k, v, beta=beta, g=g, erase=erase, write=write,
                     initial_state=initial_state, cu_seqlens=cu_seqlens)
    kind = fla_kind(beta=beta, g=g, erase=erase, write=write)

    out_dtype = v.dtype
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    supported = (torch.float16, torch.bfloat16) if kind == "deltanet" else (
        torch.float16, torch.bfloat16, torch.float32)
    if dtype not in supported:
        raise RuntimeError(
            f"gated_delta_rule: backend 'fla' cannot run {kind} in {dtype} ({FLA_KINDS[kind]} "
            f"takes {', '.join(str(d) for d in supported)}); cast the inputs or use backend='chunked'"
        )
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    key_dim = q.shape[-1]
    common = dict(
        scale=key_dim**-0.5 if scale is None else scale,
        initial_state=None if initial_state is None else initial_state.float(),
        output_final_state=output_final_state,
    )
    if cu_seqlens is not None:
        common.update(cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.int64),
                      cu_seqlens_cpu=cu_seqlens.to(device="cpu", dtype=torch.int64))
    heads_per_key = v.shape[2] // q.shape[2]

    if kind == "deltanet":
        from fla.ops.delta_rule import chunk_delta_rule

        q, k = q.repeat_interleave(heads_per_key, dim=2), k.repeat_interleave(heads_per_key, dim=2)
        o, final_state = chunk_delta_rule(q, k, v, beta, **common)
    elif kind == "gdn":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, **common)
    elif kind == "kda":
        from fla.ops.kda import chunk_kda

        o, final_state = chunk_kda(q, k, v, g, beta, **common)
    else:
        from fla.ops.gdn2 import chunk_gdn2

        q, k = q.repeat_interleave(heads_per_key, dim=2), k.repeat_interleave(heads_per_key, dim=2)
        per_key = q.shape  # [B, T, Hv, K]
        erase_gate = beta.unsqueeze(-1).expand(per_key) if erase is None else erase
        write_gate = beta.unsqueeze(-1).expand(v.shape) if write is None else write
        if g is None:
            g = torch.zeros(per_key, dtype=torch.float32, device=q.device)
        elif g.dim() == 3:
            g = g.unsqueeze(-1).expand(per_key)
        o, final_state = chunk_gdn2(q, k, v, g, erase_gate, write_gate, **common)
    return o.to(out_dtype), final_state
