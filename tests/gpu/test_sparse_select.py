"""The Triton top-k block choice (kernels/sparse/triton_select.py) against
``reference.chosen_blocks``, on CUDA (skipped without a GPU);
tests/cpu/test_triton_interpret_select.py runs ``check`` on the CPU under Triton's interpreter.

``check`` draws scores with some blocks barred (-inf) and up to min(k, 2) forced (+inf) per
row, as MoBA's and NSA's selections make them, for block counts that are and are not powers of
two and k from 1 to more than the blocks, and asserts the same chosen set, bit for bit (the
scores are distinct).
It also checks rows of equal finite scores: as many chosen as torch.topk's, the lowest columns.
``check_words`` checks the key-selection bitmap kernel (``selection_words``) the same way.
"""
import pytest
import torch

from megatron_ext.kernels.sparse import reference

pytestmark = pytest.mark.gpu

CASES = [(1, 1), (7, 3), (32, 3), (33, 2), (256, 16), (300, 16), (1024, 5), (5, 9)]  # (n, k)


def check(device) -> int:
    """The kernel against the reference on ``device``; returns how many cases ran."""
    from megatron_ext.kernels.sparse import triton_select

    generator = torch.Generator().manual_seed(0)
    for n, top_k in CASES:
        scores = torch.randn(3, 37, n, generator=generator)
        scores[torch.rand(3, 37, n, generator=generator) < 0.2] = float("-inf")
        # at most k forced blocks a row (as MoBA's own block, NSA's first, own and previous)
        for i in range(min(top_k, 2)):
            forced = torch.randint(0, n, (3, 37, 1), generator=generator)
            scores.scatter_(-1, forced, float("inf"))
        scores = scores.to(device)
        got = triton_select.chosen_blocks(scores, top_k)
        want = reference.chosen_blocks(scores, top_k)
        assert torch.equal(got, want), (n, top_k, (got != want).nonzero()[:5])
    ties = torch.zeros(4, 9, device=device)
    ties[:, 0] = float("-inf")
    got = triton_select.chosen_blocks(ties, 3)
    assert torch.equal(got.sum(-1), reference.chosen_blocks(ties, 3).sum(-1))
    assert got[:, 1:4].all() and not got[:, 4:].any() and not got[:, 0].any()
    return len(CASES) + 1


def check_words(device) -> int:
    """``selection_words`` (DSA's and CSA's bitmap, an atomic OR per listed key) against
    ``layout.selection_words_reference``, bit for bit: -1 slots, a row of only -1, a key listed
    twice, keys at bit 31 and in the last word, rows padded past T; and the layout made with
    it against the one made without. Returns how many cases ran."""
    from megatron_ext.kernels.sparse import layout, triton_select

    generator = torch.Generator().manual_seed(2)
    cases = [(2, 37, 6, 45, 48, 2), (1, 70, 300, 64, 128, 2), (3, 5, 1, 31, 5, 1)]
    for batch, seq_len, top_k, key_len, rows, width in cases:
        selected = torch.randint(-1, key_len, (batch, seq_len, top_k), generator=generator)
        selected[:, 0] = -1
        selected[:, -1, 0] = 31
        selected[:, -1, -1] = key_len - 1
        if top_k > 1:
            selected[:, 1, 1] = selected[:, 1, 0]
        selected = selected.int()
        want = layout.selection_words_reference(selected, rows, width)
        got = triton_select.selection_words(selected.to(device), rows, width).cpu()
        assert torch.equal(got, want), (batch, seq_len, top_k, (got != want).nonzero()[:5])
    return len(cases)


def test_kernel_equals_the_reference():
    check("cuda")


def test_words_equal_the_reference():
    check_words("cuda")
