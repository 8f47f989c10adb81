"""DeepSeek Sparse Attention's ops (``dsa_select``, ``dsa_attention``, ``dsa_indexer_loss``) and
the per-token selected attention and indexer loss that CSA shares."""
import torch

from .. import registry
from . import flash
from .flex import flex_attention_layout
from .layout import key_selection_layout
from .reference import (OP, _masked_probs, causal_mask, check_qkv, dsa_attention_reference,
                        dsa_indexer_loss_reference, dsa_select_reference, indexer_kl,
                        lightning_index_scores, selected_mask)
from .routing import (_blocks, _check_sink, attention_facts, cudnn_verified, either, flash_backend,
                      flex_refusal, indexer_facts, indexer_kernels_refusal, selected_kernels_refusal,
                      selected_kernels_verified, unless)
from .selected import QueryShares, indexer_loss, select_keys, selected_attention


def _check_selected(selected, q):
    if (selected.dim() != 3 or tuple(selected.shape[:2]) != tuple(q.shape[:2])
            or selected.dtype not in (torch.int32, torch.int64)):
        raise ValueError(f"{OP}: selected has shape {tuple(selected.shape)} and dtype "
                         f"{selected.dtype}, expected integer [B, T, K] with B, T = "
                         f"{q.shape[0]}, {q.shape[1]}")


# The most keys for which "auto" runs dsa_attention and csa_attention on FlexAttention over the
# selection's bitmap. Its dense tiles cost B Hq T S / 2 (query, key) products and its bitmap
# B T S / 8 bytes, against B T K rows for the gathered kernels (triton.py), which leaves flex the
# faster up to long sequences (benchmarks/dsa_stages.py); beyond this limit, triton.
SELECTED_FLEX_MAX_KEYS = 65536

# The largest bias (2 B T^2 bytes, made in the forward and again in the backward) for which
# "auto" runs dsa_attention on cuDNN; beyond it FlexAttention's bitmap (B T^2 / 8 bytes). At 4 GiB:
# B = 2 at T = 32768, B = 8 at T = 16384 (the peaks of both: ``benchmarks/sparse_attention.py
# --ops dsa/flash,dsa/flex``).
CAUSAL_SELECTION_MAX_BIAS = 4 << 30


def _many_keys(facts: registry.Facts) -> str | None:
    keys = facts.extra.get("selected_keys", facts.extra.get("key_len"))
    if keys is not None and keys > SELECTED_FLEX_MAX_KEYS:
        return f"{keys} keys, over SELECTED_FLEX_MAX_KEYS = {SELECTED_FLEX_MAX_KEYS}"
    return None


def _large_bias(facts: registry.Facts) -> str | None:
    size = facts.extra.get("bias_bytes")
    if size is not None and size > CAUSAL_SELECTION_MAX_BIAS:
        return f"a bias of {size} bytes, over CAUSAL_SELECTION_MAX_BIAS = {CAUSAL_SELECTION_MAX_BIAS}"
    return None


def _triton_selected_attention(*args, **kwargs):
    """triton.py's ``selected_attention`` (imported on first use)."""
    from . import triton as kernels

    return kernels.selected_attention(*args, **kwargs)


def selected_backends(reference, flash_function, flash_unsupported, flash_verify,
                      flash_limit=None) -> dict[str, registry.Backend]:
    """The backends of DSA's and CSA's per-token selected attention: the reference; the
    gathered form of selected.py (any device); FlexAttention over the selection's bitmap (flex:
    "auto" on CUDA up to ``SELECTED_FLEX_MAX_KEYS`` keys); triton.py's kernels (triton: "auto"
    on CUDA once their first-use check passed); and the op's path on flash.py (flash: cuDNN,
    where FlashAttention-2's and cuDNN's rules and ``flash_unsupported`` allow, "auto" once
    ``flash_verify`` passed)."""
    return {
        "reference": registry.Backend("reference", reference),
        "gathered": registry.Backend("gathered", selected_attention),
        "flex": registry.Backend("flex", flex_attention_layout, unsupported=flex_refusal,
                                 auto_devices=("cuda",), auto_limit=_many_keys),
        "triton": registry.Backend("triton", _triton_selected_attention,
                                   unsupported=selected_kernels_refusal,
                                   verify=selected_kernels_verified, auto_devices=("cuda",)),
        "flash": flash_backend(flash_function, flash_unsupported, flash_verify, flash_limit,
                               cudnn=True),
    }


