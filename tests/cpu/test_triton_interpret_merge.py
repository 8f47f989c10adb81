"""The Triton kernels that merge a block selection's two FlashAttention calls and gather the
rows of its pairs' call (kernels/sparse/triton_merge.py) on Triton's CPU interpreter, inside
flash.py's MoBA and block selection with the FlashAttention kernels emulated
(flash_emulation.py), forward and backward, against the fp32 reference; skipped where Triton is
not installed.

Run as a script under TRITON_INTERPRET=1 (triton_interpreter.run_as_script), every load and
store checked to stay inside the tensors of its launch: test_sparse_flash_emulated.py's MoBA
calls (a partial last block, every earlier block chosen, the own block only: no pairs at all,
four query heads on one key/value head, one partial block) and its block selections per query
head and per key/value head (G = 2 query heads per row), with and without a sink; the same calls
with the earlier blocks on cuDNN (emulated) in chunks of 4 and of 64 slots; and the row
gather alone (rows wider than a chunk of columns, repeated rows, no rows, -1 rows), on that
file's fp64 inputs and its 1e-6 relative tolerance (the kernels sum in fp32: ~1e-7). The same
calls with the PyTorch merge are that file's tests; the kernels on a GPU, in bf16 and with the
real FlashAttention and cuDNN kernels, are tests/gpu/test_sparse_flash.py's.
"""
import types

import triton_interpreter
from triton_interpreter import needs_triton


def main() -> None:
    triton_interpreter.setup()
    import flash_emulation
    import test_sparse_flash_emulated as calls
    from megatron_ext.kernels.sparse import flash

    flash_emulation.emulate(types.SimpleNamespace(setattr=setattr))
    flash.MERGE_DEVICE_TYPES.add("cpu")
    merges = []
    merge_forward = flash._merge_kernels().merge_forward
    flash._merge_kernels().merge_forward = lambda *args: merges.append(1) or merge_forward(*args)
    count = 0
    for call in calls.MOBA_CALLS:
        calls.test_moba_equals_the_reference(None, call)
        count += 1
        print(f"moba {call}: ok", flush=True)
    for selection_heads in (2, 4):
        calls.test_block_selection_equals_the_reference(None, selection_heads)
        count += 1
        print(f"block selection, {selection_heads} selection heads: ok", flush=True)
    assert len(merges) >= count, (len(merges), count)  # the Triton merge ran in every call
    # The earlier blocks on cuDNN (emulated) in chunks of 4 slots (most blocks' pairs fill
    # several, the last part full) and of 64 (one part-full chunk a block, padding chunks
    # past them): the chunk layout, the merge by slot and add_block_gradients.
    chunked = []
    for chunk in (4, 64):
        flash_emulation.emulate_cudnn(types.SimpleNamespace(setattr=setattr), earlier_chunk=chunk)
        forward = flash._cudnn_forward
        flash._cudnn_forward = lambda *args, **kw: chunked.append(kw) or forward(*args, **kw)
        for call in calls.MOBA_CALLS:
            calls.test_moba_equals_the_reference(None, call)
            count += 1
            print(f"moba {call}, earlier blocks in chunks of {chunk}: ok", flush=True)
        for selection_heads in (2, 4):
            calls.test_block_selection_equals_the_reference(None, selection_heads)
            count += 1
            print(f"block selection, {selection_heads} selection heads, chunks of {chunk}: ok",
                  flush=True)
    # every call with an earlier block ran its chunks on (emulated) cuDNN: all but MOBA_CALLS's
    # two with top_k = 1, for both chunk sizes
    assert sum(kw.get("causal") is False for kw in chunked) == 2 * (len(calls.MOBA_CALLS) - 2 + 2)
    # the row gather on its own: rows wider than one chunk of columns, repeated rows, none
    import torch

    generator = torch.Generator().manual_seed(0)
    for shape, picks in (((37, 3, 200), 50), ((11, 600), 29), ((5, 2, 8), 0)):
        x = torch.randn(*shape, generator=generator)
        rows = torch.randint(0, shape[0], (picks,), generator=generator)
        assert torch.equal(flash._merge_kernels().gather_rows(x, rows), x[rows]), shape
        count += 1
        print(f"gather_rows {shape}, {picks} rows: ok", flush=True)
    # -1 gathers a row of zeros
    x = torch.randn(6, 2, 300, generator=generator)
    rows = torch.tensor([3, -1, 0, -1, 5])
    want = torch.where((rows >= 0)[:, None, None], x[rows.clamp(min=0)], 0.0)
    assert torch.equal(flash._merge_kernels().gather_rows(x, rows), want)
    count += 1
    print("gather_rows with -1 rows: ok", flush=True)
    print(f"all {count} interpreter cases passed")


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__)


if __name__ == "__main__":
    main()
