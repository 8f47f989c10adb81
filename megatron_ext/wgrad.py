"""Weight gradients accumulated inside the GEMM, in Megatron's loop without apex.

Megatron's parallel linear layers keep an fp32 ``main_grad`` per weight. With
``gradient_accumulation_fusion`` on, their backward adds ``grad_output^T @ input`` into it in
one GEMM through apex's ``fused_weight_gradient_mlp_cuda``; with it off (what megatron-core
requires without apex), the GEMM writes a bf16 weight gradient and a second kernel adds that to
``main_grad`` in fp32 (a read and a write of every weight's fp32 gradient per micro-batch, and
the product rounded to bf16 before it is accumulated).

:func:`wgrad_gemm_accum_fp32` computes the same as apex's function of that name with torch's
``addmm(..., out_dtype=torch.float32)`` (cuBLAS: bf16 or fp16 operands, the fp32 accumulator
read and written by the GEMM itself). :func:`provide_gradient_accumulation_fusion` registers
these functions as the ``fused_weight_gradient_mlp_cuda`` module where apex is absent and they
pass a check against the fp32 product on this GPU, so that ``megatron-ext pretrain`` can turn
the fusion on; with apex installed nothing changes.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types

import torch

MODULE = "fused_weight_gradient_mlp_cuda"


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """``main_grad [out, in] (fp32) += grad_output [N, out]^T @ total_input [N, in]``, the
    operands in bf16 or fp16, accumulated in fp32 by the GEMM (CUDA)."""
    torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=torch.float32,
                out=main_grad)


def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor,
                          main_grad: torch.Tensor) -> None:
    """As :func:`wgrad_gemm_accum_fp32` for a ``main_grad`` in the operands' 16-bit dtype."""
    main_grad.addmm_(grad_output.t(), total_input)


def check_error(device: torch.device | str = "cuda") -> float:
    """Relative error of :func:`wgrad_gemm_accum_fp32` against the fp32 product added to an
    fp32 accumulator: 300 tokens (not a multiple of the GEMM's tiles) of bf16 operands,
    48 -> 40 features, accumulated twice."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randn(300, 48, generator=gen).to(device, torch.bfloat16)
    grads = torch.randn(300, 40, generator=gen).to(device, torch.bfloat16)
    start = torch.randn(40, 48, generator=gen).to(device)
    main_grad = start.clone()
    for _ in range(2):
        wgrad_gemm_accum_fp32(inputs, grads, main_grad)
    expected = start + 2 * grads.float().t() @ inputs.float()
    return ((main_grad - expected).norm() / expected.norm()).item()


def provide_gradient_accumulation_fusion() -> bool:
    """Whether Megatron's gradient accumulation fusion can run: apex's module imports, or ours
    is registered in its place (a CUDA GPU where :func:`check_error` is below 1e-5). Call it
    before Megatron's arguments are built: ``megatron_ext.pretrain`` passes
    ``--no-gradient-accumulation-fusion`` when no such module can be found."""
    if importlib.util.find_spec(MODULE) is not None:
        return True
    if not torch.cuda.is_available():
        return False
    try:
        error = check_error()
    except (TypeError, RuntimeError):  # addmm takes no out_dtype in this torch, or not here
        return False
    if not error < 1e-5:
        return False
    module = types.ModuleType(MODULE, __doc__.split("\n\n")[0])
    module.__spec__ = importlib.machinery.ModuleSpec(MODULE, loader=None)
    module.wgrad_gemm_accum_fp32 = wgrad_gemm_accum_fp32
    module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp16
    sys.modules[MODULE] = module
    # megatron-core's layers looked for the module when they were first imported.
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True
    return True
