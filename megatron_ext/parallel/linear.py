"""Context parallelism for the linear recurrences: state passing, and all-to-all as the fallback.

Both wrap one op call of a mixer (``gated_delta_rule``, ``decay_linear_attention`` or
``dplr_delta_rule``); what comes before it (projections, gates, the short convolution with its
halo, RWKV-7's token shift) is token-wise or handled by
:meth:`~megatron_ext.parallel.ContextParallel.previous_tokens`.

State passing
-------------
Per head the recurrences are affine in the state: a chunk c of tokens entered with state S
leaves ``S' = M_c S + H_c`` (gated delta rule: ``M_c`` = product over the chunk of
``(I - k_t a_t^T) Diag(exp g_t)``, K x K; DPLR delta rule: of ``Diag(exp g_t) + b_t a_t^T``,
K x K; decay family: ``M_c = Diag(exp sum_t g_t)``; ``H_c`` the state the chunk leaves from
S = 0; see ``kernels/*/summary.py``). With Megatron's layout (rank r holds chunks r and
2CP-1-r of the 2CP chunks):

1. each rank computes ``(M_c, H_c)`` of its two chunks from a zero state (one op call);
2. one all-gather of these summaries, ``2 B H K (V + K)`` values per rank for the delta rules,
   ``2 B H K (V + 1)`` for the decay family, whatever T;
3. each rank composes the prefix ``S_0 = 0, S_{c+1} = M_c S_c + H_c`` up to its last chunk
   (``2CP - 1 - r`` small matmuls; redundant across ranks, cheaper than a second round of
   communication) and so has the true entering states ``S_r`` and ``S_{2CP-1-r}``;
4. it reruns its two chunks (as a batch of 2B rows) with ``initial_state=`` those states.

The result equals the one-rank run up to float rounding: the composition is the recurrence
itself, regrouped. Backward is autograd through the same graph: the op's backward for both
calls, the composition's, and the all-gather's backward, a reduce-scatter of the summaries'
gradients (``dL/d(M_c, H_c)`` summed over the ranks whose chunks come after c), which is the
mirror image of step 2 with the same volume. This is the scheme of fla-core's context
parallelism (kernels.md section 2), written here on top of the ops' public ``initial_state``
argument, so every backend (reference, chunked, triton, fla) runs under it.

All-to-all (Ulysses; Jacobs et al., "DeepSpeed Ulysses", 2023)
-------------------------------------------------------------
The op's inputs go from sequence-sharded ``[B, 2L, H, D]`` to head-sharded ``[B, T, H/CP, D]``
(whole sequence, global order), the op runs unchanged, and its outputs come back. Needs the
local heads (Hk and Hv) divisible by CP. Volume per rank: every input and output once, scaled
by ``(CP - 1) / CP``; it grows with T (see README.md for both formulas).
"""

from __future__ import annotations

import torch

from megatron_ext.config import ConfigError
from megatron_ext.parallel.context import ContextParallel, PackedLayout, packed_layout

METHODS = ("state_passing", "all_to_all")


def check_heads(cp: ContextParallel | None, method: str, mixer: str, **local_heads: int) -> None:
    """ConfigError at build time when all-to-all CP cannot split these per-rank head counts."""
    if cp is None or method != "all_to_all":
        return
    for name, heads in local_heads.items():
        if heads % cp.size:
            raise ConfigError(
                f"{mixer}: {heads} {name} per tensor-parallel rank are not divisible by "
                f"context_parallel_size={cp.size}, which context_parallel_method='all_to_all' "
                "needs (heads must divide by TP * CP); use context_parallel_method="
                "'state_passing' or change the head count")


def check_sequence(cp: ContextParallel | None, local_length: int, cu_seqlens, conv_kernel: int,
                   mixer: str) -> PackedLayout | None:
    """Under CP: raise for lengths the layout or the convolution's halo cannot take, naming the
    mixer; return the layout of packed sequences (None for ordinary batches or without CP)."""
    if cp is None:
        return None
    try:
        if cu_seqlens is None:
            cp.check_local_length(local_length, min_chunk=conv_kernel - 1)
            return None
        packed = packed_layout(cp, cu_seqlens, min_chunk=conv_kernel - 1)
    except ConfigError as error:
        raise ConfigError(f"{mixer}: {error}") from None
    expected = int(packed.piece_lengths.sum())
    if expected != local_length:
        raise ValueError(f"{mixer}: the local sequence has {local_length} tokens, but cu_seqlens "
                         f"{cu_seqlens.tolist()} under context_parallel_size={cp.size} gives "
                         f"{expected} (is it Megatron's per-document split?)")
    return packed


