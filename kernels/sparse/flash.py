"""Softmax attention with a sliding window and a learnable sink on torch's FlashAttention-2
kernels: ``torch.ops.aten._flash_attention_forward`` / ``_flash_attention_backward``, called
in their packed ("varlen") form, as ``torch.nn.attention.varlen`` calls them.

They cover what a window or a sink needs and SDPA cannot pass them: a causal and/or sliding
window ``(left, right)`` (FlashAttention's ``window_size``, the same convention as ours), packed
sequences (``cu_seqlens``; a batch is packed as B sequences of T tokens), grouped heads, on CUDA
GPUs of compute capability 8.0 or more, with fp16 or bf16 q, k, v of one head dim (a multiple
of 8, at most 256) and keys as long as the queries. No extra mask: calls with ``allowed`` go
to FlexAttention (``kernels.sparse``'s "auto" decides; :func:`unavailable_reason` says why).

The sink. The kernels return each query's log-sum-exp ``L`` of its scaled scores (natural
log). A sink ``s_h`` adds ``exp(s_h)`` to the softmax denominator, so with
``L' = logaddexp(L, s_h)`` the output is ``o' = o * exp(L - L')``. The backward kernel
recomputes each row's probabilities as ``exp(score - L)`` and uses ``D = rowsum(dO * O)``;
given ``L'`` and ``o'`` instead, those are the sink softmax's own probabilities ``p'`` and its
``D``, and the kernel's ``dS = p' * (dO . v - D)`` is that softmax's exact gradient (the sink
is one more column, with a zero value vector). The sink's own gradient is
``d s_h = -sum over the rows of head h of exp(s_h - L') * D``.

The kernels run only after a first-use check per device and dtype (:func:`checked`): a small
call with a window, a sink, grouped heads and packed sequences, forward and backward, against
the fp32 reference; a failure is logged once and "auto" keeps FlexAttention.
"""
from __future__ import annotations

import functools
import logging

import torch

from .reference import OP, softmax_attention_reference

__all__ = ["flash_attention", "unavailable_reason", "checked"]

_log = logging.getLogger(__name__)

MAX_HEAD_DIM = 256
# Relative error (Frobenius norm) the first-use check allows on the output and each gradient:
# bf16 rounding of q, k, v, o and the kernels' P gives a few 1e-3. At the check's packed call,
# measured with the reference: a window one token off gives 0.15 to 0.19, a scale 10% off 0.08
# to 0.14 (output and gradients).
CHECK_TOLERANCE = 2e-2


def unavailable_reason(q, k, v, *, allowed=None) -> str | None:
    """Why the FlashAttention kernels cannot run this call, or None."""
    if q.dtype not in (torch.float16, torch.bfloat16) or not q.dtype == k.dtype == v.dtype:
        return f"FlashAttention takes fp16 or bf16 q, k and v of one dtype; got {q.dtype}, {k.dtype}, {v.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > MAX_HEAD_DIM:
        return f"FlashAttention takes head dims that are multiples of 8 up to {MAX_HEAD_DIM}; got {q.shape[-1]}"
    if k.shape[1] != q.shape[1]:
        return f"the keys ({k.shape[1]}) are not as long as the queries ({q.shape[1]})"
    if allowed is not None:
        return "FlashAttention takes no extra mask ('allowed')"
    if q.device.type != "cuda":
        return "FlashAttention runs on CUDA only"
    if torch.cuda.get_device_capability(q.device) < (8, 0):
        return "FlashAttention needs a GPU of compute capability 8.0 or more"
    return None


def _kernel_forward(q, k, v, cu_seqlens, max_len, causal, left, right, scale):
    """FlashAttention-2 forward on packed ``[total, H, D]`` inputs: ``(o, lse [H, total])``."""
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, causal, False, scale=scale,
        window_size_left=left, window_size_right=right)
    return out, lse


def _kernel_backward(d_out, q, k, v, out, lse, cu_seqlens, max_len, causal, left, right, scale):
    """FlashAttention-2 backward: ``(dq, dk, dv)`` from the output and log-sum-exp given."""
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        d_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, causal,
        rng_state, unused, scale=scale, window_size_left=left, window_size_right=right)


