"""DeepSeek-V4's compressed attentions, CSA and HCA (DeepSeek-AI, "DeepSeek-V4: Towards Highly
Efficient Million-Token Context Intelligence", arXiv 2606.19348, sec. 2.3), run in PyTorch on
any device; autograd gives the backward.

- :class:`Entries`: where the compressed entries of a batch row (or pack) lie: one per complete
  block of ``rate`` tokens of each sequence, and which queries see them.
- :func:`compress_blocks`: the compression, every entry at once: memory linear in T. Without
  packed sequences the blocks are a view of the tokens (no gather), and on CUDA the arithmetic
  runs through ``torch.compile`` (one fused kernel each way instead of a dozen eager ones that
  each read or write ``[B, N, rate, H, D]`` in fp32); with packed sequences each entry gathers
  its 2 * rate or rate tokens.
- :func:`compressed_layout`: HCA's attention (and CSA's dense warm-up) as a block layout over
  the raw keys followed by the entries, for the gathered or the FlexAttention executor; kept
  per shape where the sequences are not packed (:func:`tiled_compressed_layout`).
- :func:`window_and_selected`: CSA's keys per query, the window's raw tokens and the selected
  entries, as the index list that DSA's per-token gathered attention (selected.py) takes.

Nothing here reads a GPU tensor on the host when the sequences are not packed (``cu_seqlens``
None): the entries are arange's, kept per shape, so a layer's compression and attention never
wait for the GPU.
"""
import functools
import math
from dataclasses import dataclass

import torch

from .flex import compiled_on_cuda
from .layout import BlockLayout, interval_layout
from .reference import keys_with_entries
from .selected import Keys

__all__ = ["Entries", "first_tokens", "compressed_entries", "compress_blocks", "compressed_layout",
           "tiled_compressed_layout", "with_entries", "window_and_selected"]


@dataclass
class Entries:
    """The compressed entries of T tokens, blocks of ``rate`` counted from each sequence's
    start, in order (sequence by sequence, block by block). All ``[N]`` int64 but
    ``first_token [T]``:

    - ``starts``: first token of the entry's own block (``ends = starts + rate - 1`` its last);
    - ``positions``: ``starts`` within its sequence (where RoPE places the entry);
    - ``has_previous``: bool, whether the block before it is in the same sequence;
    - ``first_token``: the first token of each token's sequence.

    ``tiled``: one sequence per batch row (no packing), so that entry i is block i of every row,
    tokens ``i * rate .. (i + 1) * rate - 1``.

    Query t sees entry i iff ``ends[i] <= t`` and ``starts[i] >= first_token[t]``.
    """

    rate: int
    starts: torch.Tensor
    positions: torch.Tensor
    has_previous: torch.Tensor
    first_token: torch.Tensor
    tiled: bool = False

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.rate - 1

    def __len__(self) -> int:
        return self.starts.shape[0]

    def sees(self, b, h, t, i):
        """The visibility rule, elementwise on index tensors (layout.py's convention)."""
        return (self.ends[i] <= t) & (self.starts[i] >= self.first_token[t])

    def first_seen(self, t: torch.Tensor) -> torch.Tensor:
        """The first entry of t's sequence (nondecreasing in t)."""
        return torch.searchsorted(self.starts, self.first_token[t])

    def last_seen(self, t: torch.Tensor) -> torch.Tensor:
        """The last entry complete at t (nondecreasing in t; -1 for none)."""
        return torch.searchsorted(self.ends, t, right=True) - 1

    def keys(self) -> Keys:
        """The entries as the keys an indexer may choose (selected.py)."""
        return Keys(self.sees, lambda end: int(torch.searchsorted(self.ends, end - 1, right=True)))


def first_tokens(seq_len: int, cu_seqlens=None, device=None) -> torch.Tensor:
    """``[T]`` int64: the first token of each token's sequence (0 without ``cu_seqlens``)."""
    if cu_seqlens is None:
        return torch.zeros(seq_len, dtype=torch.int64, device=device)
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    tokens = torch.arange(seq_len, device=device)
    return bounds[torch.searchsorted(bounds[1:], tokens, right=True)]


