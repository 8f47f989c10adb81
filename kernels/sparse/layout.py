"""Block layouts: which key blocks each query block visits, and the exact rule inside them.

Every sparse attention of this package is described once, as a :class:`BlockLayout`, and run by
either executor: ``gathered.py`` (PyTorch, any device) or ``flex.py`` (FlexAttention). The
layout is a coarse bool matrix over (query block, key block) pairs, so that whole blocks of
keys are skipped, plus a token rule ``mask_mod(b, h, q_idx, kv_idx) -> bool`` in FlexAttention's
convention (h a query head), which decides inside the visited blocks. A rule is written with
elementwise tensor operations only, so that it serves FlexAttention, which calls it on scalars,
and the gathered executor, which calls it on broadcast index tensors.

Also here: the discrete selections (MoBA's and NSA's top-k blocks, computed without gradient
and by chunks of queries, never as a ``[T, T]`` matrix) and NSA's compression.
"""
import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from .. import registry
from . import reference

__all__ = [
    "BlockLayout", "interval_layout", "selection_layout", "key_selection_layout", "window_rule",
    "window_span", "document_rule", "allowed_rule", "both", "block_means", "moba_chosen",
    "moba_chosen_pytorch", "compress", "nsa_chosen", "nsa_importance",
]

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# Queries per step when a selection scores them (a [B, H, chunk, blocks] matrix at a time).
SELECTION_CHUNK = 4096

def _select_kernels():
    """triton_select.py (imported on first use, so that this module imports without Triton)."""
    from . import triton_select

    return triton_select


def _kernel(name: str):
    def run(*args, **kwargs):
        return getattr(_select_kernels(), name)(*args, **kwargs)

    run.__name__ = run.__qualname__ = name
    return run


def _select_refusal(facts: registry.Facts) -> str | None:
    """Why triton_select.py's kernels cannot take the call, or None: Triton imports, at most
    MAX_BLOCKS blocks (``extra["blocks"]``), fp32 scores (``extra["scores"]``), dense rows of
    q (``extra["dense_rows"]``)."""
    try:
        kernels = _select_kernels()
    except ImportError as error:
        return f"Triton does not import here ({error})"
    extra = facts.extra
    if extra.get("scores") and facts.dtype != torch.float32:
        return f"scores in {facts.dtype} (the kernel takes fp32)"
    if extra.get("blocks", 0) > kernels.MAX_BLOCKS:
        return f"{extra['blocks']} blocks (the kernel takes at most {kernels.MAX_BLOCKS})"
    if extra.get("dense_rows") is False:
        return "q whose rows are not dense (the kernel reads q's [H, D] rows as one block)"
    return None


def _selection_verified(check: str):
    def verify(facts: registry.Facts) -> str | None:
        passed = getattr(_select_kernels(), check)(facts.device, facts.dtype)
        return None if passed else "failed its first-use check on this device in this dtype"
    return verify


def _declare_selection(name: str, pytorch, kernel: str, check: str | None = None) -> None:
    """Declare a selection kernel of triton_select.py beside its PyTorch form: "auto" runs the
    kernel on CUDA (tests add the CPU under Triton's interpreter) where it takes the call and,
    with ``check``, has passed that first-use check; the PyTorch form elsewhere."""
    registry.declare(registry.Op(
        name,
        backends={"pytorch": registry.Backend("pytorch", pytorch),
                  "triton": registry.Backend("triton", _kernel(kernel), unsupported=_select_refusal,
                                             verify=None if check is None else _selection_verified(check),
                                             auto_devices=("cuda",))},
        auto=("triton", "pytorch"),
        facts=lambda x, *args, **options: registry.Facts(device=x.device, dtype=x.dtype),
    ))


# The ops of the selection kernels (declared below, next to their PyTorch forms).
SELECTION_OPS = ("block_choice", "selection_words", "moba_selection", "nsa_selection")


def _runs_kernel(op: str, x: torch.Tensor, **extra) -> bool:
    """Whether "auto" runs the selection kernel of ``op`` on x's device and dtype."""
    facts = registry.Facts(device=x.device, dtype=x.dtype, extra=extra)
    return registry.choose(op, registry.AUTO, facts) == "triton"


