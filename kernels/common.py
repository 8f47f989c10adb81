"""What the linear-recurrence op families share: the q/k/v, varlen and initial-state contract,
the upcast with grouped heads, and the layout of sequences as zero-padded chunks.

Every family takes q, k ``[B, T, Hk, K]`` and v ``[B, T, Hv, V]`` with Hv a multiple of Hk (q/k
head i serves v heads ``i * Hv/Hk ... (i + 1) * Hv/Hk - 1``), optional ``cu_seqlens [N + 1]`` for
sequences packed along T (B == 1), and an fp32 state ``[N, Hv, K, V]`` per sequence. The family's
own arguments (gates, decays) are checked by the family; ``op`` names it in every message.

Where the sequences lie is read on the host once per layout, not once per call
(:func:`sequence_bounds`): reading a GPU's cu_seqlens waits for the GPU, and a model passes the
same cu_seqlens tensor to every layer of a step.
"""
import collections
import importlib

import torch
import torch.nn.functional as F

from . import backends, registry
from .registry import Facts

__all__ = ["fail", "check_shared_inputs", "sequence_bounds", "upcast_qkv", "sequence_spans",
           "sequence_start_states", "to_chunks", "from_chunks", "lazy_triton_backend",
           "recurrence_facts", "declare_recurrence"]

_BOUNDS_CACHE_SIZE = 8
_bounds_read: collections.OrderedDict = collections.OrderedDict()  # id -> (tensor, version, bounds)


def sequence_bounds(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> tuple[int, ...]:
    """The sequences' first tokens and the end along the flattened ``B * T`` tokens: B rows of T
    tokens, or ``cu_seqlens`` as a tuple of ints. A cu_seqlens tensor is read (for a GPU's, a
    device-to-host copy that waits for the GPU) once, then remembered for the last few tensors
    seen, by identity and version (an in-place change is read again); the remembered tensors
    are held, so that their identities are not reused."""
    if cu_seqlens is None:
        return tuple(range(0, batch * seq_len + 1, seq_len)) if seq_len else (0,) * (batch + 1)
    seen = _bounds_read.get(id(cu_seqlens))
    if seen is not None and seen[0] is cu_seqlens and seen[1] == cu_seqlens._version:
        _bounds_read.move_to_end(id(cu_seqlens))
        return seen[2]
    bounds = tuple(cu_seqlens.tolist())
    _bounds_read[id(cu_seqlens)] = (cu_seqlens, cu_seqlens._version, bounds)
    while len(_bounds_read) > _BOUNDS_CACHE_SIZE:
        _bounds_read.popitem(last=False)
    return bounds


def lazy_triton_backend(op: str, package: str, name: str):
    """The ``triton`` backend of an op family: ``name`` from the family's ``triton`` module
    (``package``.triton), imported on the first call, so that importing the family needs no
    Triton (and Triton reads TRITON_INTERPRET, its CPU interpreter, only when the kernels are
    defined)."""

    def run(*args, **kwargs):
        try:
            module = importlib.import_module(".triton", package)
        except ImportError as error:
            raise RuntimeError(f"{op}: backend 'triton' cannot run: Triton does not import "
                               f"here ({error})") from error
        return getattr(module, name)(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    run.__doc__ = f"``{op}`` in our Triton kernels ({package}.triton, imported on first use)."
    return run


def recurrence_facts(q, k, v, *others, form: str | None, cu_seqlens) -> Facts:
    """What the backend registry knows of a call of a linear-recurrence op: q's device and
    dtype, the dtype of q, k and v promoted, K and V, the input form (cases.py's), whether it
    packs sequences, and whether a backward will run (autograd on and an input, ``others``
    included, that requires grad)."""
    tensors = (q, k, v, *others)
    return Facts(
        device=q.device, dtype=q.dtype,
        compute_dtype=torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype),
        key_dim=q.shape[-1], value_dim=v.shape[-1], form=form, packed=cu_seqlens is not None,
        requires_grad=torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors),
    )


def declare_recurrence(op: str, facts, *, reference, chunked, triton, triton_unsupported, fla=None,
                       fla_unsupported=None, kind_of_form: dict[str, str] | None = None) -> registry.Op:
    """Declare a linear-recurrence op in the backend registry with the backends of the gated
    delta rule and decay families: "auto" prefers our Triton kernels on CUDA (the calls
    ``triton_unsupported`` lets through, once the self-check passed there for the call's form
    and dtype: ``backends.triton_verified``), then chunked; fla-core, where the op has an
    adapter (``fla``), serves calls asked for by name, where ``fla_unsupported`` allows, its
    refusals naming the fla-core kind of the call's form (``kind_of_form``)."""
    declared = {
        "reference": registry.Backend("reference", reference),
        "chunked": registry.Backend("chunked", chunked),
        "triton": registry.Backend("triton", triton, unsupported=triton_unsupported,
                                   verify=backends.triton_verified(op), auto_devices=("cuda",)),
    }
    if fla is not None:
        declared["fla"] = registry.Backend("fla", fla, unsupported=fla_unsupported,
                                           subject=lambda facts: kind_of_form.get(facts.form))
    return registry.declare(registry.Op(op, backends=declared, auto=("triton", "chunked"), facts=facts))


def fail(op: str, name: str, tensor: torch.Tensor, expected: str) -> None:
    raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}, expected {expected}")