def entering_states(cp: ContextParallel, transition: torch.Tensor,
                    state: torch.Tensor) -> torch.Tensor:
    """The true entering state of each local chunk.

    transition ``[2B, H, K, K]`` (full) or ``[2B, H, K or 1, 1]`` (diagonal), state
    ``[2B, H, K, V]``: the summaries of this rank's chunks (chunk-batched). Returns
    ``[2B, H, K, V]``.
    """
    value_dim, width = state.shape[-1], transition.shape[-1]
    packed = torch.cat([state, transition.expand(*state.shape[:-1], width)], dim=-1)
    ordered = cp.gather_chunks(packed.unflatten(0, (-1, 2)))  # [2CP, B, H, K, V + width]
    current = torch.zeros_like(state[0::2])
    entering = [current]
    for chunk in range(max(cp.chunks)):
        contribution, step = ordered[chunk].split([value_dim, width], dim=-1)
        current = (step * current if width == 1 else step @ current) + contribution
        entering.append(current)
    return cp.mine(entering)


def _sequence_tensors(fn, inputs: dict) -> dict:
    """Apply ``fn`` to the ``[B, T, ...]`` inputs; None and per-head constants pass through."""
    return {name: fn(t) if t is not None and t.dim() >= 3 else t for name, t in inputs.items()}


def linear_recurrence(cp: ContextParallel | None, method: str, op, summary, inputs: dict,
                      **options):
    """``op(**inputs, **options)`` on the whole sequence, with this rank's part of it.

    ``op`` is ``gated_delta_rule``, ``decay_linear_attention`` or ``dplr_delta_rule`` and
    ``summary`` its ``*_summary``; ``inputs`` are the op's tensors (q, k, v, gates, decay;
    ``[B, 2L, ...]`` under CP, per-head constants ``[H]`` allowed); ``options`` the rest
    (backend, scale, ...).
    With ``cu_seqlens`` (global, as Megatron passes it) the local sequence is Megatron's
    per-document split (:class:`~megatron_ext.parallel.context.PackedLayout`).
    Returns what the op returns, the final state being None under CP.
    """
    if cp is None:
        return op(**inputs, **options)
    if options.get("output_final_state") or options.get("initial_state") is not None:
        raise NotImplementedError("initial_state / output_final_state under context parallelism")
    packed = check_sequence(cp, inputs["q"].shape[1], options.get("cu_seqlens"), 1, op.__name__)
    if method == "state_passing":
        # The rows of the summaries and the op: chunk-batched [2B, L] rows, or the packed
        # layout's pieces (document i's two chunks at 2i, 2i + 1) through cu_seqlens.
        if packed is None:
            rows, back, pieces = _sequence_tensors(cp.split_chunks, inputs), cp.merge_chunks, {}
        else:
            rows, back = inputs, (lambda t: t)
            pieces = {"cu_seqlens": packed.local_cu_seqlens}
            options = {**options, **pieces}
        transition, state = summary(**{n: t for n, t in rows.items() if n != "q"},
                                    backend=options.get("backend", "auto"), **pieces)
        outputs = op(**rows, initial_state=entering_states(cp, transition, state), **options)
    elif method == "all_to_all":
        full = _sequence_tensors(lambda t: cp.sequence_to_heads(t, packed), inputs)
        full = {n: cp.heads_of_rank(t) if t is not None and t.dim() == 1 else t
                for n, t in full.items()}
        outputs = op(**full, **options)
        back = lambda t: cp.heads_to_sequence(t, packed)  # noqa: E731
    else:
        raise ConfigError(f"context_parallel_method={method!r} is not one of {list(METHODS)}")
    return (back(outputs[0]), None, *(back(t) for t in outputs[2:]))
