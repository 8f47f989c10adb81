"""What the residual-stream Triton kernels share (triton_sinkhorn.py, triton_mhc.py,
triton_depth.py): an IEEE division, a program's block of tokens, and the device to launch on."""
import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["divide", "block_tokens", "launch_device"]


@triton.jit
def divide(x, y):
    """``x / y`` rounded to nearest (as PyTorch divides; Triton's ``/`` is the approximate
    div.full.f32 on NVIDIA GPUs), ``y`` broadcast to ``x``'s shape."""
    x, y = tl.broadcast(x, y)
    return tl.math.div_rn(x, y)


@triton.jit
def block_tokens(T, BLOCK_T: tl.constexpr):
    """This program's BLOCK_T tokens (int64) and which of them exist (< T)."""
    tok = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    return tok, tok < T


def launch_device(device: torch.device):
    """The context to launch a kernel for tensors on ``device`` in: that CUDA device current,
    or nothing (CPU tensors under Triton's interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