SELECTED_AUTO = ("flash", "flex", "triton", "gathered")


def _attention_facts(q, k, v, selected=None, *, causal=False, **_options) -> registry.Facts:
    return attention_facts(q, k, v, causal=causal,
                           bias_bytes=q.shape[0] * q.shape[1] * k.shape[1] * q.element_size())


registry.declare(registry.Op(
    "dsa_attention",
    backends=selected_backends(
        dsa_attention_reference, flash.causal_selection_attention,
        unless("causal", "it takes causal selections only (causal=True)", expected=True),
        cudnn_verified, flash_limit=_large_bias),
    auto=SELECTED_AUTO,
    facts=_attention_facts,
))


def _selected_attention(name: str, q, k, v, selected, sink, scale):
    """dsa_attention's and csa_attention's per-token attention on the backend ``name`` (flex,
    triton or gathered)."""
    if name == "flex":
        layout = key_selection_layout(selected, k.shape[1], *_blocks("flex", None))
        # Its main kernel always: under 128 queries with grouped heads Inductor picks its
        # decoding kernel, which finds no valid configuration for this layout at T = 70 with 4
        # query heads per key/value head in fp32 on an H200 (torch 2.11).
        return flex_attention_layout(q, k, v, layout, sink=sink, scale=scale,
                                     kernel_options={"BACKEND": "TRITON"})
    run = _triton_selected_attention if name == "triton" else selected_attention
    return run(q, k, v, selected, sink=sink, scale=scale)


def _loss_facts(q, k, index_q, index_k, *_args, **_options) -> registry.Facts:
    return attention_facts(q, k, k, **indexer_facts(index_q, index_k))


def declare_indexer_loss(name: str, reference) -> None:
    """Declare an indexer loss (DSA's, CSA's): its reference, and the chunked PyTorch form
    (gathered) whose sparse stage (its target and its KL, given a selection) runs on triton.py's
    and triton_indexer.py's kernels with "triton", and under "auto" on CUDA where they take the
    call and have passed their first-use check. The loss has no FlexAttention form: under
    "flex" (which runs the attention over the selection's bitmap) its sparse stage runs as
    under "auto"."""
    registry.declare(registry.Op(
        name,
        backends={
            "reference": registry.Backend("reference", reference),
            "gathered": registry.Backend("gathered", indexer_loss),
            "flex": registry.Backend("flex", indexer_loss),
            "triton": registry.Backend(
                "triton", indexer_loss, unsupported=either(selected_kernels_refusal, indexer_kernels_refusal),
                verify=selected_kernels_verified, auto_devices=("cuda",)),
        },
        auto=("triton", "gathered"),
        facts=_loss_facts,
    ))


def declare_per_token(name: str, reference, function) -> None:
    """Declare a per-token op without kernels of its own (a selection, the KV compression):
    its reference, and for every other backend its gathered PyTorch form."""
    registry.declare(registry.Op(
        name,
        backends={"reference": registry.Backend("reference", reference),
                  **{each: registry.Backend(each, function) for each in ("gathered", "flex", "triton")}},
        auto=("gathered",),
        facts=lambda x, *args, **options: registry.Facts(device=x.device, dtype=x.dtype),
    ))


declare_indexer_loss("dsa_indexer_loss", dsa_indexer_loss_reference)
declare_per_token("dsa_select", dsa_select_reference, select_keys)


def _runs_reference(op: str, backend: str) -> bool:
    """Whether a per-token op or an indexer loss runs its reference (else its gathered form,
    whose kernels, if any, are chosen apart), asked for by name or through the override table;
    a name ``op`` does not declare raises ValueError."""
    return registry.named(op, backend) == "reference"


def _loss_kernels(op: str, backend: str, q, k, selected, index_q, index_k):
    """triton.py's module for an indexer loss's sparse stage (its target and its KL) where the
    registry runs it on the kernels (``op``'s "triton"), else None (the chunked PyTorch form);
    None for the dense warm-up (no selection)."""
    if selected is None:
        return None
    name = registry.choose(op, "auto" if backend == "flex" else backend,
                           _loss_facts(q, k, index_q, index_k))
    if name != "triton":
        return None
    from . import triton as kernels

    return kernels


