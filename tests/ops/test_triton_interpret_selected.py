"""Our Triton kernels of DSA's and CSA's selected attention and indexer loss
(kernels/sparse/triton.py, triton_indexer.py) on Triton's CPU interpreter, forward and backward,
and what the "triton" backend refuses. Skipped where Triton is not installed.

The interpreter is chosen when the kernels are defined (TRITON_INTERPRET=1 must be set before
the module is imported), so the checks run in a subprocess: this file run as a script, which
loads tests/ops/test_sparse_triton.py and runs its ``check_case`` on every case of ``CASES``
(causal selections padded with -1, all -1 rows, K of 40 and 67 against 64-key blocks, grouped
heads and MHA, head dims 16 to 128, with and without a sink, CSA's window and entries; fp32,
bf16 and fp16; that module's tolerances) and its ``check_kl_case`` on every case of
``KL_CASES`` (the indexer loss's KL kernels) and ``check_index_scores`` (the indexer's scores,
and DSA's and CSA's selections on them), every load, store and atomic add checked to stay
inside the tensors of its launch; then the kernels' own first-use check in fp32 and the whole
indexer loss on them. bf16 dots are widened to fp32 first (triton_interpreter.widen_bf16_dots).
~2 minutes on two cores.

The interpreter runs each program as NumPy code: it checks the algebra, indexing and masking of
the kernels, not GPU code generation, layouts or speed.
"""
import os
import time

import pytest
import torch

import triton_interpreter
from megatron_ext.kernels import sparse
from triton_interpreter import needs_triton


def main() -> None:
    triton_interpreter.setup()
    triton_interpreter.widen_bf16_dots()
    checks = triton_interpreter.gpu_checks("test_sparse_triton")
    triton_interpreter.run_cases(checks.CASES, checks.check_case)
    triton_interpreter.run_cases(checks.KL_CASES, checks.check_kl_case)
    if triton_interpreter.takes_next():
        start = time.perf_counter()
        with triton_interpreter.auto_on_cpu("index_scores"):
            count = checks.check_index_scores("cpu")
        print(f"index scores and selections: {count} cases ok ({time.perf_counter() - start:.1f} s)",
              flush=True)
    if triton_interpreter.takes_next():
        from megatron_ext.kernels.sparse import triton

        start = time.perf_counter()
        with torch.inference_mode():  # a first use in an evaluation checks as any other
            errors = triton.check(torch.device("cpu"), torch.float32)
        assert all(error <= triton.CHECK_TOLERANCE[torch.float32] for error in errors.values()), errors
        print(f"first-use check (fp32): ok, worst {max(errors.values()):.1e} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    if triton_interpreter.takes_next():
        start = time.perf_counter()
        worst = checks.check_indexer_loss("cpu")
        print(f"indexer loss on the kernels (fp32): ok, worst {worst:.1e} "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
    triton_interpreter.report_passed(len(checks.CASES) + len(checks.KL_CASES))


@needs_triton
def test_kernels_on_the_interpreter():
    triton_interpreter.run_as_script(__file__, sharded=True)


def test_triton_backend_refusals_are_named():
    """Off CUDA (without the interpreter), for other dtypes and for the block-layout ops, the
    "triton" backend raises ValueError with the reason; "auto" on the CPU runs the gathered
    path."""
    q, k, v = torch.randn(1, 5, 2, 16), torch.randn(1, 5, 1, 16), torch.randn(1, 5, 1, 16)
    selected = torch.tensor([[[0, -1], [0, 1], [1, 2], [3, -1], [4, 2]]])
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="dsa_attention: backend 'triton' cannot run .*need a "
                                             "CUDA device, not 'cpu'"):
            sparse.dsa_attention(q, k, v, selected, backend="triton")
    with pytest.raises(ValueError, match=r"dsa_attention: backend 'triton' cannot run .*one dtype "
                                         r"among fp32, bf16 and fp16; got torch.float64"):
        sparse.dsa_attention(q.double(), k.double(), v.double(), selected, backend="triton")
    with pytest.raises(ValueError, match="softmax_attention: unknown backend 'triton'"):
        sparse.softmax_attention(q, k, v, backend="triton")
    torch.testing.assert_close(sparse.dsa_attention(q, k, v, selected, backend="auto"),
                               sparse.dsa_attention(q, k, v, selected, backend="gathered"),
                               rtol=0, atol=0)


if __name__ == "__main__":
    main()
