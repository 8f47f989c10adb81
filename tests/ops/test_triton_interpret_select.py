"""The Triton selection kernels (kernels/sparse/triton_select.py) on Triton's CPU interpreter:
tests/ops/test_sparse_select.py's ``check`` (the top-k block choice; every load and store
checked to stay inside the tensors of its launch), ``check_words`` (DSA's and CSA's
bitmap), ``check_importance`` (NSA's block importance) and ``check_moba`` (MoBA's selection in
one kernel), in fp32 and fp16 (the interpreter's tl.dot multiplies bf16 as raw integers, so bf16
runs on the GPU only), MoBA's first-use check failing a wrong kernel, then MoBA's and NSA's
selections (kernels/sparse/layout.py) with the kernel in place
against them with it off. Skipped where Triton is not installed.
"""
import triton_interpreter
from triton_interpreter import needs_triton


def main() -> None:
    import torch

    triton_interpreter.setup()
    checks = triton_interpreter.gpu_checks("test_sparse_select")
    print(f"kernel: {checks.check('cpu')} cases ok", flush=True)
    print(f"bitmap words and bias: {checks.check_words('cpu')} cases ok", flush=True)
    ran = checks.check_importance("cpu", (torch.float32, torch.float16))
    print(f"NSA importance: {ran} cases ok", flush=True)
    print(f"MoBA selection: {checks.check_moba('cpu', (torch.float32, torch.float16))} cases ok",
          flush=True)
    from megatron_ext.kernels.sparse import layout

    generator = torch.Generator().manual_seed(1)
    q, k = (torch.randn(2, 300, 4, 16, generator=generator) for _ in range(2))
    compressed = torch.randn(2, 17, 2, 16, generator=generator)
    selections = {
        "moba": lambda: layout.moba_chosen(q, k, 32, 3),
        "nsa": lambda: layout.nsa_chosen(q, compressed, compress_block=32, compress_stride=16,
                                         select_block=32, select_top_k=4, scale=0.25),
    }
    for name, select in selections.items():
        want = select()
        with triton_interpreter.auto_on_cpu(*layout.SELECTION_OPS):
            got = select()
        assert torch.equal(got, want), name
        print(f"{name} selection: ok", flush=True)
    from megatron_ext.kernels.sparse import triton_select
    # The selections above ran in the kernels: their first-use checks passed.
    assert triton_select.importance_checked(torch.device("cpu"), torch.float32)
    assert triton_select.moba_checked(torch.device("cpu"), torch.float32)
    # A kernel that chooses one block too many fails MoBA's check; its selection falls back.
    kernel = triton_select.moba_chosen
    triton_select.moba_chosen = lambda q, means, size, top_k: kernel(q, means, size, top_k + 1)
    try:
        errors = triton_select.check_moba("cpu", torch.float16)
        assert errors["chosen_rows"] > triton_select.MOBA_CHECK_TOLERANCE, errors
        assert not triton_select.moba_checked(torch.device("cpu"), torch.float16)
        with triton_interpreter.auto_on_cpu(*layout.SELECTION_OPS):
            got = layout.moba_chosen(q.half(), k.half(), 32, 3)
        assert torch.equal(got, layout.moba_chosen(q.half(), k.half(), 32, 3))
    finally:
        triton_select.moba_chosen = kernel
    print(f"a wrong MoBA kernel fails its check ({errors}) and is passed over", flush=True)
    print("all interpreter cases passed")


@needs_triton
def test_kernel_on_the_interpreter():
    triton_interpreter.run_as_script(__file__)


if __name__ == "__main__":
    main()