class _FlashAttention(torch.autograd.Function):
    """Packed ``[total, H, D]`` q, k, v (and an fp32 sink ``[Hq]`` or None) -> o; see the
    module docstring for the sink."""

    @staticmethod
    def forward(ctx, q, k, v, sink, cu_seqlens, max_len, causal, left, right, scale):
        out, lse = _kernel_forward(q, k, v, cu_seqlens, max_len, causal, left, right, scale)
        if lse.shape != (q.shape[1], q.shape[0]):
            raise RuntimeError(f"{OP}: FlashAttention returned a log-sum-exp of shape "
                               f"{tuple(lse.shape)}, expected [H, total] = {[q.shape[1], q.shape[0]]}")
        if sink is not None:
            with_sink = torch.logaddexp(lse, sink.float()[:, None])
            wide = torch.promote_types(out.dtype, torch.float32)
            out = (out.to(wide) * torch.exp(lse - with_sink).t()[..., None]).to(out.dtype)
            lse = with_sink
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sink)
        ctx.options = (max_len, causal, left, right, scale)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse, cu_seqlens, sink = ctx.saved_tensors
        d_out = d_out.contiguous()
        dq, dk, dv = _kernel_backward(d_out, q, k, v, out, lse, cu_seqlens, *ctx.options)
        d_sink = None
        if sink is not None and ctx.needs_input_grad[3]:
            wide = torch.promote_types(out.dtype, torch.float32)
            delta = (d_out.to(wide) * out.to(wide)).sum(-1)  # [total, H]
            d_sink = -(torch.exp(sink.float()[:, None] - lse) * delta.t()).sum(1).to(sink.dtype)
        return dq, dk, dv, d_sink, None, None, None, None, None, None


def flash_attention(q, k, v, *, causal=True, window=None, sink=None, scale=None,
                    cu_seqlens=None):
    """``softmax_attention`` (same arguments, no ``allowed``) on the FlashAttention kernels.
    Call only where :func:`unavailable_reason` is None."""
    batch, seq_len, heads, dim = q.shape
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32,
                                  device=q.device)
        max_len = seq_len
    else:
        cu_seqlens = cu_seqlens.to(device=q.device, dtype=torch.int32)
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if len(cu_seqlens) > 1 else 0
    left, right = window if window is not None else (-1, -1)
    if causal:
        right = 0
    packed = [x.reshape(-1, *x.shape[2:]).contiguous() for x in (q, k, v)]
    out = _FlashAttention.apply(*packed, sink, cu_seqlens, max_len, causal, left, right, scale)
    return out.view(batch, seq_len, heads, dim)


@functools.cache
def checked(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels passed their first-use check on ``device`` in ``dtype`` (run once):
    two packed sequences of 37 and 64 tokens and a batch of 2 x 70, 4 query heads on 2
    key/value heads, D = 64, causal with a window of 17 and a sink, and a non-causal call
    without them, forward and backward (q, k, v and the sink) against the fp32 reference."""
    try:
        _check(device, dtype)
    except Exception as error:
        _log.warning("%s: the FlashAttention kernels failed their check on %s in %s (%s: %s); "
                     "FlexAttention runs instead", OP, device, dtype, type(error).__name__, error)
        return False
    return True


def _check(device: torch.device, dtype: torch.dtype) -> None:
    from ..selfcheck import relative_error

    generator = torch.Generator(device=device).manual_seed(0)
    calls = [(dict(batch=1, seq_len=101, cu_seqlens=torch.tensor([0, 37, 101], device=device)),
              dict(causal=True, window=(17, 0), sink=True)),
             (dict(batch=2, seq_len=70, cu_seqlens=None), dict(causal=False, window=None, sink=False))]
    with torch.autocast(device.type, enabled=False), torch.enable_grad():
        for shape, options in calls:
            q = torch.randn(shape["batch"], shape["seq_len"], 4, 64, device=device, generator=generator)
            k, v = (torch.randn(shape["batch"], shape["seq_len"], 2, 64, device=device,
                                generator=generator) for _ in range(2))
            leaves = {"q": q, "k": k, "v": v}
            if options["sink"]:
                leaves["sink"] = torch.randn(4, device=device, generator=generator)
            grad = torch.randn(q.shape, device=device, generator=generator)
            kwargs = dict(causal=options["causal"], window=options["window"],
                          cu_seqlens=shape["cu_seqlens"])
            results = {}
            for name, run, cast in (("flash", flash_attention, dtype),
                                    ("reference", softmax_attention_reference, torch.float32)):
                inputs = {key: (x.to(cast) if key != "sink" else x).requires_grad_()
                          for key, x in leaves.items()}
                out = run(inputs["q"], inputs["k"], inputs["v"], sink=inputs.get("sink"), **kwargs)
                grads = torch.autograd.grad(out.float(), list(inputs.values()), grad)
                results[name] = [out.float(), *(g.float() for g in grads)]
            for got, want in zip(results["flash"], results["reference"]):
                error = relative_error(got, want)
                if not error <= CHECK_TOLERANCE:
                    raise AssertionError(f"relative error {error:.2e} > {CHECK_TOLERANCE} at "
                                         f"{shape} {options}")