def _check_index(index_q, index_k, index_weights, seq_len: int, keys: tuple | None = None,
                 shares: QueryShares | None = None):
    """Raise ValueError, with the shapes, unless the indexer's tensors fit each other and T;
    ``keys``: ``(name, count)`` of index_k's keys when they are not the T tokens (CSA);
    ``shares``: index_q and index_weights hold this process's n queries only."""
    key_name, key_len = keys if keys is not None else ("T", seq_len)
    query_name, queries = ("T", seq_len) if shares is None else ("n", shares.positions.shape[1])
    tensors = (index_q, index_k, index_weights)
    fits = index_q.dim() == 4 and index_q.shape[1] == queries
    if fits:
        batch, _, heads, dim = index_q.shape
        fits = (tuple(index_k.shape) == (batch, key_len, dim)
                and tuple(index_weights.shape) == (batch, queries, heads))
    if not fits or not all(t.is_floating_point() for t in tensors):
        shapes = ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in
                           zip(("index_q", "index_k", "index_weights"), tensors))
        counts = f"T = {seq_len}" + (f", {key_name} = {key_len}" if keys is not None else "")
        if shares is not None:
            counts += f", n = {queries} (this process's share of the queries)"
        raise ValueError(f"{OP}: the indexer takes floating-point index_q [B, {query_name}, HI, "
                         f"DI], index_k [B, {key_name}, DI], index_weights [B, {query_name}, HI]"
                         f" with {counts}; got {shapes}")


def _check_shares(shares: QueryShares | None, seq_len: int):
    if shares is not None and (shares.positions.dim() != 2
                               or shares.positions.numel() != seq_len):
        raise ValueError(f"{OP}: shares.positions has shape {tuple(shares.positions.shape)}; "
                         f"expected [R, n] holding each of the T = {seq_len} queries once")


def _reference_share(q, k, index_q, index_k, index_weights, allowed, sink, scale, reduce_heads,
                     shares: QueryShares):
    """The reference loss's share of this process (:class:`QueryShares`): the target of every
    query over allowed ``[B | 1, T, S]``, reduce-scattered by query rows, and the KL of this
    process's queries."""
    positions = shares.positions.to(q.device)
    with torch.no_grad():
        mass = _masked_probs(q, k, allowed[:, None], sink, scale).sum(1)  # [B, T, S]
        mass = shares.reduce_scatter(mass[:, positions].movedim(1, 0))
    logits = lightning_index_scores(index_q, index_k, index_weights)
    allowed = allowed[:, positions[shares.rank]].expand_as(logits)
    return indexer_kl(mass, logits, allowed, reduce_heads) / (q.shape[0] * q.shape[1])


def dsa_select(index_q, index_k, index_weights, *, top_k, cu_seqlens=None, backend="auto"):
    """DSA (DeepSeek-AI, "DeepSeek-V3.2", arXiv 2512.02556; see ``lightning_index_scores``):
    the ``top_k`` keys of each query among its causal keys (within its own sequence of a pack,
    ``cu_seqlens``, B == 1) by the lightning indexer's score ``sum_j w_tj relu(q_tj . k_s)``.
    index_q ``[B, T, HI, DI]``, index_k ``[B, T, DI]``, index_weights ``[B, T, HI]`` ->
    ``[B, T, min(top_k, T)]`` int32 key positions, in no particular order (ties go to the
    earlier key); a query with fewer causal keys gets all of them and -1 in its other slots.
    No gradient: the choice is discrete."""
    _check_index(index_q, index_k, index_weights, index_q.shape[1])
    if top_k < 1:
        raise ValueError(f"{OP}: DSA's top_k={top_k} must be >= 1")
    if _runs_reference("dsa_select", backend):
        return dsa_select_reference(index_q, index_k, index_weights, top_k=top_k,
                                    cu_seqlens=cu_seqlens)
    return select_keys(index_q, index_k, index_weights, top_k=top_k, cu_seqlens=cu_seqlens)


