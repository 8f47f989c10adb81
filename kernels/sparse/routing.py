"""What the sparse ops share: the backend names and the choice behind "auto" for the block
layouts (gathered / flex) and flash.py, the layouts' block sizes, the sink's check."""
import torch

from . import flash
from .flex import flex_attention_layout
from .gathered import gathered_attention
from .reference import OP


BACKENDS = ("auto", "reference", "gathered", "flex", "triton")
_EXECUTORS = {"gathered": gathered_attention, "flex": flex_attention_layout}


# FlexAttention's compiled CUDA kernels take head dims of 16 and more (torch 2.11).
FLEX_MIN_HEAD_DIM = 16


def _backend(backend: str, q: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{OP}: backend={backend!r} is not one of {list(BACKENDS)}")
    if backend == "triton":
        raise ValueError(f"{OP}: backend='triton' runs dsa_attention and csa_attention only "
                         "(the Triton kernels of the per-token selected attention)")
    flex_fits = q.shape[-1] >= FLEX_MIN_HEAD_DIM or q.device.type != "cuda"
    if backend == "auto":
        return "flex" if q.device.type == "cuda" and flex_fits else "gathered"
    if backend == "flex" and not flex_fits:
        raise ValueError(f"{OP}: backend='flex' needs a head dim of at least "
                         f"{FLEX_MIN_HEAD_DIM} on CUDA (FlexAttention's kernels); got "
                         f"{q.shape[-1]}: use 'gathered' or 'auto'")
    return backend


def _runs_flash(backend: str, q, k, v, allowed, supported=True) -> bool:
    """Whether this call runs on flash.py: asked for ("flash", which raises ValueError with the
    reason where it cannot), or "auto" where flash.py covers the call and has passed its
    first-use check on this device and dtype. ``supported``: True, or what of the call's own
    options flash.py does not take."""
    if backend not in ("flash", "auto"):
        return False
    reason = flash.unavailable_reason(q, k, v, allowed=allowed)
    if reason is None and supported is not True:
        reason = f"flash.py does not take {supported}"
    if backend == "flash" and reason is not None:
        raise ValueError(f"{OP}: backend='flash' cannot run this call: {reason}")
    return reason is None and (backend == "flash" or flash.checked(q.device, q.dtype))


def _blocks(name: str, layout_blocks, gathered_default=(64, 64)):
    if layout_blocks is not None:
        return layout_blocks
    return (128, 128) if name == "flex" else gathered_default


def _check_sink(sink, q):
    if sink is not None and tuple(sink.shape) != (q.shape[2],):
        raise ValueError(f"{OP}: sink has shape {tuple(sink.shape)}, expected [Hq] = "
                         f"[{q.shape[2]}] (one logit per query head)")


def _check_top_k(top_k: int, num_blocks: int, what: str):
    if top_k > num_blocks:
        raise ValueError(f"{OP}: {what}: top_k={top_k} is more than the {num_blocks} blocks of "
                         "the sequence")
