"""Two selection kernels: the top-k block choice of MoBA and NSA (``reference.chosen_blocks``),
and the bitmap of DSA's and CSA's per-token key selection (:func:`selection_words`).

``chosen_blocks(scores [..., n], top_k)`` marks, per row, the ``top_k`` highest-scoring blocks,
``-inf`` marking a block that cannot be chosen and ``+inf`` one that must be. In PyTorch that is
a top-k (radix selection per row), a zero tensor and a scatter: on an H200 (session 12) the
top-k alone took 0.87 ms of MoBA's fwd+bwd at T = 16384 (32 blocks, k = 3) and 7.2 ms of NSA's
(256 blocks, k = 16). Here one program holds BLOCK_R rows of scores in registers and takes the
row's largest score k times (the first column holding it, then set to -inf), marking it chosen
unless it is -inf; it writes the bool rows once.

The chosen set equals torch.topk's wherever a row's scores are distinct (and every +inf is
chosen while there are at most k of them). Where equal finite scores compete for the last
places, this takes the lowest column; torch.topk does not say which it takes. Rows of up to
MAX_BLOCKS blocks (n is padded to a power of two in registers); CUDA tensors, or CPU tensors
under Triton's interpreter (tests/cpu/test_triton_interpret_select.py).

:func:`selection_words` sets bit ``s % 32`` of word ``s // 32`` of row t for each key s listed in
row t of ``selected [B, T, K]``, one program per row and an atomic OR per listed key: the same
words as ``layout.selection_words_reference`` (a bool ``[B, c, S]`` per chunk of rows, packed),
which took 10.4 ms at B T = 32768, K = 2048, S = 16384 on an H200 (session 13).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["chosen_blocks", "selection_words", "MAX_BLOCKS"]

MAX_BLOCKS = 1024
ROW_ELEMENTS = 4096  # rows per program x n rounded up to a power of two


@triton.jit
def _choose_kernel(scores, chosen, rows, n, top_k, BLOCK_R: tl.constexpr, NP: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    j = tl.arange(0, NP)
    live = (r < rows)[:, None] & (j < n)[None, :]
    at = r.to(tl.int64)[:, None] * n + j[None, :]
    x = tl.load(scores + at, mask=live, other=float("-inf"))
    picked = tl.zeros([BLOCK_R, NP], dtype=tl.int1)
    for _ in range(0, top_k):
        best = tl.max(x, 1)
        first = tl.min(tl.where(x == best[:, None], j[None, :], NP), 1)
        hit = j[None, :] == first[:, None]
        picked = picked | (hit & (best > float("-inf"))[:, None])
        x = tl.where(hit, float("-inf"), x)
    tl.store(chosen + at, picked.to(tl.int8), mask=live)


def chosen_blocks(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``reference.chosen_blocks`` for fp32 ``scores [..., n]`` (n <= MAX_BLOCKS)."""
    if scores.dtype != torch.float32 or not 0 < scores.shape[-1] <= MAX_BLOCKS:
        raise ValueError(f"triton select: needs fp32 scores of 1 to {MAX_BLOCKS} blocks, got "
                         f"{scores.dtype} {tuple(scores.shape)}")
    n = scores.shape[-1]
    flat = scores.reshape(-1, n).contiguous()
    chosen = torch.empty(flat.shape, dtype=torch.bool, device=scores.device)
    padded = triton.next_power_of_2(n)
    block = max(1, ROW_ELEMENTS // padded)
    if flat.shape[0]:
        _choose_kernel[(triton.cdiv(flat.shape[0], block),)](
            flat, chosen.view(torch.int8), flat.shape[0], n, min(top_k, n), BLOCK_R=block,
            NP=padded, num_warps=4)
    return chosen.view(scores.shape)


@triton.jit
def _words_kernel(selected, words, seq_len, top_k, rows, width, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # over B T
    target = words + ((row // seq_len) * rows + row % seq_len) * width
    for start in range(0, top_k, BLOCK_K):
        j = start + tl.arange(0, BLOCK_K)
        key = tl.load(selected + row * top_k + j, mask=j < top_k, other=-1).to(tl.int32)
        tl.atomic_or(target + (key >> 5), (1 << (key & 31)), mask=key >= 0, sem="relaxed")


def selection_words(selected: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """int32 ``[B, rows, width]`` (rows >= T, 32 width >= every listed key): bit ``s % 32`` of
    word ``s // 32`` of row t set where row t of ``selected [B, T, K]`` lists key s (-1: none)."""
    batch, seq_len, top_k = selected.shape
    words = torch.zeros(batch, rows, width, dtype=torch.int32, device=selected.device)
    if selected.numel():
        _words_kernel[(batch * seq_len,)](selected.contiguous(), words, seq_len, top_k, rows,
                                          width, BLOCK_K=256, num_warps=4)
    return words