@functools.lru_cache(maxsize=16)
@torch.inference_mode(False)  # kept tensors must serve training after an inference first use
def _tiled_entries(seq_len: int, rate: int, device: torch.device) -> Entries:
    """The entries of rows that are one sequence each: arange's, kept per shape (nothing to
    read back from the device, nothing to launch again)."""
    starts = torch.arange(0, seq_len // rate * rate, rate, device=device)
    return Entries(rate, starts, starts, starts > 0, first_tokens(seq_len, None, device),
                   tiled=True)


def compressed_entries(seq_len: int, rate: int, cu_seqlens=None, device=None) -> Entries:
    """The :class:`Entries` of T tokens (one sequence, or those packed at ``cu_seqlens``)."""
    if cu_seqlens is None:
        return _tiled_entries(seq_len, rate, torch.device(device) if device is not None
                              else torch.device("cpu"))
    bounds = cu_seqlens.to(device=device, dtype=torch.int64)
    firsts = bounds[:-1]
    counts = (bounds[1:] - firsts) // rate
    sequence = torch.repeat_interleave(torch.arange(counts.shape[0], device=device), counts)
    index = torch.arange(sequence.shape[0], device=device) - (counts.cumsum(0) - counts)[sequence]
    positions = index * rate
    return Entries(rate, firsts[sequence] + positions, positions, index > 0,
                   first_tokens(seq_len, cu_seqlens, device))


def _compress(values, logits, bias, lent_values, lent_logits, lent_bias, has_previous, shift):
    """The compression's arithmetic over blocks ``[B, N, rate, H, D]`` (fp32 softmax over the
    block's slots per channel, the weighted sum): ``values``, ``logits`` of the entry's own block
    (bias ``[rate, H, D]``), and for CSA the previous block's ``lent_*`` (None for HCA), whose
    slots count only where ``has_previous [N]``; with ``shift`` the ``lent_*`` given are those
    of the entry's own block, moved here by one block."""
    logits = logits.float() + bias
    values = values.float()
    if lent_values is not None:
        if shift:  # entry 0 gets the last block's, which has_previous masks out
            lent_values, lent_logits = (torch.roll(x, 1, dims=1)
                                        for x in (lent_values, lent_logits))
        lent = (lent_logits.float() + lent_bias).masked_fill(
            ~has_previous.view(-1, 1, 1, 1), float("-inf"))
        logits = torch.cat([lent, logits], dim=2)
        values = torch.cat([lent_values.float(), values], dim=2)
    return (logits.softmax(2) * values).sum(2)


_compress_body = compiled_on_cuda(_compress, "the KV compression")


def compress_blocks(kv, gate, position_bias, entries: Entries, overlap: bool) -> torch.Tensor:
    """Same contract as ``compress_kv_reference``: ``[B, N, H, D]`` in kv's dtype."""
    dim = kv.shape[-1] // (2 if overlap else 1)
    bias = position_bias.float().transpose(0, 1)  # [rate, H, C]
    rate, count = entries.rate, len(entries)
    if entries.tiled:  # block i of every row: a view
        blocks = [x[:, :count * rate].unflatten(1, (count, rate)) for x in (kv, gate)]
        own = [x[..., -dim:] for x in blocks]
        lent = [x[..., :dim] for x in blocks] if overlap else None
    else:  # one gather per entry
        tokens = entries.starts[:, None] + torch.arange(rate, device=kv.device)  # [N, rate]
        before = (tokens - rate).clamp(min=0)
        own = [x[:, tokens, :, -dim:] for x in (kv, gate)]
        lent = [x[:, before, :, :dim] for x in (kv, gate)] if overlap else None
    lent_part = (*lent, bias[..., :dim]) if overlap else (None, None, None)
    out = _compress_body(*own, bias[..., -dim:], *lent_part, entries.has_previous,
                         entries.tiled)
    return out.to(kv.dtype)


def compressed_layout(entries: Entries, seq_len: int, window: int, q_block: int,
                      kv_block: int):
    """HCA's keys as one block layout over ``padded + N`` keys: the raw tokens (padded with
    zeros to ``padded``, a multiple of kv_block, so that no key block holds both kinds), then
    the entries. Query t sees raw token s when ``t - window < s <= t`` in its sequence, and the
    entries of :meth:`Entries.sees`. Returns ``(layout, padded)``."""
    padded = math.ceil(seq_len / kv_block) * kv_block
    num_entries = len(entries)
    first_token = entries.first_token

    def rule(b, h, t, s):
        entry = (s - padded).clamp(min=0, max=num_entries - 1)
        raw = (s <= t) & (s > t - window) & (s >= first_token[t])
        return raw | ((s >= padded) & entries.sees(b, h, t, entry))

    device = first_token.device
    raw = interval_layout(seq_len, padded, q_block, kv_block, lambda t: t - window + 1,
                          lambda t: t, rule, device)
    compressed = interval_layout(seq_len, num_entries, q_block, kv_block, entries.first_seen,
                                 entries.last_seen, rule, device)
    active = torch.cat([raw.active, compressed.active], dim=-1)
    return BlockLayout(q_block, kv_block, active, rule, dense_columns=True), padded


@functools.lru_cache(maxsize=16)
@torch.inference_mode(False)  # kept tensors must serve training after an inference first use
def tiled_compressed_layout(seq_len: int, rate: int, window: int, q_block: int, kv_block: int,
                            device: torch.device):
    """:func:`compressed_layout` of rows that are one sequence each (no packing), kept: it
    depends on nothing but these arguments, so its host work (and the BlockMasks that
    FlexAttention makes from it, which it keeps) is done once per shape."""
    return compressed_layout(compressed_entries(seq_len, rate, None, device), seq_len, window,
                             q_block, kv_block)


def with_entries(k, v, compressed_k, compressed_v, padded: int | None = None):
    """Raw keys and values (zero-padded to ``padded`` tokens) followed by the entries: one
    concatenation each, the padding a block of zeros in it."""
    if padded is None:
        return keys_with_entries(k, v, compressed_k, compressed_v)
    gap = k.new_zeros(k.shape[0], padded - k.shape[1], *k.shape[2:])
    return tuple(torch.cat([x, gap, entries.to(x.dtype)], dim=1)
                 for x, entries in ((k, compressed_k), (v, compressed_v)))


def window_and_selected(selected: torch.Tensor, first_token: torch.Tensor,
                        window: int) -> torch.Tensor:
    """CSA's keys per query ``[B, T, min(window, T) + K]`` int32 over raw keys followed by the
    entries (:func:`with_entries`): the last ``window`` tokens of its sequence (whose first
    tokens are ``first_token [T]``), then the ``selected [B, T, K]`` entries; -1 for none."""
    batch, seq_len = selected.shape[:2]
    width = min(window, seq_len)
    tokens = torch.arange(seq_len, device=selected.device)[:, None]
    raw = tokens - width + 1 + torch.arange(width, device=selected.device)
    raw = torch.where(raw >= first_token[:, None], raw, -1)
    chosen = torch.where(selected >= 0, selected + seq_len, -1)
    return torch.cat([raw.expand(batch, -1, -1), chosen], dim=-1).int()
