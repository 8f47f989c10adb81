"""The Triton kernels of a block selection (kernels/sparse/triton_merge.py: the plan of its
pairs, the merge of its two calls, the gathers of rows, the sum of the chunks' key gradients)
on Triton's CPU interpreter, inside flash.py's MoBA and block selection with the
FlashAttention and cuDNN kernels emulated (flash_emulation.py), forward and backward, against
the fp32 reference; skipped where Triton is not installed.

Run as a script under TRITON_INTERPRET=1 (triton_interpreter.run_as_script, one process per CPU,
each taking its share of the cases), every load and store checked to stay inside the tensors of
its launch: the plan of a small example, value by value, and of random selections against the
PyTorch plan; test_sparse_flash_emulated.py's MoBA calls (a partial last block, every earlier
block chosen, the own block only: no pairs at all, four query heads on one key/value head, one
partial block) and its block selections per query head and per key/value head (G = 2 query heads
per row), with and without a sink; the same calls with the earlier blocks on cuDNN (emulated) in
chunks of 4 and of 64 slots; and the row gather alone (rows wider than a chunk of columns,
repeated rows, no rows, -1 rows, 2 and 3 tensors at once), on that file's fp64 inputs and its
1e-6 relative tolerance (the kernels sum in fp32: ~1e-7). The same calls with the PyTorch merge
and plan are that file's tests; the kernels on a GPU, in bf16 and with the real FlashAttention
and cuDNN kernels, are tests/ops/test_sparse_flash.py's.
"""
import functools
import types

import torch
import triton_interpreter
from triton_interpreter import needs_triton


def check_plan_example(flash, example) -> None:
    """triton_merge.plan_pairs's plan of test_sparse_flash_emulated.py's example, B = 1, 2
    selection heads on 2 key/value heads, T = 5 in blocks of 2, top 3: the lists have room for
    every pair top_k allows (a token of block i: min(top_k - 1, i)), -1 past ``pairs_cu[-1]``,
    and ``pairs_of_row`` names each row's pairs; in chunks (of 2), each (batch, key/value head,
    block) sequence's pairs fill chunks from its first on, -1 in the slots no pair fills,
    ``pairs_of_row`` names slots, ``key_rows`` each chunk's block's keys (token-major; block 0's
    in the chunks past the last)."""
    plan = flash._selection_plan(example, block_size=2, top_k=3, kv_heads=2)
    # room: 2 heads x (tokens 2, 3: 1 each; token 4: 2) = 8 pairs, 3 of them chosen:
    # (head 0, block 0): token 4; (head 1, block 0): token 3; (head 1, block 1): token 4
    assert plan.rows.tolist() == [4 * 2 + 0, 3 * 2 + 1, 4 * 2 + 1] + [-1] * 5
    assert plan.pairs_cu.tolist() == [0, 1, 1, 1, 2, 3, 3]
    want = torch.full((10, 2), -1, dtype=torch.int32)
    want[8, 0], want[7, 0], want[9, 0] = 0, 1, 2
    assert torch.equal(plan.pairs_of_row, want)
    chunk = flash.CUDNN_CHUNK
    flash.CUDNN_CHUNK = 2
    plan = flash._selection_plan(example, block_size=2, top_k=3, kv_heads=2, earlier_on_cudnn=True)
    flash.CUDNN_CHUNK = chunk
    # one chunk each for sequences (g, j) = (0, 0), (1, 0), (1, 1); room: 8 pairs / 2 + 6
    assert plan.chunk == 2 and plan.chunks == 10
    assert plan.chunk_cu.tolist() == [0, 1, 1, 1, 2, 3, 3]
    assert plan.rows.tolist() == [4 * 2 + 0, -1, 3 * 2 + 1, -1, 4 * 2 + 1, -1] + [-1] * 14
    want[8, 0], want[7, 0], want[9, 0] = 0, 2, 4
    assert torch.equal(plan.pairs_of_row, want)
    # keys (token, key/value head) as rows t * 2 + g: block 0 of head 0 = rows 0, 2; of head
    # 1 = rows 1, 3; block 1 of head 1 = rows 5, 7
    assert plan.key_rows.tolist() == [0, 2, 1, 3, 5, 7] + [0, 2] * 7