def chosen_blocks(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """:func:`reference.chosen_blocks`, in Triton (triton_select.py) where "auto" runs it (CUDA;
    fp32 scores of at most its MAX_BLOCKS blocks)."""
    if _runs_kernel("block_choice", scores, scores=True, blocks=scores.shape[-1]):
        return _select_kernels().chosen_blocks(scores, top_k)
    return reference.chosen_blocks(scores, top_k)


_declare_selection("block_choice", reference.chosen_blocks, "chosen_blocks")


@dataclass
class BlockLayout:
    """``active``: bool ``[B | 1, Hm, Tq / q_block, S / kv_block]`` (blocks rounded up), Hm one
    of 1, the key/value heads or the query heads; ``mask_mod``: the token rule;
    ``dense_columns``: whether a few key blocks, visited by (nearly) every query block, hold a
    large share of the work (compressed keys, HCA's entries), which decides how flex.py runs
    grouped key/value heads; ``block_masks``: the FlexAttention BlockMasks made from it
    (flex.py), by heads and lengths."""

    q_block: int
    kv_block: int
    active: torch.Tensor
    mask_mod: MaskMod
    dense_columns: bool = False
    block_masks: dict = field(default_factory=dict, repr=False, compare=False)

    def kv_blocks(self, active: torch.Tensor | None = None):
        """FlexAttention's form of ``active`` (or of a broadcast of it): the number of visited
        key blocks ``[..., nq]`` and their indices first ``[..., nq, nk]``, both int32."""
        active = self.active if active is None else active
        order = torch.argsort(active.to(torch.int8), dim=-1, descending=True, stable=True)
        return active.sum(-1, dtype=torch.int32), order.to(torch.int32)


def both(first: MaskMod, second: MaskMod) -> MaskMod:
    return lambda b, h, q, kv: first(b, h, q, kv) & second(b, h, q, kv)


def _window_bounds(causal: bool, window) -> tuple[int, int]:
    left, right = window if window is not None else (-1, -1)
    return left, 0 if causal else right


def window_rule(causal: bool, window) -> MaskMod:
    """Causal and/or sliding window ``(left, right)`` (-1: unbounded)."""
    left, right = _window_bounds(causal, window)

    def rule(b, h, q, kv):
        ok = kv >= 0
        if left >= 0:
            ok = ok & (kv >= q - left)
        if right >= 0:
            ok = ok & (kv <= q + right)
        return ok

    return rule


def window_span(causal: bool, window):
    """``first_key(t), last_key(t)`` of :func:`window_rule`, for :func:`interval_layout`."""
    left, right = _window_bounds(causal, window)
    first = (lambda t: t - left) if left >= 0 else torch.zeros_like
    last = (lambda t: t + right) if right >= 0 else (lambda t: torch.full_like(t, 1 << 62))
    return first, last


def document_rule(cu_seqlens: torch.Tensor, total: int) -> MaskMod:
    """Query and key in the same of the sequences packed along T."""
    positions = torch.arange(total, device=cu_seqlens.device)
    ids = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    return lambda b, h, q, kv: ids[q] == ids[kv]


def allowed_rule(allowed: torch.Tensor) -> MaskMod:
    """A dense bool mask ``[B, Hq | 1, T, S]`` (broadcast already to the batch)."""
    if allowed.shape[1] == 1:
        return lambda b, h, q, kv: allowed[b, 0, q, kv]
    return lambda b, h, q, kv: allowed[b, h, q, kv]


def interval_layout(seq_len: int, key_len: int, q_block: int, kv_block: int, first_key, last_key,
                    mask_mod: MaskMod, device, dense_columns: bool = False) -> BlockLayout:
    """The layout of a rule under which query t sees only keys ``first_key(t) .. last_key(t)``,
    both nondecreasing in t (causal, sliding window, NSA's compressed keys): a key block is
    visited when it meets the span of some query of the block."""
    q_start = torch.arange(0, seq_len, q_block, device=device)
    q_end = (q_start + q_block).clamp(max=seq_len) - 1
    kv_start = torch.arange(0, key_len, kv_block, device=device)
    kv_end = (kv_start + kv_block).clamp(max=key_len) - 1
    active = ((kv_start[None, :] <= last_key(q_end)[:, None])
              & (kv_end[None, :] >= first_key(q_start)[:, None]))
    return BlockLayout(q_block, kv_block, active[None, None], mask_mod, dense_columns)


def selection_layout(chosen: torch.Tensor, select_block: int, key_len: int, q_block: int,
                     kv_block: int, mask_mod: MaskMod) -> BlockLayout:
    """The layout of a per-token block selection ``chosen [B, H, T, n]`` (bool, blocks of
    ``select_block`` keys): a key block is visited when a query of the block chose a selection
    block that overlaps it."""
    batch, heads, seq_len, num_select = chosen.shape
    num_q = math.ceil(seq_len / q_block)
    padded = F.pad(chosen, (0, 0, 0, num_q * q_block - seq_len))
    per_q_block = padded.view(batch, heads, num_q, q_block, num_select).any(3)
    select_start = torch.arange(num_select, device=chosen.device) * select_block
    select_end = (select_start + select_block).clamp(max=key_len) - 1
    kv_start = torch.arange(0, key_len, kv_block, device=chosen.device)
    kv_end = (kv_start + kv_block).clamp(max=key_len) - 1
    overlap = ((select_start[:, None] <= kv_end[None, :])
               & (select_end[:, None] >= kv_start[None, :]))  # [n, nk]
    active = (per_q_block.float() @ overlap.float()) > 0
    return BlockLayout(q_block, kv_block, active, mask_mod)


# Query rows (times the padded keys) whose bool ``selection_words_reference`` holds at a time.
_BITS_CHUNK_VALUES = 2**26


def selection_words_reference(selected: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``triton_select.selection_words`` in PyTorch: int32 ``[B, rows, width]``, bit ``s % 32``
    of word ``s // 32`` of row t set where row t of ``selected [B, T, K]`` lists key s (-1:
    none); ``reference.selected_mask`` per chunk of rows, packed."""
    batch, seq_len, _ = selected.shape
    cols = 32 * width
    words = torch.zeros(batch, rows, width, dtype=torch.int32, device=selected.device)
    weights = torch.ones(32, dtype=torch.int32, device=selected.device) << torch.arange(
        32, dtype=torch.int32, device=selected.device)
    step = max(1, _BITS_CHUNK_VALUES // max(1, batch * cols))
    for start in range(0, seq_len, step):
        end = min(start + step, seq_len)
        listed = reference.selected_mask(selected[:, start:end], cols)
        packed = listed.view(batch, end - start, width, 32).int() * weights
        words[:, start:end] = packed.sum(-1, dtype=torch.int32)  # distinct bits: sum = OR
    return words


@torch.no_grad()
def key_selection_layout(selected: torch.Tensor, key_len: int, q_block: int,
                         kv_block: int) -> BlockLayout:
    """The layout of a per-token key selection ``selected [B, T, K]`` (DSA's and CSA's: key
    positions shared by every head, -1 for none): the token rule reads one bit per (query, key)
    from a bitmap made of int32 words ``[B, T', S' / 32]`` (T and S rounded up to the blocks, and
    ``kv_block`` a multiple of 32), and a key block is visited when a query of the block listed
    one of its keys. A key listed twice counts once, as in the reference's mask. The bitmap is
    made by triton_select.py's kernel where "auto" runs it (``selection_words``), else in PyTorch.

    The bitmap is the one part of this attention's memory that grows as T S: an eighth of a
    byte per pair (256 MB at B T = 32768 and S = 65536), against the gathered kernels' O(T K)."""
    if kv_block % 32:
        raise ValueError(f"{reference.OP}: a key selection's layout takes key blocks of a "
                         f"multiple of 32 keys (one bitmap word each); got {kv_block}")
    batch, seq_len, _ = selected.shape
    num_q, num_kv = math.ceil(seq_len / q_block), math.ceil(key_len / kv_block)
    shape = (num_q * q_block, num_kv * kv_block // 32)
    if _runs_kernel("selection_words", selected):
        words = _select_kernels().selection_words(selected, *shape)
    else:
        words = selection_words_reference(selected, *shape)
    active = (words.view(batch, num_q, q_block, num_kv, kv_block // 32) != 0).any(-1).any(2)
    # The rule reads bytes: byte s // 8 of a row holds bit s % 8 (int32 words are little-endian
    # on x86-64 and aarch64, the platforms this package targets). FlexAttention loads the
    # rule's word for every (query, key) of a tile and pipelines those loads through shared
    # memory: reading int32 words, its bf16 kernel at head dim 64 (128 x 128 tiles, 3 stages)
    # asks for 240 KB of the H200's 227 KB; bytes take a quarter of the room.
    bits = words.view(torch.uint8)

    def rule(b, h, q, kv):
        return ((bits[b, q, kv // 8].to(torch.int32) >> (kv % 8)) & 1) == 1

    return BlockLayout(q_block, kv_block, active[:, None], rule)


@torch.no_grad()
@functools.lru_cache(maxsize=8)
def _block_lengths(seq_len: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The tokens of each block, ``[n, 1]`` fp32 (cached: one small launch fewer a call)."""
    starts = torch.arange(0, seq_len, block_size, device=device)
    return (seq_len - starts).clamp(max=block_size).float()[:, None]


@torch.no_grad()
def block_means(k: torch.Tensor, block_size: int) -> torch.Tensor:
    """The means of k ``[B, T, Hkv, D]`` over blocks of ``block_size`` tokens (the last one
    partial): ``[B, Hkv, n, D]`` fp32 (contiguous), summed in fp32 from k's own dtype (no fp32
    copy of k); no gradient (MoBA's selection has none)."""
    batch, seq_len, kv_heads, dim = k.shape
    num_blocks = math.ceil(seq_len / block_size)
    full = seq_len // block_size
    sums = k[:, :full * block_size].unflatten(1, (full, block_size)).sum(2, dtype=torch.float32)
    if full < num_blocks:
        last = k[:, full * block_size:].sum(1, keepdim=True, dtype=torch.float32)
        sums = torch.cat([sums, last], 1)
    means = torch.empty(batch, kv_heads, num_blocks, dim, dtype=torch.float32, device=k.device)
    return torch.div(sums.transpose(1, 2), _block_lengths(seq_len, block_size, k.device),
                     out=means)


@torch.no_grad()
def moba_chosen(q: torch.Tensor, k: torch.Tensor, block_size: int, top_k: int) -> torch.Tensor:
    """MoBA's selection ``[B, Hq, T, n]``: per query and head, its own block and the
    ``top_k - 1`` finished blocks of highest ``q . mean(K_block)``, in one Triton kernel
    (triton_select.moba_chosen) where "auto" runs it (``moba_selection``: CUDA, dense rows of q,
    at most MAX_BLOCKS blocks, its first-use check passed), else in PyTorch
    (:func:`moba_chosen_pytorch`)."""
    means = block_means(k, block_size)  # [B, Hkv, n, D]
    if _runs_kernel("moba_selection", q, blocks=means.shape[2],
                    dense_rows=q.stride(-1) == 1 and q.stride(-2) == q.shape[-1]):
        return _select_kernels().moba_chosen(q, means, block_size, top_k)
    return moba_chosen_pytorch(q, means, block_size, top_k)


@torch.no_grad()
def moba_chosen_pytorch(q: torch.Tensor, means: torch.Tensor, block_size: int,
                        top_k: int) -> torch.Tensor:
    """:func:`moba_chosen` from q and the fp32 block means ``[B, Hkv, n, D]``, in PyTorch by
    chunks of queries: the gates in fp32, masked, then :func:`chosen_blocks`."""
    batch, seq_len, heads, _ = q.shape
    num_blocks = means.shape[2]
    means = means.repeat_interleave(heads // means.shape[1], dim=1)  # [B, Hq, n, D]
    blocks = torch.arange(num_blocks, device=q.device)
    chosen = torch.empty(batch, heads, seq_len, num_blocks, dtype=torch.bool, device=q.device)
    for start in range(0, seq_len, SELECTION_CHUNK):
        end = min(start + SELECTION_CHUNK, seq_len)
        # q's rows in fp32, head-major, in one copy (bmm's layout)
        rows = q[:, start:end].transpose(1, 2).to(torch.float32,
                                                  memory_format=torch.contiguous_format)
        gate = rows @ means.transpose(-1, -2)
        own = torch.arange(start, end, device=q.device)[:, None] // block_size
        gate.masked_fill_(blocks > own, float("-inf")).masked_fill_(blocks == own, float("inf"))
        chosen[:, :, start:end] = chosen_blocks(gate, top_k)
    return chosen


def compress(x: torch.Tensor, weights: torch.Tensor, block: int, stride: int) -> torch.Tensor:
    """NSA's compressed tokens (see ``compress_reference``), from strided windows of x:
    ``[B, T, H, D]`` -> ``[B, N, H, D]`` in x's dtype."""
    batch, seq_len, heads, dim = x.shape
    if seq_len < block:
        return x.new_zeros(batch, 0, heads, dim)
    windows = x.unfold(1, block, stride)  # [B, N, H, D, block], a view
    return torch.einsum("bnhdp,hp->bnhd", windows, weights.to(x.dtype))


@torch.no_grad()
def nsa_chosen(q: torch.Tensor, compressed_k: torch.Tensor, *, compress_block: int,
               compress_stride: int, select_block: int, select_top_k: int,
               scale: float) -> torch.Tensor:
    """NSA's selection ``[B, Hkv, T, n]`` (see ``nsa_attention_reference``), from the
    compressed branch's probabilities, by chunks of queries: the importance of each selection
    block in one Triton kernel (triton_select.nsa_importance) where "auto" runs it
    (``nsa_selection``: CUDA, its first-use check passed), else in PyTorch
    (:func:`nsa_importance`)."""
    batch, seq_len = q.shape[:2]
    kv_heads = compressed_k.shape[2]
    num_select = math.ceil(seq_len / select_block)
    sizes = dict(compress_block=compress_block, compress_stride=compress_stride,
                 select_block=select_block, num_select=num_select, scale=scale)
    importance_of = nsa_importance
    if _runs_kernel("nsa_selection", q):
        importance_of = _select_kernels().nsa_importance
    chosen = torch.empty(batch, kv_heads, seq_len, num_select, dtype=torch.bool, device=q.device)
    for start in range(0, seq_len, SELECTION_CHUNK):
        count = min(SELECTION_CHUNK, seq_len - start)
        importance = importance_of(q, compressed_k, start, count, **sizes)
        chosen[:, :, start:start + count] = chosen_blocks(importance, select_top_k)
    return chosen


@torch.no_grad()
def nsa_importance(q: torch.Tensor, compressed_k: torch.Tensor, first: int, count: int, *,
                   compress_block: int, compress_stride: int, select_block: int,
                   num_select: int, scale: float) -> torch.Tensor:
    """``[B, Hkv, count, n]`` fp32: NSA's importance of the selection blocks for the queries
    ``first .. first + count - 1``, in PyTorch (fp32): the compressed branch's probabilities
    (no sink), each compressed block's spread over the selection blocks it overlaps by the
    share of its tokens in them, summed over the query heads of a key/value group; -inf for
    the blocks after a query's own, +inf for the first, the own and the previous block."""
    heads = q.shape[2]
    num_compressed, kv_heads = compressed_k.shape[1], compressed_k.shape[2]
    starts = torch.arange(num_compressed, device=q.device) * compress_stride
    ends = starts + compress_block - 1
    select_start = torch.arange(num_select, device=q.device) * select_block
    # share[i, j]: the fraction of compressed block i's tokens that lie in selection block j.
    share = (torch.minimum(ends[:, None] + 1, select_start[None, :] + select_block)
             - torch.maximum(starts[:, None], select_start[None, :])).clamp(min=0) / compress_block
    keys = compressed_k.float().repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    positions = torch.arange(first, first + count, device=q.device)[:, None]
    visible = ends[None, :] <= positions
    scores = q[:, first:first + count].float().transpose(1, 2) @ keys.transpose(-1, -2) * scale
    probs = scores.masked_fill(~visible, torch.finfo(torch.float32).min).softmax(-1) * visible
    importance = (probs @ share).unflatten(1, (kv_heads, -1)).sum(2)  # [B, Hkv, count, n]
    blocks = torch.arange(num_select, device=q.device)
    own = positions // select_block
    must = (blocks == 0) | (blocks == own) | (blocks == own - 1)
    importance = importance.masked_fill(blocks > own, float("-inf"))
    return importance.masked_fill(must & (blocks <= own), float("inf"))


_declare_selection("selection_words", selection_words_reference, "selection_words")
_declare_selection("moba_selection", moba_chosen_pytorch, "moba_chosen", check="moba_checked")
_declare_selection("nsa_selection", nsa_importance, "nsa_importance", check="importance_checked")
