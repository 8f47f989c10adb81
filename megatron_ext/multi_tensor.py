"""Multi-tensor gradient norm and scaling for megatron-core's optimizer where neither Transformer
Engine nor apex is installed.

megatron-core's optimizer clips gradients and copies its fp32 parameters into the model's
through apex's (or TE's) ``multi_tensor_l2norm`` and ``multi_tensor_scale``, which run a whole
list of tensors in a few kernels. Without either it falls back to
``megatron.core.utils.local_multi_tensor_l2_norm`` and ``local_multi_tensor_scale``, which loop
over the tensors in Python: a norm per tensor, then ``torch.tensor`` of that list of GPU
scalars, which reads each back to the host (one synchronisation per parameter tensor), and a
multiply and a copy per tensor for each scaling. The step's optimizer phase is then bound by
the host, and the more parameter tensors a model has, the longer the GPU idles: mHC adds three
per sublayer, Attention Residuals two (on an H200, 350M-class model, micro-batch 8, the GPU
then idles milliseconds of every step waiting for the host, almost all of it in the optimizer
phase, and about three times as long in an mHC or block AttnRes step as in a standard one).

:func:`l2_norm` and :func:`scale` compute the same with torch's ``_foreach`` ops (a few
multi-tensor kernels for the whole list, no synchronisation); :func:`use_foreach_multi_tensor_ops`
puts them where megatron-core uses its Python fallbacks, and nowhere else (with apex or TE
present nothing changes). Like those fallbacks they ignore the ``noop_flag`` buffer, in which
apex's kernels flag non-finite values (megatron-core's clipping does not read it).
"""
from __future__ import annotations

import sys
from typing import Sequence

import torch

__all__ = ["l2_norm", "scale", "use_foreach_multi_tensor_ops"]


def l2_norm(chunk_size: int, noop_flag: torch.Tensor,
            tensor_lists: Sequence[Sequence[torch.Tensor]], per_tensor: bool, *args):
    """As apex's ``multi_tensor_l2norm``: ``(the L2 norm of all of tensor_lists[0] as one
    vector, a [1] fp32 tensor; each tensor's norm [len] fp32 where per_tensor, else None)``,
    on the tensors' device (fp32 norms whatever the tensors' dtype)."""
    del chunk_size, args
    tensors = list(tensor_lists[0])
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32))
    return torch.linalg.vector_norm(norms).reshape(1), (norms if per_tensor else None)


def scale(chunk_size: int, noop_flag: torch.Tensor,
          tensor_lists: Sequence[Sequence[torch.Tensor]], factor: float) -> None:
    """As apex's ``multi_tensor_scale``: ``dst = src * factor`` for each pair of
    ``tensor_lists = [srcs, dsts]``, rounded to dst's dtype (in place where src is dst)."""
    del chunk_size, noop_flag
    sources, targets = list(tensor_lists[0]), list(tensor_lists[1])
    if len(sources) != len(targets):
        raise ValueError(f"multi-tensor scale: {len(sources)} sources for {len(targets)} targets")
    if not sources:
        return
    if all(s is t for s, t in zip(sources, targets)):
        torch._foreach_mul_(targets, factor)
    elif factor == 1.0:
        torch._foreach_copy_(targets, sources)
    else:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, factor))


def use_foreach_multi_tensor_ops() -> bool:
    """Replace megatron-core's per-tensor Python fallbacks of the gradient norm and of the
    multi-tensor scale (in its ``optimizer.clip_grads`` and ``optimizer.optimizer`` modules, and
    the parameter norm of ``megatron.training``'s ``--log-params-norm`` where that module is
    loaded) by :func:`l2_norm` and :func:`scale`; only those fallbacks, so with apex or
    Transformer Engine installed this does nothing. Call it before the optimizer's first step
    (``megatron-ext train`` and ``pretrain`` do). Returns whether anything was replaced."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    places = [(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm, l2_norm),
              (clip_grads, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, scale),
              (optimizer, "multi_tensor_scale_impl", utils.local_multi_tensor_scale, scale)]
    training = sys.modules.get("megatron.training.utils.common_utils")
    if training is not None:
        places.append((training, "multi_tensor_l2norm", utils.local_multi_tensor_l2_norm,
                       l2_norm))
    replaced = False
    for module, name, fallback, ours in places:
        if getattr(module, name, None) is fallback:
            setattr(module, name, ours)
            replaced = True
    return replaced