def check_shared_inputs(op: str, q, k, v, *, initial_state, cu_seqlens) -> None:
    """Raise ValueError, naming the argument, its shape and what was expected, if q, k, v,
    cu_seqlens and initial_state do not fit together."""
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            fail(op, name, tensor, "a 4-D tensor [B, T, H, D]")
        if not tensor.is_floating_point():
            raise ValueError(f"{op}: {name} has dtype {tensor.dtype}, expected a floating-point dtype")
    batch, seq_len, key_heads, key_dim = q.shape
    value_heads, value_dim = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        fail(op, "k", k, f"the shape of q {list(q.shape)} = [B, T, Hk, K]")
    if v.shape[:2] != q.shape[:2]:
        fail(op, "v", v, f"[B, T, Hv, V] with B, T = {batch}, {seq_len} as in q")
    if value_heads % key_heads != 0:
        fail(op, "v", v, f"[B, T, Hv, V] with Hv a multiple of the {key_heads} q/k heads")

    num_states = batch
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            fail(op, "cu_seqlens", cu_seqlens, "a 1-D integer tensor [N + 1] of sequence boundaries")
        if batch != 1:
            fail(op, "q", q, "B == 1 when cu_seqlens is given (sequences packed along T)")
        bounds = sequence_bounds(cu_seqlens, batch, seq_len)
        if bounds[0] != 0 or bounds[-1] != seq_len or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"{op}: cu_seqlens = {list(bounds)} must start at 0, never decrease and end at T = {seq_len}"
            )
        num_states = len(bounds) - 1
    if initial_state is not None:
        expected_state = [num_states, value_heads, key_dim, value_dim]
        if list(initial_state.shape) != expected_state:
            what = "number of sequences" if cu_seqlens is not None else "batch size"
            fail(op, "initial_state", initial_state, f"[N, Hv, K, V] = {expected_state} (N = {what})")


def upcast_qkv(q, k, v) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v in the compute dtype, fp32 (fp64 if an input is fp64, so that tests can compare
    backends to ~1e-12), with q and k repeated onto the v heads: each ``[B, T, Hv, D]``."""
    dtype = torch.float32
    for tensor in (q, k, v):
        dtype = torch.promote_types(dtype, tensor.dtype)
    heads_per_key = v.shape[2] // q.shape[2]
    return (q.to(dtype).repeat_interleave(heads_per_key, dim=2),
            k.to(dtype).repeat_interleave(heads_per_key, dim=2),
            v.to(dtype))


def sequence_spans(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int) -> list[tuple[int, int, int]]:
    """The independent sequences as ``(batch_row, start, end)``; their order is the order of
    ``initial_state`` and ``final_state`` rows."""
    if cu_seqlens is None:
        return [(row, 0, seq_len) for row in range(batch)]
    bounds = sequence_bounds(cu_seqlens, batch, seq_len)
    return [(0, start, end) for start, end in zip(bounds, bounds[1:])]


def sequence_start_states(initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None,
                          batch: int, seq_len: int, state_shape, dtype, device):
    """For the token-by-token references: each sequence's ``(batch_row, start, end)`` span
    (:func:`sequence_spans`) with its starting state, ``initial_state``'s row in ``dtype`` or
    zeros of ``state_shape``."""
    for index, (row, start, end) in enumerate(sequence_spans(cu_seqlens, batch, seq_len)):
        state = (torch.zeros(state_shape, dtype=dtype, device=device) if initial_state is None
                 else initial_state[index].to(dtype))
        yield row, start, end, state


def per_token(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """For the token-by-token references: ``[B, T, ...]`` tensors as one tuple per token along the
    flattened ``B * T`` (token ``t`` of row ``r`` at ``r * T + t``), split by a single unbind each.
    Indexing a token out of the whole tensor instead would make autograd build a full-size
    gradient per token in the backward pass (O(T^2) for a sequence)."""
    return list(zip(*(tensor.flatten(0, 1).unbind(0) for tensor in tensors)))


def stack_tokens(steps: list[torch.Tensor], batch: int, seq_len: int, shape, dtype, device) -> torch.Tensor:
    """For the token-by-token references: their per-token outputs, taken in the order of
    :func:`sequence_spans` (which tile the ``B * T`` tokens in order), as ``[B, T, *shape]``,
    by one stack (where writing each token into a preallocated tensor would make autograd copy
    the whole tensor per token)."""
    assert len(steps) == batch * seq_len, (len(steps), batch, seq_len)
    if not steps:
        return torch.zeros(batch, seq_len, *shape, dtype=dtype, device=device)
    return torch.stack(steps).reshape(batch, seq_len, *shape)


def to_chunks(tensor: torch.Tensor, spans, num_chunks: int, chunk_size: int) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[N, H, num_chunks, chunk_size, D]``, one row per sequence in spans,
    zero-padded at the end. The caller makes sure that a zero token changes nothing (for the
    linear recurrences here: q = k = 0 and a log-decay of 0 read nothing, write nothing and
    decay nothing), so that padding is exact."""
    padded_len = num_chunks * chunk_size
    rows = [F.pad(tensor[row, start:end], (0, 0, 0, 0, 0, padded_len - (end - start)))
            for row, start, end in spans]
    sequences = torch.stack(rows)  # [N, padded_len, H, D]
    return sequences.unflatten(1, (num_chunks, chunk_size)).permute(0, 3, 1, 2, 4)


def from_chunks(chunked: torch.Tensor, spans, batch: int, seq_len: int) -> torch.Tensor:
    """The inverse of ``to_chunks``: ``[N, H, num_chunks, chunk_size, D]`` -> ``[B, T, H, D]``,
    dropping the padding."""
    heads, dim = chunked.shape[1], chunked.shape[-1]
    sequences = chunked.permute(0, 2, 3, 1, 4).flatten(1, 2)  # [N, num_chunks * chunk_size, H, D]
    kept = torch.cat([sequences[index, : end - start] for index, (_, start, end) in enumerate(spans)])
    return kept.reshape(batch, seq_len, heads, dim)
