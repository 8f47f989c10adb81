"""The Triton top-k block choice (kernels/sparse/triton_select.py) against
``reference.chosen_blocks``, on CUDA (skipped without a GPU);
tests/ops/test_triton_interpret_select.py runs ``check`` on the CPU under Triton's interpreter.

``check`` draws scores with some blocks barred (-inf) and up to min(k, 2) forced (+inf) per
row, as MoBA's and NSA's selections make them, for block counts that are and are not powers of
two and k from 1 to more than the blocks, and asserts the same chosen set, bit for bit (the
scores are distinct).
It also checks rows of equal finite scores: as many chosen as torch.topk's, the lowest columns.
``check_words`` checks the key-selection bitmap kernel (``selection_words``) the same way, and
the same selection as an attention bias (``selection_bias``).
``check_moba`` checks MoBA's selection in one kernel (``triton_select.moba_chosen``) against
``layout.moba_chosen_pytorch`` on the same device: the same chosen set, bit for bit.
``check_importance`` checks NSA's block-importance kernel (``nsa_importance``) against
``layout.nsa_importance`` in fp32 on the CPU: the same -inf / +inf masks and the finite values to
``IMPORTANCE_TOLERANCE``.
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
    twice, keys at bit 31 and in the last word, rows padded past T; and ``selection_bias`` (0
    on the listed keys, -inf elsewhere, in bf16 and fp32) against ``reference.selected_mask``,
    with keys past its width dropped. Returns how many cases ran."""
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
        for dtype, bias_len in ((torch.bfloat16, key_len), (torch.float32, key_len - 3)):
            listed = reference.selected_mask(selected.masked_fill(selected >= bias_len, -1),
                                             bias_len)
            want = torch.zeros(listed.shape, dtype=dtype).masked_fill(~listed, float("-inf"))
            got = triton_select.selection_bias(selected.to(device), bias_len, dtype).cpu()
            assert torch.equal(got, want), (batch, seq_len, top_k, dtype)
    return len(cases)


# (B, T, Hq, Hkv, D, block_size, top_k)
MOBA_CASES = [
    (2, 300, 4, 4, 16, 32, 3),    # a partial last block
    (1, 200, 4, 2, 24, 8, 5),     # groups of 2 heads, D not a multiple of 16
    (1, 1030, 2, 1, 64, 2, 6),    # 515 blocks (8 warps), groups of 2
    (2, 77, 2, 2, 128, 128, 2),   # one block, shorter than its size
]


def check_moba(device, dtypes=(torch.float32, torch.bfloat16, torch.float16)) -> int:
    """``moba_chosen`` on ``device`` against ``layout.moba_chosen_pytorch`` on the same device and
    the same rounded q and k, per case and dtype; returns how many ran."""
    from megatron_ext.kernels.sparse import layout, triton_select

    generator = torch.Generator().manual_seed(4)
    ran = 0
    for batch, seq_len, heads, kv_heads, dim, block_size, top_k in MOBA_CASES:
        q = torch.randn(batch, seq_len, heads, dim, generator=generator)
        k = torch.randn(batch, seq_len, kv_heads, dim, generator=generator) + 0.5
        for dtype in dtypes:
            q_in, k_in = q.to(device, dtype), k.to(device, dtype)
            means = layout.block_means(k_in, block_size)
            got = triton_select.moba_chosen(q_in, means, block_size, top_k)
            want = layout.moba_chosen_pytorch(q_in, means, block_size, top_k)
            case = (batch, seq_len, heads, kv_heads, dim, block_size, top_k, dtype)
            assert torch.equal(got, want), (case, (got != want).nonzero()[:5])
            # each row: its own block and min(top_k, own + 1) - 1 earlier ones
            own = torch.arange(seq_len, device=device) // block_size
            assert torch.equal(got.sum(-1), (own + 1).clamp(max=top_k).expand_as(got[..., 0]))
            ran += 1
    return ran


# (B, T, Hq, Hkv, D, compress_block, compress_stride, select_block, first query, queries)
IMPORTANCE_CASES = [
    (2, 333, 4, 1, 64, 32, 16, 64, 0, 333),    # odd T, a group of 4 heads, NSA's sizes
    (1, 300, 2, 2, 16, 16, 8, 32, 37, 200),    # a chunk of the queries, no grouping
    (1, 260, 8, 2, 128, 32, 16, 64, 128, 132),  # D = 128, groups of 4, a later chunk
    (2, 20, 2, 1, 16, 32, 16, 32, 0, 20),      # T below a compressed block: none seen
    (1, 1100, 2, 1, 32, 32, 16, 32, 0, 1100),  # more compressed blocks than one step's 64
    (1, 200, 16, 1, 16, 32, 16, 32, 50, 150),  # a group of 16: split over 4 programs, summed
]


def check_importance(device, dtypes=(torch.float32, torch.bfloat16, torch.float16)) -> int:
    """``nsa_importance`` on ``device`` against ``layout.nsa_importance`` (fp32, CPU) on the
    same rounded inputs, per case and dtype; returns how many ran."""
    from megatron_ext.kernels.sparse import layout, triton_select

    generator = torch.Generator().manual_seed(3)
    ran = 0
    for batch, seq_len, heads, kv_heads, dim, block, stride, select, first, count in (
            IMPORTANCE_CASES):
        num_compressed = max(0, (seq_len - block) // stride + 1)
        q = torch.randn(batch, seq_len, heads, dim, generator=generator)
        compressed_k = torch.randn(batch, num_compressed, kv_heads, dim, generator=generator)
        sizes = dict(compress_block=block, compress_stride=stride, select_block=select,
                     num_select=-(-seq_len // select), scale=dim ** -0.5)
        for dtype in dtypes:
            rounded = q.to(dtype), compressed_k.to(dtype)
            got = triton_select.nsa_importance(*(x.to(device) for x in rounded), first, count,
                                               **sizes).cpu()
            want = layout.nsa_importance(*(x.float() for x in rounded), first, count, **sizes)
            finite = torch.isfinite(want)
            case = (batch, seq_len, heads, kv_heads, dim, block, stride, select, first, dtype)
            assert torch.equal(torch.isfinite(got), finite), case
            assert torch.equal(got[~finite], want[~finite]), case
            if finite.any():  # (none where T is below a compressed block: masks only)
                error = (got[finite] - want[finite]).norm() / want[finite].norm()
                assert error <= triton_select.IMPORTANCE_TOLERANCE, (case, error.item())
            ran += 1
    return ran


def test_kernel_equals_the_reference():
    check("cuda")


def test_words_equal_the_reference():
    check_words("cuda")


def test_moba_selection_equals_the_pytorch_form():
    from megatron_ext.kernels.sparse import triton_select

    check_moba("cuda")
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert triton_select.moba_checked(torch.device("cuda"), dtype)


def test_importance_equals_the_reference():
    check_importance("cuda")