def check_plan_against_pytorch(flash, seed, batch, heads, kv_heads, seq_len, block_size,
                               top_k) -> None:
    """triton_merge.plan_pairs's plan of a random selection lists the PyTorch plan's pairs in
    its order (sequences' bounds and rows), and each row's pairs in block order; in chunks of 3,
    each sequence's pairs in order from its first chunk."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = -(-seq_len // block_size)
    own = torch.arange(seq_len) // block_size
    scores = torch.rand(batch, heads, seq_len, num_blocks, generator=generator)
    scores[..., torch.arange(seq_len), own] = 2.0  # the own block first
    scores = scores.masked_fill(torch.arange(num_blocks) > own[:, None], -1.0)
    top = scores.topk(min(top_k, num_blocks), dim=-1).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)
    chosen &= torch.arange(num_blocks) <= own[:, None]
    flash.MERGE_DEVICE_TYPES.discard("cpu")
    want = flash._selection_plan(chosen, block_size, top_k, kv_heads)
    flash.MERGE_DEVICE_TYPES.add("cpu")
    plan = flash._selection_plan(chosen, block_size, top_k, kv_heads)
    total = want.rows.numel()
    assert torch.equal(plan.pairs_cu, want.pairs_cu)
    assert torch.equal(plan.rows[:total], want.rows) and (plan.rows[total:] == -1).all()
    earlier = chosen & (torch.arange(num_blocks) < own[:, None])
    per_row = earlier.permute(0, 2, 1, 3).reshape(-1, num_blocks).sum(1)
    listed = plan.pairs_of_row >= 0
    assert torch.equal(listed.sum(1), per_row)
    assert torch.equal(plan.rows[plan.pairs_of_row[listed].long()],
                       listed.nonzero()[:, 0])  # each listed pair is its row's
    order = plan.pairs_of_row.masked_fill(~listed, 2**30)
    assert (order[:, 1:] >= order[:, :-1]).all()  # in block (= sequence) order
    chunk = flash.CUDNN_CHUNK
    flash.CUDNN_CHUNK = 3
    chunked = flash._selection_plan(chosen, block_size, top_k, kv_heads, earlier_on_cudnn=True)
    flash.CUDNN_CHUNK = chunk
    counts = (want.pairs_cu[1:] - want.pairs_cu[:-1]).tolist()
    for s, count in enumerate(counts):
        first = int(chunked.chunk_cu[s]) * 3
        assert int(chunked.chunk_cu[s + 1]) * 3 - first == -(-count // 3) * 3
        assert torch.equal(chunked.rows[first:first + count],
                           want.rows[int(want.pairs_cu[s]):int(want.pairs_cu[s + 1])])
    assert int((chunked.rows >= 0).sum()) == total


def selection_calls(calls) -> list:
    """test_sparse_flash_emulated.py's (``calls``) MoBA calls and block selections, as
    ``(label, run, earlier)``: ``run()`` checks the call as flash.py is patched when it runs,
    ``earlier``: whether the call attends to earlier blocks (all but the MoBA calls with top_k 1)."""
    steps = [(f"moba {call}", functools.partial(calls.test_moba_equals_the_reference, None, call),
              call["top_k"] > 1) for call in calls.MOBA_CALLS]
    return steps + [(f"block selection, {heads} selection heads",
                     functools.partial(calls.test_block_selection_equals_the_reference, None, heads), True)
                    for heads in (2, 4)]


def check_gather_rows(flash) -> None:
    """The row gather on its own: rows wider than one chunk of columns, repeated rows, none, -1
    rows (a row of zeros), several tensors in one launch."""
    generator = torch.Generator().manual_seed(0)
    for shape, picks in (((37, 3, 200), 50), ((11, 600), 29), ((5, 2, 8), 0)):
        x = torch.randn(*shape, generator=generator)
        rows = torch.randint(0, shape[0], (picks,), generator=generator)
        assert torch.equal(flash._merge_kernels().gather_rows(x, rows), x[rows]), shape
        print(f"gather_rows {shape}, {picks} rows: ok", flush=True)
    x = torch.randn(6, 2, 300, generator=generator)
    rows = torch.tensor([3, -1, 0, -1, 5])
    want = torch.where((rows >= 0)[:, None, None], x[rows.clamp(min=0)], 0.0)
    assert torch.equal(flash._merge_kernels().gather_rows(x, rows), want)
    print("gather_rows with -1 rows: ok", flush=True)
    for sources in (2, 3):
        xs = [torch.randn(6, 2, 300, generator=generator) for _ in range(sources)]
        got = flash._merge_kernels().gather_rows(xs, rows)
        assert len(got) == sources
        for x, one in zip(xs, got):
            assert torch.equal(one, torch.where((rows >= 0)[:, None, None], x[rows.clamp(min=0)],
                                                0.0))
        print(f"gather_rows of {sources} tensors: ok", flush=True)


def main() -> None:
    triton_interpreter.setup()
    import flash_emulation
    import test_sparse_flash_emulated as calls
    from megatron_ext.kernels.sparse import flash

    flash_emulation.emulate(types.SimpleNamespace(setattr=setattr))
    flash.MERGE_DEVICE_TYPES.add("cpu")
    count = 0
    if triton_interpreter.takes_next():
        check_plan_example(flash, calls._plan_example())
        print("plan of the example: ok", flush=True)
    plans = [(2, 4, 2, 150, 32, 3), (1, 4, 1, 130, 16, 4), (2, 2, 2, 64, 16, 8), (1, 8, 2, 37, 8, 2),
             (1, 2, 2, 20, 32, 1)]
    for seed, sizes in triton_interpreter.share(enumerate(plans)):
        check_plan_against_pytorch(flash, seed, *sizes)
        print(f"plan {sizes} against the PyTorch plan: ok", flush=True)
    count += 1 + len(plans)
    merges = []
    merge_forward = flash._merge_kernels().merge_forward
    flash._merge_kernels().merge_forward = lambda *args: merges.append(1) or merge_forward(*args)
    steps = selection_calls(calls)
    for label, run, _ in triton_interpreter.share(steps):
        before = len(merges)
        run()
        assert len(merges) > before, label  # the Triton merge ran
        print(f"{label}: ok", flush=True)
    count += len(steps)
    # The earlier blocks on cuDNN (emulated) in chunks of 4 slots (most blocks' pairs fill
    # several, the last part full) and of 64 (one part-full chunk a block, padding chunks
    # past them): the chunk layout, the merge by slot and add_block_gradients.
    for chunk in (4, 64):
        flash_emulation.emulate_cudnn(types.SimpleNamespace(setattr=setattr), earlier_chunk=chunk)
        chunked = []
        forward = flash._cudnn_forward
        flash._cudnn_forward = lambda *args, **kw: chunked.append(kw) or forward(*args, **kw)
        for label, run, earlier in triton_interpreter.share(steps):
            chunked.clear()
            run()
            # a call with earlier blocks runs their chunks on (emulated) cuDNN, in one call
            assert sum(kw.get("causal") is False for kw in chunked) == int(earlier), label
            print(f"{label}, earlier blocks in chunks of {chunk}: ok", flush=True)
        count += len(steps)
    if triton_interpreter.takes_next():
        check_gather_rows(flash)
    count += 1
    triton_interpreter.report_passed(count)


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


if __name__ == "__main__":
    main()
