"""The sum of q/k gradients over a group of value heads (grouped heads), for the decay family's
Triton backend.

With grouped heads a q/k head serves ``Hv / Hk`` value heads, and the decay backward kernels write
the gradients of q and k per value head, in fp32 (the delta rule sums its own).
:func:`group_sum` adds each group's ``Hv / Hk`` rows and rounds once to the input's dtype, in one
pass over the fp32 gradient (torch's sum over that middle dim, then a cast, take two passes and a
slow reduction layout).
"""
import torch
import triton
import triton.language as tl

ROWS = 32  # output rows a program takes


@triton.jit
def _group_sum_kernel(x_ptr, out_ptr, rows, group, D: tl.constexpr, DP: tl.constexpr,
                      BR: tl.constexpr):
    """out[r, :] = sum_j x[r, j, :] for BR rows r of a contiguous [rows, group, D] x."""
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, DP)
    ok = (r < rows)[:, None] & (cols < D)[None, :]
    base = r.to(tl.int64)[:, None] * group * D + cols[None, :]
    acc = tl.zeros([BR, DP], dtype=tl.float32)
    for j in range(group):
        acc += tl.load(x_ptr + base + j * D, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok)


def group_sum(grad: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """``grad [..., Hv, D]`` (contiguous, Hv = heads x group, a group's value heads adjacent)
    -> ``[..., Hv / group, D]`` in ``dtype``: the sum over each group."""
    *lead, value_heads, dim = grad.shape
    out = torch.empty(*lead, value_heads // group, dim, device=grad.device, dtype=dtype)
    rows = out.numel() // dim if dim else 0
    if rows:
        _group_sum_kernel[(triton.cdiv(rows, ROWS),)](
            grad.contiguous(), out, rows, group, D=dim, DP=triton.next_power_of_2(dim), BR=ROWS)
    return out