def dsa_attention(q, k, v, selected, *, sink=None, scale=None, causal=False, backend="auto",
                  return_lse=False):
    """DSA's sparse attention: each query attends to its ``selected [B, T, K]`` keys
    (:func:`dsa_select`; shared by all heads, -1 skipped, each key at most once a row: the
    backends may differ on a key listed twice), with the sink and scale of
    :func:`softmax_attention`. q ``[B, T, Hq, D]``, k, v ``[B, T, Hkv, D]`` -> ``[B, T, Hq, D]``;
    memory O(T K), but O(T^2 / 8) bytes on flex and 2 T^2 on flash. ``causal``: a listed key
    after its query is dropped (:func:`dsa_select` lists none). Backends: the reference;
    cuDNN's fused attention with the selection as a bias (flash.py: "flash", and "auto" on a
    causal selection where it runs and has passed its first-use check, with a bias of up to
    ``CAUSAL_SELECTION_MAX_BIAS`` bytes); FlexAttention over the selection's bitmap ("flex", and
    "auto" on CUDA up to ``SELECTED_FLEX_MAX_KEYS`` keys); triton.py's kernels ("triton", and
    "auto" beyond, where they run); else the gathered form of selected.py.

    ``return_lse``: ``(o, lse)``, lse the log-sum-exp ``[B, T, Hq]`` fp32 of each query head's
    scaled scores over its keys and the sink, without gradient, where the backend that ran
    gives it (cuDNN's), else None; :func:`dsa_indexer_loss` takes it so as not to compute it
    again."""
    check_qkv(OP, q, k, v)
    _check_sink(sink, q)
    _check_selected(selected, q)
    if causal:
        after = torch.arange(q.shape[1], device=selected.device)[None, :, None] < selected
        selected = selected.masked_fill(after, -1)
    lse = None
    name = registry.choose("dsa_attention", backend, _attention_facts(q, k, v, causal=causal))
    if name == "flash":
        out, lse = flash.causal_selection_attention(q, k, v, selected, sink=sink, scale=scale,
                                                    return_lse=True)
    elif name == "reference":
        out = dsa_attention_reference(q, k, v, selected, sink=sink, scale=scale)
    else:
        out = _selected_attention(name, q, k, v, selected, sink, scale)
    return (out, lse) if return_lse else out


def dsa_indexer_loss(q, k, index_q, index_k, index_weights, *, selected=None, cu_seqlens=None,
                     sink=None, scale=None, reduce_heads=None, shares=None, backend="auto",
                     lse=None):
    """The indexer's training loss (arXiv 2512.02556, sec. 2.1), averaged over the B * T
    queries: ``KL(p_t || softmax(I_t))``, p the main attention of q, k (with sink and scale; no
    gradient reaches q, k or the sink) summed over the heads and L1-normalised, I the indexer's
    scores. ``selected=None`` (dense warm-up): over every causal key; else over the selected
    keys only (sparse training; each key at most once a row, as :func:`dsa_attention`).
    ``reduce_heads``: sums a ``[B, T', S']`` tensor over the query heads of other processes
    (tensor parallelism) and returns the sum.

    ``shares`` (:class:`QueryShares`; context parallelism, each process with the whole
    sequence of its own heads in q, k and selected): this process's share of the loss, over its
    queries ``shares.mine``, whose rows alone index_q and index_weights hold
    ``[B, n, ...]``; the target is reduce-scattered from every process's heads (and summed by
    ``reduce_heads`` too, if given). The shares sum to the loss, still divided by B * T.

    ``lse``: :func:`dsa_attention`'s (``return_lse``) for this q, k, ``selected``, sink and
    scale, or None. The sparse stage's target on triton.py's kernels then reuses it rather than
    computing each query head's log-sum-exp again; the other paths compute their own."""
    check_qkv(OP, q, k, k)
    _check_sink(sink, q)
    _check_shares(shares, q.shape[1])
    _check_index(index_q, index_k, index_weights, q.shape[1], shares=shares)
    if _runs_reference("dsa_indexer_loss", backend):
        if shares is not None:
            if selected is None:
                allowed = causal_mask(q.shape[1], cu_seqlens, q.device)[None]
            else:
                allowed = selected_mask(selected, k.shape[1])
            return _reference_share(q, k, index_q, index_k, index_weights, allowed, sink, scale,
                                    reduce_heads, shares)
        return dsa_indexer_loss_reference(q, k, index_q, index_k, index_weights,
                                          selected=selected, cu_seqlens=cu_seqlens, sink=sink,
                                          scale=scale, reduce_heads=reduce_heads)
    return indexer_loss(q, k, index_q, index_k, index_weights, selected=selected,
                        cu_seqlens=cu_seqlens, sink=sink, scale=scale, reduce_heads=reduce_heads,
                        shares=shares,
                        kernels=_loss_kernels("dsa_indexer_loss", backend, q, k, selected, index_q,
                                              index_k), lse=lse)
